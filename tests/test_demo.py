"""The demo's before -> after table (the run itself is tests/integration and `make demo`)."""

from pathlib import Path

from horizonrl.apps.demo import before_after_table

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def result(rate, episodes, categories=None):
    return {"success_rate": rate, "episodes_valid": episodes,
            "categories": {c: {"success_rate": r, "episodes_valid": n} for c, (r, n) in (categories or {}).items()}}


def test_one_row_per_environment_and_per_category_when_there_are_several():
    before = {"babyai": result(0.3, 200, {"GoToDoor": (0.4, 67), "GoToRedBall": (0.2, 133)}),
              "signpost": result(0.11, 100, {"length 2": (0.11, 100)})}
    after = {"babyai": result(0.9, 198, {"GoToDoor": (0.95, 66), "GoToRedBall": (0.87, 132)}),
             "signpost": result(0.97, 100, {"length 2": (0.97, 100)})}
    lines = before_after_table(before, after).splitlines()
    assert len(lines) == 5  # header, babyai, its two levels, signpost (one category: no sub-rows)
    assert lines[1].split() == ["babyai", "0.30", "->", "0.90", "(198)"]
    assert lines[2].split() == ["GoToDoor", "0.40", "->", "0.95", "(66)"]
    assert lines[3].split() == ["GoToRedBall", "0.20", "->", "0.87", "(132)"]
    assert lines[4].split() == ["signpost", "0.11", "->", "0.97", "(100)"]


def test_held_out_evaluation_plays_each_task_samples_per_task_times(monkeypatch):
    """eval.samples_per_task reaches the evaluation: TextCraft's depth-1 goals hold 25 held-out goals, played
    8 times each."""
    import horizonrl.actors.evaluate as evaluate_module
    from horizonrl.core.config import load_config
    from horizonrl.apps.demo import held_out_success

    config = load_config(CONFIGS / "textcraft.yaml", [])
    specs = []
    monkeypatch.setattr(evaluate_module, "evaluate", lambda model, spec, make_env, engine: specs.append(spec) or {})
    held_out_success("unused", config)
    [spec] = specs
    assert (spec.env, spec.split, spec.episodes, spec.samples_per_task) == ("textcraft", "test", 25, 8)
    assert spec.env_settings == {"max_depth": 1} and spec.max_turns == 6
    assert spec.system_prompt is None
    # played as in training: the rollout's system prompt too (the demo's table once evaluated without it)
    config = load_config(CONFIGS / "textcraft.yaml", ["rollout.system_prompt=Craft the goal."])
    held_out_success("unused", config)
    assert specs[-1].system_prompt == "Craft the goal."


def test_the_tiny_model_recipe_comes_from_the_config_and_defaults_to_the_tests_recipe():
    from horizonrl.core.config import load_config
    from horizonrl.apps.demo import TINY_MODEL_RECIPE

    config = load_config(CONFIGS / "demo.yaml", [])
    assert config.model.tiny.model_dump() == TINY_MODEL_RECIPE == {"episodes_per_env": 1500, "warmup_steps": 200,
                                                                  "max_turns": 6, "layers": 2, "hidden": 128,
                                                                  "device": "cpu"}
    config = load_config(CONFIGS / "demo.yaml", ["model.tiny.warmup_steps=50"])
    assert config.model.tiny.warmup_steps == 50 and config.model.tiny.episodes_per_env == 1500


def test_the_model_is_built_in_a_child_process_and_its_failure_is_an_error(tmp_path):
    """The demo builds a pretrained model's warm-up in a child process (its memory goes back to the system before
    training): what the child makes is there afterwards, and a child that fails is an error here."""
    import os

    import pytest

    from horizonrl.apps.demo import build_in_child

    made = tmp_path / "made"
    build_in_child(Path.touch, made)
    assert made.exists()
    with pytest.raises(RuntimeError, match="exit code 1"):
        build_in_child(os.remove, tmp_path / "missing")


def test_a_build_past_its_time_limit_is_stopped_and_is_an_error():
    import time

    import pytest

    from horizonrl.apps.demo import build_in_child

    started = time.monotonic()
    with pytest.raises(TimeoutError, match="took over 2 s"):
        build_in_child(time.sleep, 120, timeout_s=2)
    assert time.monotonic() - started < 60  # stopped, not waited for
