from pathlib import Path

import pytest
from pydantic import ValidationError

from horizonrl.core.config import ConfigError, load_config, parse_overrides

REPO = Path(__file__).resolve().parents[1]


def test_overrides_use_agentgym_names(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: {path: /m}\nenvs: [{name: signpost}]\n")
    cfg = load_config(path, ["algorithm.rounds_ctrl.type=scaling_inter_stepwise",
                             "algorithm.rounds_ctrl.rounds=[10,20,30]", "algorithm.adv_estimator=grpo",
                             "rollout.n=4"])
    assert cfg.algorithm.rounds_ctrl.rounds == [10, 20, 30]
    assert cfg.rollout.n == 4
    with pytest.raises(ValidationError, match="frozen"):
        cfg.rollout.n = 5  # frozen after parsing
    assert cfg.rollout.n == 4


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


def test_synchronous_rollout_needs_every_group_kept():
    base = ["model.path=/m", "envs=[{name: signpost}]", "rollout.synchronous=true"]
    with pytest.raises(ConfigError, match="skip_equal_reward_groups=false"):
        load_config(None, base)
    assert load_config(None, [*base, "buffer.skip_equal_reward_groups=false"]).rollout.synchronous


def test_a_buffer_smaller_than_one_batch_is_refused():
    """The buffer stops reading at capacity_groups ready groups: below one learner step's worth nothing
    would ever train (the run would wait, not fail), so the config says so at once."""
    base = ["model.path=/m", "envs=[{name: signpost}]", "learner.groups_per_step=12"]
    with pytest.raises(ConfigError, match=r"capacity_groups \(11\) is below learner.groups_per_step \(12\)"):
        load_config(None, [*base, "buffer.capacity_groups=11"])
    assert load_config(None, [*base, "buffer.capacity_groups=12"]).buffer.capacity_groups == 12


def test_synchronous_actors_split_one_batch_between_them():
    from types import SimpleNamespace

    from horizonrl.actors.actor import Actor

    cfg = load_config(None, ["model.path=/m", "envs=[{name: signpost}]", "rollout.num_actors=3",
                             "learner.groups_per_step=8"])
    shares = [Actor.synchronous_share(SimpleNamespace(config=cfg, index=i)) for i in range(3)]
    assert shares == [3, 3, 2]


def test_supervision_settings_from_the_command_line():
    config = load_config(REPO / "configs" / "signpost_test.yaml", ["supervision.recover=off", "supervision.restart=false"])
    assert config.supervision.recover == "off" and config.supervision.restart is False  # YAML's bare off is False
    assert load_config(REPO / "configs" / "signpost_test.yaml").supervision.recover == "auto"


SCALING_INTER_ARMS = ["babyai_budget_fixed_short.yaml", "babyai_budget_fixed_long.yaml", "babyai_budget_scaling.yaml"]
SMOLLM2_SCALING_INTER_ARMS = ["smollm2_budget_fixed_short.yaml", "smollm2_budget_fixed_long.yaml",
                              "smollm2_budget_scaling.yaml"]  # the same study with SmolLM2 (a short budget of 1)


LEARNING_CONFIGS = ["textcraft.yaml", "textcraft_renamed.yaml", "searchqa.yaml", "searchqa_1hop.yaml",
                    "searchqa_multihop.yaml", "searchqa_multihop_names.yaml"]
BENCH_CONFIGS = ["bench_heavy_tail.yaml",  # the training benchmark's long-tailed workload
                 "bench_rising_budget.yaml"]  # adaptive vs fixed groups in flight under a rising budget
PRETRAINED_CONFIGS = ["smollm2_babyai.yaml", "smollm2_textcraft.yaml", "smollm2_searchqa.yaml"]  # SmolLM2-135M-Instruct, imported and format-warmed by `horizonrl demo`
TURN_CREDIT_CONFIGS = ["signpost_long.yaml"]  # outcome-only GRPO against GiGPO (scripts/compare_turn_credit.py)
AGENT_CONFIGS = ["agent_babyai.yaml"]  # an openai-client agent through the endpoint (docs/agents.md)


@pytest.mark.parametrize("name", ["demo.yaml", "signpost_test.yaml", "webarena_tiny.yaml", "sft_signpost.yaml",
                                  "dpo_signpost.yaml", *SCALING_INTER_ARMS, *SMOLLM2_SCALING_INTER_ARMS,
                                  *LEARNING_CONFIGS, *BENCH_CONFIGS, *PRETRAINED_CONFIGS, *TURN_CREDIT_CONFIGS,
                                  *AGENT_CONFIGS])
def test_shipped_configs_load(name):
    from horizonrl.core.offline_config import load_offline_config

    loader = load_offline_config if name.startswith(("sft", "dpo")) else load_config
    config = loader(REPO / "configs" / name)
    assert config is not None
    if name in AGENT_CONFIGS:
        assert config.rollout.agent.command[0] == "python" and (REPO / config.rollout.agent.command[1]).is_file()
    if name == "demo.yaml":  # the schedule the demo's learning was measured with
        assert (config.learner.lr, config.learner.lr_schedule, config.learner.min_lr_ratio) == (6e-4, "linear", 0.1)


def test_every_shipped_config_is_covered():
    assert sorted(p.name for p in (REPO / "configs").glob("*.yaml")) == sorted(
        ["demo.yaml", "signpost_test.yaml", "webarena_tiny.yaml", "sft_signpost.yaml", "dpo_signpost.yaml",
         *SCALING_INTER_ARMS, *SMOLLM2_SCALING_INTER_ARMS, *LEARNING_CONFIGS, *BENCH_CONFIGS, *PRETRAINED_CONFIGS,
         *TURN_CREDIT_CONFIGS, *AGENT_CONFIGS])


def test_a_pretrained_recipe_makes_the_demo_import_and_warm_up_the_model():
    config = load_config(REPO / "configs" / "smollm2_babyai.yaml")
    recipe = config.model.pretrained
    assert recipe.packaged == "smollm2" and recipe.format_warmup.steps == 30
    assert config.learner.compute_dtype == "bfloat16" and config.rollout.engine.dtype == "bfloat16"


@pytest.mark.parametrize("arms, long_budget, schedules", [
    (SCALING_INTER_ARMS, 8, [("fixed", [2]), ("fixed", [8]), ("scaling_inter_stepwise", [2, 4, 8])]),
    (SMOLLM2_SCALING_INTER_ARMS, 4, [("fixed", [1]), ("fixed", [4]), ("scaling_inter_stepwise", [1, 2, 4])])])
def test_scaling_inter_arms_differ_only_in_the_turn_schedule(arms, long_budget, schedules):
    # docs/learning.md, "ScalingInter-RL in miniature" and "with SmolLM2": same environment, model, learner steps
    # and evaluation
    configs = [load_config(REPO / "configs" / name).model_dump() for name in arms]
    for config in configs:
        config.pop("run")  # name and output_dir
        assert config["eval"]["max_turns"] == long_budget and config["eval"]["stop_after_plateau"] == 0
    found = [config["algorithm"].pop("rounds_ctrl") for config in configs]
    assert configs[0] == configs[1] == configs[2]
    assert [(s["type"], s["rounds"]) for s in found] == schedules


def test_a_weight_swap_keeps_the_requests_unless_told_and_the_old_setting_still_reads():
    from horizonrl.core.config import EngineConfig

    assert EngineConfig().on_weight_update == "keep"
    for old, meant in ((True, "recompute"), (False, "resubmit")):
        with pytest.warns(FutureWarning, match=f"use on_weight_update={meant}"):
            assert EngineConfig(recompute_kv_on_update=old).on_weight_update == meant
    with pytest.raises(ValidationError, match="contradicts on_weight_update=keep"):
        EngineConfig(recompute_kv_on_update=True, on_weight_update="keep")
    with pytest.raises(ValidationError, match="keep"):
        EngineConfig(on_weight_update="pause")
