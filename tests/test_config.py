import pytest

from horizonrl.config import ConfigError, load_config, parse_overrides


def test_overrides_use_agentgym_names(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: {path: /m}\nenvs: [{name: signpost}]\n")
    cfg = load_config(path, ["algorithm.rounds_ctrl.type=scaling_inter_stepwise",
                             "algorithm.rounds_ctrl.rounds=[10,20,30]", "algorithm.adv_estimator=grpo",
                             "rollout.n=4"])
    assert cfg.algorithm.rounds_ctrl.rounds == [10, 20, 30]
    assert cfg.rollout.n == 4
    with pytest.raises(Exception):
        cfg.rollout.n = 5  # frozen after parsing


def test_errors_say_what_to_fix(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError) as err:
        load_config(None, ["model.path=/m", "envs=[{name: signpost}]", "learner.lr=-1", "rollout.nn=3"])
    assert "learner.lr" in str(err.value) and "rollout.nn" in str(err.value)
    with pytest.raises(ConfigError, match="dotted.key=value"):
        parse_overrides(["novalue"])
    with pytest.raises(ConfigError, match="rounds"):
        load_config(None, ["model.path=/m", "envs=[{name: signpost}]", "algorithm.rounds_ctrl.rounds=[]"])
