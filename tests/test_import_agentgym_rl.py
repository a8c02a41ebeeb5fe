"""`horizonrl import-agentgym-rl`: AgentGym-RL training scripts -> horizonrl configs (no engines)."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from horizonrl.apps.cli import main as cli_main
from horizonrl.core.config import ConfigError, dump_config, load_config
from horizonrl.apps.import_agentgym_rl import convert, find_overrides, parse_hydra_value, parse_script

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures" / "agentgym_rl"
TRAINER = "python3 -m verl.agent_trainer.main_ppo"


def words(script: str, **variables: str) -> list[list[str]]:
    return [c.words for c in parse_script(script, variables)]


# ------------------------------------------------------------------------------- the shell


def test_line_continuations_and_comments():
    script = "# a comment\nset -x  # trailing comment\npython3 -m mod \\\n    a=1 \\\n    b=2#not-a-comment\n"
    assert words(script) == [["set", "-x"], ["python3", "-m", "mod", "a=1", "b=2#not-a-comment"]]


def test_variables_expand_in_every_form():
    script = ('name="babyai"\nbase=models\npath=${base}/Qwen\n'
              'run x=$name y=${path} z=${unset_var:-fallback} w=${name:-other} v=${name}_train.json\n')
    assert words(script)[-1] == ["run", "x=babyai", "y=models/Qwen", "z=fallback", "w=babyai",
                                 "v=babyai_train.json"]


def test_assignment_default_sticks_and_later_assignments_win():
    assert words("echo ${a:=one}\necho $a\na=two\necho $a\n") == [["echo", "one"], ["echo", "one"], ["echo", "two"]]


def test_quotes():
    script = "x='a b'\necho '$x' \"$x\" $x \"\\$x\" 'it''s' \"\"\n"
    assert words(script) == [["echo", "$x", "a b", "a", "b", "$x", "its", ""]]


def test_unquoted_expansions_split_into_words_and_quoted_ones_do_not():
    script = 'ARGS="a=1 b=2"\ncmd $ARGS "$ARGS"\n'
    assert words(script) == [["cmd", "a=1", "b=2", "a=1 b=2"]]


def test_exports_prefixes_cd_redirections_and_pipes():
    script = ("export A=1\ncd AgentGym-RL\ncd sub/..\nB=2 C=$A python3 train.py k=v 2>&1 | tee log.txt > /dev/null\n"
              "echo done; echo again && echo more\n")
    commands = parse_script(script)
    train = commands[2]
    assert train.words == ["python3", "train.py", "k=v"]
    assert train.env == {"A": "1", "B": "2", "C": "1"}
    assert str(train.cwd) == "AgentGym-RL"
    assert [c.words for c in commands[3:]] == [["tee", "log.txt"], ["echo", "done"], ["echo", "again"],
                                               ["echo", "more"]]


def test_what_cannot_be_expanded_is_flagged_and_variables_can_be_given():
    commands = parse_script("model=$1\nrun path=$model when=$(date) n=$((1+2))\n")
    assert commands[0].problems == {1: "$1 is only known when the script runs", 2: commands[0].problems[2],
                                    3: commands[0].problems[3]}
    assert "command substitution" in commands[0].problems[2] and "arithmetic" in commands[0].problems[3]
    assert parse_script("model=$1\nrun path=$model\n", {"1": "/m"})[0].words == ["run", "path=/m"]


def test_hydra_values():
    assert parse_hydra_value("1e-6") == 1e-6 and parse_hydra_value("0.001") == 0.001
    assert parse_hydra_value("8") == 8 and parse_hydra_value("-1") == -1
    assert parse_hydra_value("True") is True and parse_hydra_value("false") is False
    assert parse_hydra_value("null") is None
    assert parse_hydra_value("[6,13,20]") == [6, 13, 20]
    assert parse_hydra_value("[console,'wandb']") == ["console", "wandb"]
    assert parse_hydra_value("'1e-6'") == "1e-6"
    assert parse_hydra_value("low_var_kl") == "low_var_kl"
    assert parse_hydra_value("http://127.0.0.1:36005") == "http://127.0.0.1:36005"


def test_the_trainer_command_is_found_and_its_other_arguments_reported():
    script = (f"{TRAINER} --config-name other a.b=1 +c.d=2 ~e.f notasetting\n")
    _, overrides, messages = find_overrides(parse_script(script))
    assert [(o.key, o.value, o.added) for o in overrides] == [("a.b", 1, False), ("c.d", 2, True)]
    assert any(m.startswith("ignored: --config-name other: the trainer reads another config file") for m in messages)
    assert any(m.startswith("ignored: ~e.f") for m in messages)
    assert any(m.startswith("ignored: notasetting: not a key=value setting") for m in messages)
    with pytest.raises(ConfigError, match="no AgentGym-RL training command"):
        find_overrides(parse_script("echo hello\n"))
    with pytest.raises(ConfigError, match="more than once"):
        find_overrides(parse_script(f"{TRAINER} a=1\n{TRAINER} a=2\n"))
    with pytest.raises(ConfigError, match="evaluation.*horizonrl eval"):
        find_overrides(parse_script("python3 -m verl.agent_trainer.main_generation agentgym.max_rounds=20\n"))
    # run as a file path, too
    assert find_overrides(parse_script("python verl/agent_trainer/main_ppo.py a=1\n"))[1][0].key == "a"


# ------------------------------------------------------------------------------ the mapping

BASE = ["actor_rollout_ref.model.path=/models/qwen", "actor_rollout_ref.rollout.n=4", "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.agentgym.task_name=babyai", "trainer.logger=[console]"]


def run(*overrides: str, base=BASE, prefix: str = "", **kwargs):
    script = f"{prefix}{TRAINER} \\\n    " + " \\\n    ".join([*base, *overrides]) + "\n"
    return convert(script, **kwargs)


def value(config, dotted: str):
    node = config
    for part in dotted.split("."):
        node = node[int(part)] if isinstance(node, list) else getattr(node, part)
    return node


@pytest.mark.parametrize("overrides, expected", [
    (["actor_rollout_ref.model.path=/x/y"], {"model.path": "/x/y"}),
    (["data.train_batch_size=12"], {"learner.groups_per_step": 12, "buffer.capacity_groups": 24}),
    (["data.train_batch_size=8"], {"learner.groups_per_step": 8, "buffer.capacity_groups": 16}),
    (["actor_rollout_ref.actor.ppo_mini_batch_size=4"], {"learner.ppo_mini_batch_size": 4}),
    (["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"], {"learner.micro_batch_size": 2}),
    (["actor_rollout_ref.actor.ppo_micro_batch_size=16", "trainer.n_gpus_per_node=4"], {"learner.micro_batch_size": 4}),
    (["actor_rollout_ref.actor.grad_clip=0.5"], {"learner.grad_clip": 0.5}),
    (["actor_rollout_ref.actor.clip_ratio=0.28"], {"learner.clip_ratio": 0.28}),
    (["actor_rollout_ref.actor.entropy_coeff=0"], {"learner.entropy_coeff": 0.0}),
    (["actor_rollout_ref.actor.ppo_epochs=3"], {"learner.ppo_epochs": 3}),
    (["actor_rollout_ref.actor.optim.lr=2e-6"], {"learner.lr": 2e-6}),
    (["+actor_rollout_ref.actor.optim.weight_decay=0.1"], {"learner.weight_decay": 0.1}),
    (["actor_rollout_ref.rollout.n=6"], {"rollout.n": 6}),
    (["actor_rollout_ref.rollout.temperature=0.8"], {"rollout.temperature": 0.8}),
    (["actor_rollout_ref.rollout.top_p=0.9"], {"rollout.top_p": 0.9}),
    (["actor_rollout_ref.rollout.max_tokens=256"], {"rollout.max_tokens_per_turn": 256}),
    (["actor_rollout_ref.rollout.gpu_memory_utilization=0.6"], {"rollout.engine.gpu_memory_utilization": 0.6}),
    (["actor_rollout_ref.rollout.enforce_eager=False"], {"rollout.engine.enforce_eager": False}),
    (["actor_rollout_ref.rollout.max_num_seqs=64"], {"rollout.engine.max_num_seqs": 64}),
    (["actor_rollout_ref.rollout.dtype=bfloat16"], {"rollout.engine.dtype": "bfloat16"}),
    (["actor_rollout_ref.rollout.dtype=fp16"], {"rollout.engine.dtype": "float16"}),
    (["actor_rollout_ref.rollout.tensor_model_parallel_size=2"], {"rollout.engine.tensor_parallel_size": 2}),
    (["data.max_prompt_length=512", "data.max_response_length=8192"], {"rollout.max_context_tokens": 8704}),
    (["actor_rollout_ref.rollout.max_model_len=3000", "data.max_prompt_length=1024"],
     {"rollout.max_context_tokens": 3000}),
    (["data.max_prompt_length=512", "actor_rollout_ref.rollout.response_length=1024"],
     {"rollout.max_context_tokens": 1536}),
    (["algorithm.adv_estimator=rloo"], {"algorithm.adv_estimator": "rloo"}),
    (["algorithm.adv_estimator=reinforce_plus_plus", "algorithm.gamma=0.99"],
     {"algorithm.adv_estimator": "reinforce_plus_plus", "algorithm.gamma": 0.99}),
    (["algorithm.adv_estimator=gae", "algorithm.lam=0.95", "critic.optim.lr=2e-5"],
     {"algorithm.adv_estimator": "gae", "algorithm.lam": 0.95, "algorithm.critic_lr": 2e-5}),
    (["algorithm.rounds_ctrl.type=fixed", "algorithm.rounds_ctrl.rounds=25"],
     {"algorithm.rounds_ctrl.type": "fixed", "algorithm.rounds_ctrl.rounds": [25]}),
    (["algorithm.rounds_ctrl.type=scaling_inter_stepwise", "algorithm.rounds_ctrl.rounds=[10,20,30]",
      "algorithm.rounds_ctrl.steps_scaling_inter=50"],
     {"algorithm.rounds_ctrl.type": "scaling_inter_stepwise", "algorithm.rounds_ctrl.rounds": [10, 20, 30],
      "algorithm.rounds_ctrl.steps_scaling_inter": 50}),
    (["actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_coef=0.01",
      "actor_rollout_ref.actor.kl_loss_type=kl"],
     {"learner.use_kl_loss": True, "learner.kl_loss_coef": 0.01, "learner.kl_loss_type": "k1"}),
    (["actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_type=mse"],
     {"learner.kl_loss_type": "k2"}),
    (["actor_rollout_ref.actor.use_kl_loss=False"], {"learner.use_kl_loss": False}),
    (["trainer.total_training_steps=77"], {"learner.total_steps": 77}),
    (["trainer.total_training_steps=50", "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.1"],
     {"learner.lr_warmup_steps": 5}),
    (["trainer.save_freq=10"], {"learner.save_every": 10}),
    (["trainer.save_freq=-1"], {"learner.save_every": 0}),
    (["trainer.experiment_name=exp1"], {"run.name": "exp1", "run.output_dir": "checkpoints/verl_examples/exp1"}),
    (["trainer.default_local_dir=saves/x"], {"run.output_dir": "saves/x"}),
    (["actor_rollout_ref.agentgym.task_name=textcraft"], {"envs.0.name": "textcraft", "eval.max_turns": 30}),
    (["actor_rollout_ref.agentgym.task_name=sciworld"], {"envs.0.name": "sciworld", "eval.max_turns": 30}),
    (["actor_rollout_ref.agentgym.task_name=searchqa"], {"envs.0.name": "searchqa", "eval.max_turns": 30}),
    (["actor_rollout_ref.agentgym.task_name=babyai"], {"envs.0.name": "babyai", "eval.max_turns": 20}),
    (["trainer.logger=[console,wandb]", "trainer.project_name=proj"],
     {"monitor.wandb.project": "proj", "monitor.wandb.mode": "online"}),
])
def test_each_mapping(overrides, expected):
    config = run(*overrides).config
    for dotted, want in expected.items():
        assert value(config, dotted) == want, dotted


def test_agentgym_rl_defaults_fill_what_the_script_leaves_out():
    config = run(base=["actor_rollout_ref.model.path=/m", "actor_rollout_ref.rollout.n=4"]).config
    assert config.algorithm.adv_estimator == "gae"  # AgentGym-RL's default estimator
    assert config.algorithm.critic_lr == 1e-5
    assert config.envs[0].name == "textcraft"
    assert config.learner.entropy_coeff == 0.001 and config.learner.weight_decay == 0.01
    assert config.learner.groups_per_step == 1024 and config.learner.ppo_mini_batch_size == 256
    assert config.rollout.max_tokens_per_turn == 1024 and config.rollout.max_context_tokens == 4096
    assert config.algorithm.rounds_ctrl.rounds == [15] and config.learner.use_kl_loss is False
    assert config.monitor.wandb.project == "verl_examples"  # its default logger includes wandb


def test_wandb_mode_comes_from_the_environment():
    assert run("trainer.logger=[console,wandb]", prefix="WANDB_MODE=offline ").config.monitor.wandb.mode == "offline"
    result = run("trainer.logger=[console,wandb]", prefix="export WANDB_MODE=disabled\n")
    assert result.config.monitor.wandb is None
    assert any(m.startswith("ignored: trainer.logger=[console,wandb]: WANDB_MODE=disabled") for m in result.messages)


def test_run_length_from_epochs_and_the_id_file(tmp_path):
    ids = tmp_path / "data" / "babyai_train.json"
    ids.parent.mkdir()
    ids.write_text("[" + ",".join(f'{{"item_id": "babyai_{i}"}}' for i in range(100)) + "]")
    script = tmp_path / "train.sh"
    script.write_text(f"{TRAINER} " + " ".join([*BASE, "data.train_file=data/babyai_train.json",
                                                "data.train_batch_size=8", "trainer.total_epochs=3"]) + "\n")
    result = convert(script.read_text(), script)
    assert result.config.learner.total_steps == (100 // 8) * 3
    assert any(m.startswith("no equivalent: data.train_file=data/babyai_train.json: horizonrl trains on the "
                            "environment's own train split") and "100 ids (babyai)" in m for m in result.messages)
    # a file not at hand: --train-items, else a note and horizonrl's default
    text = script.read_text().replace("data/babyai", "missing/babyai")
    assert convert(text, script, train_items=40).config.learner.total_steps == (40 // 8) * 3
    result = convert(text, script)
    assert "total_steps" not in result.config.learner.model_fields_set
    assert any(m.startswith("note: learner.total_steps left at horizonrl's default") for m in result.messages)
    # the environment is read from the id file when the script does not name it
    base = [o for o in BASE if "task_name" not in o]
    script.write_text(f"{TRAINER} " + " ".join([*base, "data.train_file=data/babyai_train.json",
                                                "data.train_batch_size=8"]) + "\n")
    assert convert(script.read_text(), script).config.envs[0].name == "babyai"


# ------------------------------------------------------------------- what is not mapped, and errors


def test_unmapped_settings_are_listed_with_the_reason():
    messages = run("actor_rollout_ref.rollout.top_k=50",
                   "actor_rollout_ref.rollout.top_k=-1", "trainer.nnodes=2", "data.val_files=val.json",
                   "actor_rollout_ref.agentgym.env_addr=http://127.0.0.1:36005", "foo.bar=1", "+trainer.extra=2",
                   "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1",
                   "actor_rollout_ref.actor.fsdp_config.param_offload=True", "trainer.model=$1").messages
    expected = [
        "ignored: actor_rollout_ref.rollout.top_k=-1: as horizonrl does anyway",  # the last one wins, as in Hydra
        "no equivalent: data.val_files=val.json: held-out evaluation uses the environment's test split",
        "ignored: actor_rollout_ref.agentgym.env_addr=http://127.0.0.1:36005: horizonrl runs the environment itself",
        "unknown: foo.bar=1: not a setting of AgentGym-RL's ppo_trainer.yaml",
        "unknown: trainer.extra=2: added with '+': AgentGym-RL's trainer does not read it",
        "ignored: actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1: the reference policy",
        "ignored: actor_rollout_ref.actor.fsdp_config.param_offload=True: sharding and offload",
        "unresolved: trainer.model=: $1 is only known when the script runs",
        "note: GPU placement: AgentGym-RL trains and generates on the same GPUs (trainer.nnodes × "
        "trainer.n_gpus_per_node = 2 × 8)",
    ]
    for line in expected:
        assert any(m.startswith(line) for m in messages), (line, messages)
    assert all(m.split(":")[0] in ("ignored", "no equivalent", "unknown", "unresolved", "note") for m in messages)
    assert all("\n" not in m for m in messages)


def test_kl_in_the_reward_has_no_equivalent():
    messages = run("actor_rollout_ref.actor.use_kl_loss=False", "algorithm.kl_ctrl.kl_coef=0.01").messages
    assert any(m.startswith("no equivalent: algorithm.kl_ctrl.kl_coef=0.01: with use_kl_loss=false AgentGym-RL "
                            "subtracts kl_coef × KL") for m in messages)
    messages = run("actor_rollout_ref.actor.use_kl_loss=True", "algorithm.kl_ctrl.kl_coef=0.01").messages
    assert any(m.startswith("ignored: algorithm.kl_ctrl.kl_coef=0.01: with use_kl_loss=True") for m in messages)
    assert not any("kl_ctrl" in m for m in run("actor_rollout_ref.actor.use_kl_loss=False",
                                                  "algorithm.kl_ctrl.kl_coef=0").messages)


@pytest.mark.parametrize("overrides, error", [
    (["actor_rollout_ref.agentgym.task_name=webarena"], "horizonrl has no 'webarena' environment"),
    (["algorithm.adv_estimator=remax"], "no ReMax estimator"),
    (["actor_rollout_ref.rollout.dtype=int8"], "not a dtype horizonrl's engine takes"),
    (["actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_type=abs"], "no 'abs' KL"),
    (["actor_rollout_ref.rollout.n=1"], r"rollout.n must be >= 2.*\(from actor_rollout_ref.rollout.n=1\)"),
    (["actor_rollout_ref.actor.optim.lr=-1"], r"learner.lr: .*\(from actor_rollout_ref.actor.optim.lr=-1\)"),
    (["algorithm.rounds_ctrl.type=fixed", "algorithm.rounds_ctrl.rounds=[10,20]"], "fixed schedule takes one number"),
    (["algorithm.rounds_ctrl.type=linear"], r"algorithm.rounds_ctrl.type: .*\(from algorithm.rounds_ctrl.type=linear"),
])
def test_what_horizonrl_cannot_run_is_an_error(overrides, error):
    with pytest.raises(ConfigError, match=error):
        run(*overrides)


def test_a_missing_model_path_is_an_error():
    with pytest.raises(ConfigError, match="model.path"):
        run(base=["actor_rollout_ref.rollout.n=4"])
    with pytest.raises(ConfigError, match="model.path"):
        run(base=["actor_rollout_ref.model.path=$MODEL", "actor_rollout_ref.rollout.n=4"])


def test_the_command_exits_2_with_the_message(tmp_path, capsys):
    script = tmp_path / "webarena.sh"
    script.write_text(f"{TRAINER} actor_rollout_ref.model.path=/m actor_rollout_ref.agentgym.task_name=webarena\n")
    assert cli_main(["import-agentgym-rl", str(script)]) == 2
    err = capsys.readouterr().err
    assert "error: actor_rollout_ref.agentgym.task_name=webarena: horizonrl has no 'webarena'" in err
    assert cli_main(["import-agentgym-rl", str(tmp_path / "missing.sh")]) == 2


def test_the_short_config_and_the_full_one_agree(tmp_path):
    result = convert((FIXTURES / "textcraft_train.sh").read_text(), FIXTURES / "textcraft_train.sh")
    short = tmp_path / "short.yaml"
    short.write_text(result.yaml())
    assert dump_config(load_config(short)) == result.yaml(full=True)
    assert "rounds: [30]" in result.yaml()


def test_the_converter_imports_only_the_bottom_layer():
    from test_dependencies import BOTTOM, files_of, imported_names, violations

    assert violations("apps/import_agentgym_rl", BOTTOM | {"apps"}) == []
    assert not [name for path in files_of("apps/import_agentgym_rl") for name in imported_names(path)
                if name.startswith("horizonrl.apps.") and not name.startswith("horizonrl.apps.import_agentgym_rl")]


# ------------------------------------------------------- the must-show: AgentGym-RL's examples -> train --dry-run

EXPECTED = {
    "babyai_scaling_inter_train.sh": {
        "model": {"path": "models/Qwen2.5-7B-Instruct"},
        "envs": [{"name": "babyai", "settings": {}, "weight": 1.0}],
        "rollout": {"n": 4, "temperature": 1.0, "top_p": 1.0, "max_tokens_per_turn": 512,
                    "max_context_tokens": 512 + 8192},
        "algorithm": {"adv_estimator": "grpo",
                      "rounds_ctrl": {"type": "scaling_inter_stepwise", "rounds": [6, 13, 20],
                                      "steps_scaling_inter": 100}},
        "learner": {"total_steps": (320 // 32) * 20, "groups_per_step": 32, "lr": 1e-6, "weight_decay": 0.01,
                    "clip_ratio": 0.2, "use_kl_loss": True, "kl_loss_coef": 0.001, "kl_loss_type": "low_var_kl",
                    "entropy_coeff": 0.001, "grad_clip": 1.0, "micro_batch_size": 1, "ppo_epochs": 2,
                    "ppo_mini_batch_size": 8, "save_every": 25},
        "eval": {"max_turns": 20},
        "run": {"name": "babyai_scaling_inter", "output_dir": "saves/babyai_scaling_inter"},
    },
    "textcraft_train.sh": {
        "model": {"path": "models/Qwen2.5-7B-Instruct"},
        "envs": [{"name": "textcraft", "settings": {}, "weight": 1.0}],
        "rollout": {"n": 8, "max_tokens_per_turn": 512, "max_context_tokens": 512 + 10240},
        "algorithm": {"adv_estimator": "grpo", "rounds_ctrl": {"type": "fixed", "rounds": [30]}},
        "learner": {"total_steps": (435 // 32) * 30, "groups_per_step": 32, "lr": 1e-6, "use_kl_loss": True,
                    "kl_loss_coef": 0.001, "kl_loss_type": "low_var_kl", "entropy_coeff": 0.001, "ppo_epochs": 2,
                    "ppo_mini_batch_size": 8, "micro_batch_size": 1},
        "eval": {"max_turns": 30},
        "run": {"name": "textcraft_fixed", "output_dir": "saves/textcraft_fixed"},
    },
}


def subset(want, got, where=""):
    if isinstance(want, dict):
        for key, item in want.items():
            subset(item, got[key], f"{where}.{key}")
    elif isinstance(want, list) and want and isinstance(want[0], dict):
        assert len(want) == len(got), where
        for i, (w, g) in enumerate(zip(want, got)):
            subset(w, g, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


@pytest.mark.parametrize("fixture", sorted(EXPECTED))
def test_agentgym_rl_examples_convert_to_configs_train_accepts(fixture, tmp_path):
    converted = subprocess.run([sys.executable, "-m", "horizonrl", "import-agentgym-rl", str(FIXTURES / fixture)],
                               cwd=REPO, capture_output=True, text=True, timeout=120)
    assert converted.returncode == 0, converted.stderr
    assert converted.stderr.strip(), "the unmapped settings are listed on stderr"
    for line in ("ignored: actor_rollout_ref.agentgym.env_addr=http://127.0.0.1:36005",
                 "no equivalent: data.train_file=AgentItemId/"):
        assert any(m.startswith(line) for m in converted.stderr.splitlines()), line
    out = tmp_path / "config.yaml"
    out.write_text(converted.stdout)

    dry = subprocess.run([sys.executable, "-m", "horizonrl", "train", str(out), "--dry-run"],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert dry.returncode == 0, dry.stderr
    subset(EXPECTED[fixture], yaml.safe_load(dry.stdout))
