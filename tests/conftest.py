import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from helpers import BABYAI_SETTINGS  # noqa: E402
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
def babyai_tiny_model() -> Path:
    from horizonrl.tiny_model import ensure_tiny_model

    return Path(ensure_tiny_model(REPO / ".cache" / "tiny-babyai", envs=("babyai",), env_settings={"babyai": BABYAI_SETTINGS},
                                  episodes_per_env=600, warmup_steps=150, max_turns=15))
