"""The suite's background model builds (tests/suite_models.py, started by tests/conftest.py): every model has a
builder, every fixture the builds are keyed by exists, and the builder refuses what it does not know. A fixture
renamed without its entry here would quietly lose its background build (its tests would build it themselves)."""

import re
import subprocess
import sys
from pathlib import Path

import suite_models

TESTS = Path(__file__).resolve().parent


def test_every_model_is_built_by_one_background_builder():
    grouped = [name for group in suite_models.BUILDER_GROUPS for name in group]
    assert sorted(grouped) == sorted(suite_models.BUILDS)
    assert set(suite_models.MODEL_OF_FIXTURE.values()) <= set(suite_models.BUILDS)


def test_every_fixture_named_for_a_model_is_defined():
    sources = "\n".join(path.read_text() for path in TESTS.rglob("*.py"))
    for fixture in suite_models.MODEL_OF_FIXTURE:
        assert re.search(rf"@pytest\.fixture\([^)]*\)\ndef {fixture}\(", sources), fixture


def test_the_builder_names_what_it_can_build():
    out = subprocess.run([sys.executable, str(TESTS / "suite_models.py"), "no-such-model"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2
    assert "no-such-model" in out.stderr and all(name in out.stderr for name in suite_models.BUILDS)


def test_the_take_off_script_finds_the_learning_test_and_its_model(monkeypatch):
    """scripts/learning_take_off.py runs the learning test's procedure many times: it must find that procedure and
    the model the test trains (it once imported modules that had moved, and could not start)."""
    from helpers import load_script

    script = load_script("learning_take_off")
    monkeypatch.setattr(sys, "path", list(sys.path))  # learning_module() puts tests/ first on the path
    assert callable(script.learning_module().learning_run)
    monkeypatch.setattr(suite_models, "demo_model", lambda: Path("/built/demo"))  # the build itself: minutes
    assert script.demo_model() == Path("/built/demo")
    rows = [{"before": 0.2, "after": a, "rollout_early": 0.3, "rollout_late": 0.3 + a, "wall_s": 400.0}
            for a in (0.5, 0.6, 0.7)]
    summary = script.summary(rows, 1e-3)
    assert summary["held_out_rise"]["mean"] == 0.4 and summary["held_out_rise"]["min"] == 0.3
    assert summary["held_out_rise"]["bound"] < summary["held_out_rise"]["min"]
