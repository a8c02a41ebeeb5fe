"""Part 3 — engine-bound ratio: how close asynchronous training comes to the bare engines.

numerator:   generated tokens/s over all actors during an async training run (part 2's
             ``async`` runs; measured here with one short run if part 2 was not run);
denominator: generated tokens/s of the same number of bare engines, same model, same
             sampling, same requests in flight, on replayed multi-turn Signpost prompts of the
             same turn budget — no environment, no learner, no weight sync.

The ratio is the share of the rollout side's physical limit that training keeps. The bare
engines have the whole machine; during training they share it with the learner, so on a
machine with fewer cores than processes the ratio also measures CPU contention.

With ``--partition`` (``partition.py``) the comparison is the fair one: the learner's side and
each actor run on cores of their own, as on separate GPUs, and the bare engines run on the same
actor cores. Each repeat then measures one async training run and the bare engines back to back
(alternating which goes first), so the ratio is paired within a repeat; the actors' weight-update
stall share comes from the same training runs. The buffer does not push back in those runs (no
capacity or staleness bound): the question is whether the actors keep their engines busy while
the learner trains and sends weights, not how fast one learner core trains.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
from pathlib import Path

from horizonrl.apps.bench.partition import CorePartition
from horizonrl.apps.bench.report import alternate, make_result, paired_ratio, progress, summarize
from horizonrl.apps.bench.rollout import BareSpec


def bare_spec(quick: bool, model: str, overrides: list[str] | None = None) -> BareSpec:
    """The bare engines that match the training part's run: engines, requests in flight, turn budget."""
    from horizonrl.apps.bench import training
    from horizonrl.core.config import load_config

    return bare_spec_of(load_config(training.CONFIG, [f"model.path={model}", *(overrides or [])]), quick)


def bare_spec_of(cfg, quick: bool) -> BareSpec:
    """:func:`bare_spec` for the training runs' loaded config ``cfg``."""
    from horizonrl.apps.bench import training
    from horizonrl.core.schedule import TurnBudgetSchedule

    per_engine = training.groups_per_actor(cfg) * cfg.rollout.n
    return BareSpec(num_engines=cfg.rollout.num_actors, concurrency=per_engine, env_name=cfg.envs[0].name,
                    env_settings=dict(cfg.envs[0].settings),
                    max_turns=TurnBudgetSchedule.from_config(cfg.algorithm.rounds_ctrl).final_max_turns,
                    episodes=64 if quick else 192, repeats=2 if quick else 3)


def run(quick: bool, out_dir: Path, *, model: str | None = None, training_result: dict | None = None,
        rollout_result: dict | None = None, partition: CorePartition | None = None,
        overrides: list[str] | None = None) -> dict:
    """Part 3. Reuses part 2's async runs and part 1's bare-engine measurement when they ran (not with a
    partition: then it measures both itself, on the partition's cores)."""
    from horizonrl.apps.bench.rollout import bare_engine_tokens_per_s, tiny_model

    model = tiny_model(model)
    if partition is not None:
        return run_partitioned(quick, out_dir, model, partition, overrides or [])
    spec = bare_spec(quick, model)
    if training_result is None:
        progress("engine", "no training part in this run: one short async training run for the numerator")
        training_result = _single_mode_training(quick, out_dir, model)
    per_run = next(row for row in training_result["rows"] if row["label"] == "async")["tokens_per_s"]
    if rollout_result is not None and "bare_engines" in rollout_result:
        bare = rollout_result["bare_engines"]["tokens_per_s"]
    else:
        bare = bare_engine_tokens_per_s(model, spec)
    bare_summary = summarize(bare)
    # Each training run's tokens/s over the bare engines' median (the runs cannot be paired).
    ratio = {key: per_run[key] / bare_summary["median"] for key in ("median", "min", "max")} | {"n": per_run["n"]}
    rows = [{"label": "async training / engines", "tokens_per_s": per_run},
            {"label": "bare engines", "tokens_per_s": bare_summary}]
    settings = {"model": model, **spec.__dict__}
    return make_result("engine", rows, {"async training / bare engines tokens/s": ratio}, settings,
                       chart={"metric": "tokens_per_s", "ylabel": "generated tokens/s"})


def _single_mode_training(quick: bool, out_dir: Path, model: str) -> dict:
    from horizonrl.apps.bench import training
    from horizonrl.core.config import load_config

    steps, warmup = (9, 2) if quick else (30, 4)
    cfg = load_config(training.CONFIG, [f"model.path={model}"])
    run_dir = out_dir / "engine" / "async-training"
    shutil.rmtree(run_dir, ignore_errors=True)  # a previous benchmark's run: this one starts fresh
    run_dir.mkdir(parents=True, exist_ok=True)
    training.run_training(training.train_command(training.CONFIG, model, run_dir, steps,
                                                 [f"rollout.groups_in_flight={training.groups_per_actor(cfg)}"]),
                          run_dir.parent / "async-training.log")
    m = training.window_metrics(training.read_scalars(run_dir), warmup, steps, cfg.rollout.num_actors)
    return {"rows": [{"label": "async", "tokens_per_s": summarize([m["tokens_per_s"]])}]}


def partitioned_spec(quick: bool, model: str, partition: CorePartition, extra: list[str]) -> tuple:
    """The partitioned training runs' config and their bare engines. The --set overrides (``extra``) count for
    both: a run with fewer episodes per group or groups per step keeps fewer requests in flight, and its bare
    engines are given as many."""
    from horizonrl.apps.bench import training
    from horizonrl.core.config import load_config

    cfg = load_config(training.CONFIG, [f"model.path={model}", *partition.overrides(), *extra])
    # No random episodes: these bare engines replay the training runs' own (workload.played_episodes).
    return cfg, dataclasses.replace(bare_spec_of(cfg, quick), episodes=0)


def run_partitioned(quick: bool, out_dir: Path, model: str, partition: CorePartition,
                    extra: list[str] | None = None) -> dict:
    """Paired repeats on a partitioned host: an async training run (one actor per actor core) and the bare
    engines (one per actor core, the same requests in flight, replaying the episodes the newest training run
    played) — tokens/s, and the training run's shares of actor wall time stalled by weight updates and of
    engine time idle."""
    from horizonrl.apps.bench import training
    from horizonrl.apps.bench.rollout import _measure_bare, load_chat, start_engine
    from horizonrl.apps.bench.workload import played_episodes
    from horizonrl.actors.cpu_affinity import starting_on_cpus
    from horizonrl.core.placement import vllm_cpu_binding

    steps, warmup, repeats = (12, 3, 3) if quick else (30, 4, 3)
    cfg, spec = partitioned_spec(quick, model, partition, extra or [])
    progress("engine", f"partition: {partition.describe()}")
    everywhere = os.sched_getaffinity(0)
    # The buffer never pushes back here: on a partitioned host the learner (one core of two) may train slower
    # than the engine generates, and a paused actor would measure the learner, not the actor. Groups too stale
    # to train on are dropped (counted); what is measured is generation while training and updates go on.
    train_extra = [*partition.overrides(), f"rollout.groups_in_flight={training.groups_per_actor(cfg)}",
                   "buffer.capacity_groups=100000", "buffer.max_staleness=100000", *(extra or [])]
    # The bare engines with the training runs' engine settings (block size, prefix caching; --set included): the
    # overrides train_extra adds to cfg's are the buffer's and groups in flight, none of the engine's.
    engine_settings = cfg.rollout.engine
    trained: list[dict[str, float]] = []
    bare: list[float] = []
    bare_in_flight: list[float] = []  # the bare engines' mean requests in flight, per repeat

    def one_training_run(r: int) -> dict[str, float]:
        run_dir = out_dir / "engine" / f"async-training-{r}"
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True, exist_ok=True)
        # The run's processes start from every core; each then pins itself to its own (resources.*_cpus).
        training.run_training(training.train_command(training.CONFIG, model, run_dir, steps, train_extra),
                              run_dir.parent / f"async-training-{r}.log", affinity=everywhere)
        return training.window_metrics(training.read_scalars(run_dir), warmup, steps, cfg.rollout.num_actors)

    async def go() -> None:
        engines = []
        try:
            # The client where the actors' own processes run (one client drives every bare engine), each bare
            # engine on its actor's engine cores, as the actors start theirs.
            os.sched_setaffinity(0, {c for cores in partition.client_cores for c in cores})
            for i, cores in enumerate(partition.engines):
                os.environ["VLLM_CPU_OMP_THREADS_BIND"] = vllm_cpu_binding(list(cores), 1)
                with starting_on_cpus(cores):
                    engines.append(start_engine(model, spec.concurrency, seed=i, engine=engine_settings))
            chat = load_chat(model)
            for r in range(repeats):
                # A training run first (its episodes are what the bare engines replay), then alternating.
                for what in alternate(r, ["training", "bare"]):
                    if what == "bare":
                        # The very requests the newest training run's actors sent, turn after turn per episode:
                        # the trained policy's prompts and turn counts, and its groups' shared prefixes (random
                        # episodes had neither: on BabyAI with SmolLM2 a bare engine replaying them ran at 0.78x
                        # the training run's rate, docs/benchmarks.md).
                        played = played_episodes(out_dir / "engine" / f"async-training-{len(trained) - 1}")
                        bare.extend(await _measure_bare(engines, chat, played, spec.concurrency, 1, bare_in_flight))
                    else:
                        progress("engine", f"repeat {r + 1}/{repeats}: async training, {steps} learner steps")
                        trained.append(await asyncio.to_thread(one_training_run, r))
                        m = trained[-1]
                        progress("engine", f"  {m['tokens_per_s']:.0f} generated tokens/s, weight-update stall "
                                           f"{m['weight_stall_share']:.1%} (+{m['weight_pause_wait_share']:.1%} "
                                           f"ending a step before a pause), engine idle {m['engine_idle_share']:.0%}, "
                                           f"{m['engine_requests_mean']:.1f} requests in flight on average")
        finally:
            for engine in engines:
                engine.shutdown()
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
            os.sched_setaffinity(0, everywhere)

    asyncio.run(go())
    keys = ("tokens_per_s", "engine_requests_mean", "weight_stall_share", "weight_load_share",
            "weight_pause_wait_share", "engine_idle_share", "steps_per_min", "staleness")
    rows = [{"label": "async training (partitioned)", **{k: summarize([m[k] for m in trained]) for k in keys}},
            {"label": "bare engines (same cores)", "tokens_per_s": summarize(bare),
             "engine_requests_mean": summarize(bare_in_flight)}]
    ratios = {"async training / bare engines tokens/s (same cores)":
              paired_ratio([m["tokens_per_s"] for m in trained], bare),
              "actor wall time stalled by weight updates": summarize([m["weight_stall_share"] for m in trained]),
              # What the stall counted before the pause's wait was reported apart (docs/benchmarks.md).
              "actor wall time in weight swaps (stall + ending a step)":
              summarize([m["weight_stall_share"] + m["weight_pause_wait_share"] for m in trained])}
    settings = {"model": model, "partition": partition.describe(), "learner_steps": steps, "clock_from_step": warmup,
                "overrides": train_extra, **spec.__dict__, "repeats": repeats,
                "bare_replay": "the episodes of the newest training run (its buffer's write-ahead log)"}
    return make_result("engine", rows, ratios, settings,
                       chart={"metric": "tokens_per_s", "ylabel": "generated tokens/s"})
