"""The models the test suite builds and shares (tests/conftest.py's fixtures), each built once into a directory
of .cache/ (or the user cache) and reused while its recipe matches.

Building them takes minutes of one CPU core (the tiny models' warm-ups run on one torch thread so that their weights
do not depend on the machine). conftest.py therefore starts the builds the selected tests will need in the
background as the session begins, two processes side by side, and runs the test files that need no model first:
the second core, idle during the one-threaded tests, builds. A fixture that asks for a model still being built
waits on the build's lock (horizonrl/apps/tiny_model.py ``build_once_into``) and reuses it; if a background build
failed, the fixture builds the model itself, so a broken build fails the tests that need it, as it would without
the background.

``python tests/suite_models.py NAME...`` builds the named models in turn (the background builder; also a way to
build them before a run).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / ".cache"

# Compact WebArena observations (the first 500 characters of the tree, no link URLs) keep contexts short.
WEBARENA_SETTINGS = {"instructions": "short", "link_urls": False, "max_observation_chars": 500}
# The WebArena smoke test's model: it must only reply, not act well, so its warm-up is short (its loss is ~4 after
# 12 steps; 40 steps, loss ~0.9, cost about a minute more of the suite for nothing that test checks).
WEBARENA_TINY_RECIPE = dict(envs=("webarena",), env_settings={"webarena": WEBARENA_SETTINGS}, episodes_per_env=48,
                            warmup_steps=12, max_turns=3)


def signpost_model() -> Path:
    """The Signpost model `horizonrl bench` uses (``tiny_model``): most whole-run tests play it."""
    from horizonrl.apps.tiny_model import SIGNPOST_TEST_RECIPE, ensure_tiny_model

    return Path(ensure_tiny_model(CACHE / "tiny-signpost", **SIGNPOST_TEST_RECIPE))


def signpost_cached_model() -> Path:
    """The Signpost model of the offline-learning and play-with-transformers tests, in the user cache (shared with
    the benchmarks that ask for it)."""
    from horizonrl.apps.tiny_model import SIGNPOST_TEST_MODEL, cached_tiny_model

    return Path(cached_tiny_model(**SIGNPOST_TEST_MODEL))


def demo_model() -> Path:
    """The demo's starting policy (horizonrl/apps/demo.py's recipe on configs/demo.yaml's BabyAI levels): what the
    BabyAI learning test trains, and the model the other BabyAI tests play with (~4 minutes)."""
    from horizonrl.apps.demo import TINY_MODEL_RECIPE
    from horizonrl.apps.tiny_model import ensure_tiny_model
    from horizonrl.core.config import load_config

    config = load_config(REPO / "configs" / "demo.yaml")
    return Path(ensure_tiny_model(CACHE / "tiny-demo", envs=tuple(s.name for s in config.envs),
                                  env_settings={s.name: dict(s.settings) for s in config.envs},
                                  **TINY_MODEL_RECIPE))


def webarena_model() -> Path:
    from horizonrl.apps.tiny_model import ensure_tiny_model

    return Path(ensure_tiny_model(CACHE / "tiny-webarena", **WEBARENA_TINY_RECIPE))


def smollm2_model() -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face checkpoint (`horizonrl make-model smollm2`, ~30 s)."""
    from horizonrl.apps.model_import import ensure_imported

    return ensure_imported(CACHE / "smollm2", packaged="smollm2")


BUILDS: dict[str, Callable[[], Path]] = {
    "signpost": signpost_model,
    "signpost-cached": signpost_cached_model,
    "demo": demo_model,
    "webarena": webarena_model,
    "smollm2": smollm2_model,
}

# Which model each fixture stands on (a fixture of one test module, `model_dir`, included).
MODEL_OF_FIXTURE = {
    "tiny_model": "signpost",
    "model_dir": "signpost-cached",
    "demo_tiny_model": "demo",
    "babyai_tiny_model": "demo",
    "recorded_babyai_run": "demo",
    "webarena_tiny_model": "webarena",
    "smollm2_model": "smollm2",
}

# The background builders: the demo's model (~250 s) beside the other four (~130 + ~60 + ~40 + ~30 s).
BUILDER_GROUPS = (("signpost", "signpost-cached", "webarena", "smollm2"), ("demo",))


def main(argv: list[str]) -> int:
    unknown = [name for name in argv if name not in BUILDS]
    if unknown or not argv:
        print(f"usage: python tests/suite_models.py NAME... (names: {', '.join(BUILDS)}); unknown: {unknown}",
              file=sys.stderr)
        return 2
    for name in argv:
        print(f"suite model {name}: building (or reusing)", file=sys.stderr, flush=True)
        path = BUILDS[name]()
        print(f"suite model {name}: ready at {path}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
