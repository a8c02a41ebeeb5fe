"""Part 2 — training: the asynchronous pipeline vs a synchronous one, through the real system.

Both are full ``horizonrl train`` runs (coordinator, buffer, FSDP learner, vLLM actors, gloo
weight broadcast) with the same config, batch size and episodes in flight:

- **synchronous**: ``rollout.synchronous=true`` — the actors generate exactly one batch under
  the current weights, the learner trains on it and broadcasts, the actors wait for the new
  weights, repeat. Generation and training never overlap (verl's and AgentGym-RL's schedule).
- **async**: the system as it ships: the actors never wait for the learner, bounded by
  ``buffer.max_staleness``.

Both runs keep equal-reward groups (``buffer.skip_equal_reward_groups=false``) so that every
group counts toward a batch in both and the batches are the same size. The clock starts at
learner step ``warmup_steps`` (after the engines started and the first weights went out) and
stops at the last step; everything comes from the run's TensorBoard scalars:

- learner steps/min and samples (trajectories)/s over that window;
- learner idle share: time waiting for a batch ÷ window;
- actor (engine) idle share: time with no generate request in flight ÷ engine wall time;
- weight-sync stall share: time the actors spent receiving weights ÷ actor wall time;
- generated tokens/s (part 3 divides the async run's by the bare engines').
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from horizonrl.apps.bench.report import alternate, make_result, paired_ratio, progress, summarize
from horizonrl.core.programs import horizonrl_command
from horizonrl.core.run_dirs import RunDir

REPO = Path(__file__).resolve().parents[3]
CONFIG = REPO / "configs" / "signpost_test.yaml"
RUN_TIMEOUT_S = 900.0
MODES = {"synchronous": ["rollout.synchronous=true"], "async": []}


def groups_per_actor(cfg) -> int:
    """Each actor's share of one learner batch, in groups: what both modes keep in flight."""
    return -(-cfg.learner.groups_per_step // cfg.rollout.num_actors)


def train_command(config: Path, model: str, run_dir: Path, steps: int, extra: list[str]) -> list[str]:
    """The ``horizonrl train`` command of one benchmark run. The run starts in the checkout (``run_training``), so
    every path is resolved here, once, against the caller's directory: a model built under the caller's
    ``.cache/`` is found wherever the bench was started."""
    if Path(model).exists():
        model = str(Path(model).resolve())
    config, run_dir = Path(config).resolve(), Path(run_dir).resolve()
    return horizonrl_command("train", str(config), f"model.path={model}", f"run.output_dir={run_dir}",
                             f"learner.total_steps={steps}", "buffer.skip_equal_reward_groups=false",
                             "learner.save_every=0", *extra)


def run_training(command: list[str], log_path: Path, timeout_s: float = RUN_TIMEOUT_S,
                 affinity: set[int] | None = None) -> None:
    """Run one training job in its own process group; on any exit path, end that group. ``affinity``: the
    CPU cores the job starts on, when they differ from this process's own."""
    preexec = (lambda: os.sched_setaffinity(0, affinity)) if affinity else None
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                preexec_fn=preexec)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"training run did not finish within {timeout_s:.0f} s; log: {log_path}") from None
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    pass
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # anything left in the group
            except ProcessLookupError:
                pass
    if rc != 0:
        tail = log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"training run failed with exit code {rc}; log {log_path}:\n{tail}")


def read_scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    """Every TensorBoard scalar of a run: tag -> {step: value}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = sorted(glob.glob(str(RunDir(run_dir).tensorboard / "events.*")))
    if not files:
        raise RuntimeError(f"no TensorBoard events in {run_dir}")
    out: dict[str, dict[int, float]] = {}
    for path in files:
        acc = EventAccumulator(path, size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
    return out


def window_metrics(s: dict[str, dict[int, float]], first: int, last: int, num_actors: int) -> dict[str, float]:
    """Throughput and idle shares between learner steps ``first`` and ``last`` (both completed)."""
    def delta(tag: str) -> float:
        return s[tag][last] - s[tag][first]

    steps = range(first + 1, last + 1)
    wall = delta("time/elapsed_s")
    engine_wall = delta("rollout/engine_wall_s_total")
    return {
        "steps_per_min": (last - first) / wall * 60,
        "samples_per_s": sum(s["batch/trajectories"][k] for k in steps) / wall,
        "learner_idle_share": sum(s["time/batch_wait_s"][k] for k in steps) / wall,
        "engine_idle_share": delta("rollout/engine_idle_s_total") / engine_wall if engine_wall > 0 else float("nan"),
        # The engines' mean number of requests in flight (runs from before this scalar existed: nan).
        "engine_requests_mean": (delta("rollout/engine_request_s_total") / engine_wall
                                 if engine_wall > 0 and "rollout/engine_request_s_total" in s else float("nan")),
        "weight_stall_share": delta("rollout/weight_stall_s") / (wall * num_actors),
        "weight_load_share": delta("rollout/weight_load_s") / (wall * num_actors),
        # The engines ending their step before a pause (not stall; runs from before this scalar existed: nan).
        "weight_pause_wait_share": (delta("rollout/weight_pause_wait_s") / (wall * num_actors)
                                    if "rollout/weight_pause_wait_s" in s else float("nan")),
        "tokens_per_s": delta("rollout/generated_tokens_total") / wall,
        "step_s": sum(s["time/step_s"][k] for k in steps) / len(steps),
        "staleness": sum(s["batch/staleness_mean"][k] for k in steps) / len(steps),
        "window_s": wall,
    }


def run(quick: bool, out_dir: Path, *, model: str | None = None, config: Path = CONFIG,
        extra_overrides: list[str] | None = None, repeats: int | None = None, steps: int | None = None,
        warmup: int | None = None, settings_note: str | None = None) -> dict:
    """Part 2. ``--quick``: 1 run per mode, 9 learner steps (clock from step 2); full: 3 runs, 30 (from step 4)."""
    from horizonrl.apps.bench.rollout import tiny_model
    from horizonrl.core.config import load_config

    model = tiny_model(model)
    default = (1, 9, 2) if quick else (3, 30, 4)
    repeats, steps, warmup = (x if x is not None else d for x, d in zip((repeats, steps, warmup), default))
    if not 0 <= warmup < steps:
        raise ValueError(f"the clock starts at step {warmup}, which must come before the last step {steps}")
    extra = list(extra_overrides or [])
    # The same engine batch in both modes: each actor runs its whole batch share at once.
    cfg = load_config(config, [f"model.path={model}", *extra])
    extra.append(f"rollout.groups_in_flight={groups_per_actor(cfg)}")
    metrics: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    for r in range(repeats):
        for mode in alternate(r, list(MODES)):
            run_dir = out_dir / "training" / f"{mode}-{r}"
            progress("training", f"repeat {r + 1}/{repeats}: {mode} run, {steps} learner steps ({run_dir})")
            started = time.perf_counter()
            shutil.rmtree(run_dir, ignore_errors=True)  # a previous benchmark's run: this one starts fresh
            run_dir.mkdir(parents=True, exist_ok=True)
            run_training(train_command(config, model, run_dir, steps, extra + MODES[mode]),
                         run_dir.parent / f"{mode}-{r}.log")
            m = window_metrics(read_scalars(run_dir), warmup, steps, cfg.rollout.num_actors)
            metrics[mode].append(m)
            progress("training", f"  {mode}: {m['steps_per_min']:.1f} steps/min, {m['samples_per_s']:.1f} samples/s, "
                     f"learner idle {m['learner_idle_share']:.0%}, engines idle {m['engine_idle_share']:.0%} "
                     f"({time.perf_counter() - started:.0f} s with start-up)")
    rows = [{"label": mode, **{k: summarize([m[k] for m in runs]) for k in runs[0]}} for mode, runs in metrics.items()]
    a, b = metrics["async"], metrics["synchronous"]
    ratios = {
        "async / synchronous learner steps/min": paired_ratio([m["steps_per_min"] for m in a],
                                                              [m["steps_per_min"] for m in b]),
        "async / synchronous samples/s": paired_ratio([m["samples_per_s"] for m in a], [m["samples_per_s"] for m in b]),
    }
    settings = {"config": str(config), "model": model, "learner_steps": steps, "clock_from_step": warmup,
                "repeats": repeats, "overrides": extra + ["buffer.skip_equal_reward_groups=false"],
                "num_actors": cfg.rollout.num_actors, "groups_per_step": cfg.learner.groups_per_step,
                "n": cfg.rollout.n, "max_staleness": cfg.buffer.max_staleness}
    if settings_note:
        settings["partition"] = settings_note
    return make_result("training", rows, ratios, settings,
                       chart={"metric": "steps_per_min", "ylabel": "learner steps/min"})
