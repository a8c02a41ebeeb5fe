import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from no_skips import pytest_addoption, pytest_runtest_makereport  # noqa: E402,F401  (hooks: a skip is a failure)

from horizonrl.tiny_model import SIGNPOST_TEST_RECIPE as TINY_MODEL_ARGS  # noqa: E402  (the model `horizonrl bench` uses)

REPO = Path(__file__).resolve().parents[1]
# Built once and reused across sessions while the recipe and arguments match (its spec file says so).
TINY_MODEL_DIR = REPO / ".cache" / "tiny-signpost"


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    from horizonrl.tiny_model import ensure_tiny_model

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return Path(ensure_tiny_model(TINY_MODEL_DIR, **TINY_MODEL_ARGS))



@pytest.fixture(scope="session")
def demo_tiny_model() -> Path:
    """The demo's starting policy (horizonrl/demo.py's recipe on configs/demo.yaml's BabyAI levels): what the
    BabyAI learning test trains, and the model the other BabyAI tests play with (built once: ~4 minutes)."""
    from horizonrl.core.config import load_config
    from horizonrl.demo import TINY_MODEL_RECIPE
    from horizonrl.tiny_model import ensure_tiny_model

    config = load_config(REPO / "configs" / "demo.yaml")
    return Path(ensure_tiny_model(REPO / ".cache" / "tiny-demo", envs=tuple(s.name for s in config.envs),
                                  env_settings={s.name: dict(s.settings) for s in config.envs},
                                  **TINY_MODEL_RECIPE))


@pytest.fixture(scope="session")
def babyai_tiny_model(demo_tiny_model) -> Path:
    """A BabyAI-warmed tiny model for the tests that play BABYAI_SETTINGS (primitive actions) without asking it
    to learn: the demo's, so that the suite builds one BabyAI model, not two. Its high-level replies ("go to red
    ball 1") are invalid actions there, which those tests take as any other reply."""
    return demo_tiny_model
