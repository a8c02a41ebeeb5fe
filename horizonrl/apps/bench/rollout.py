"""Part 1 — rollout: the asynchronous actor loop vs a turn-lockstep loop, on the same engine.

Both loops play the same episodes (same model, task ids, sampling settings and number of
episodes) with the same number of episodes in flight, ``concurrency``:

- **lock-step** (AgentGym-RL's rollout, and most seeds'): take ``concurrency`` episodes; every
  round, one generate for every active episode at once, wait for all; then every environment
  step at once, wait for all; repeat until the last episode of the batch ends; next batch. A
  round lasts as long as its slowest generation plus its slowest environment step, and the
  slots of finished episodes stay empty until the whole batch is done.
- **async** (the actor): every episode is its own coroutine running
  :func:`~horizonrl.actors.episode.run_episode`; a finished episode's slot takes the next one.

Reported per loop: trajectories/s, generated tokens/s, the engine's idle share (wall time with
no request in flight) and mean turns; the ratio async / lock-step is taken within each repeat.

Also here, for part 3 (``engine``): the bare engines' generated tokens/s on replayed multi-turn
prompts, with no environment and no learner — the physical limit of the rollout side.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from horizonrl.actors.episode import Episode, SamplingSettings, run_episode
from horizonrl.apps.bench.report import alternate, make_result, paired_ratio, progress, summarize
from horizonrl.apps.bench.workload import replay_prompts
from horizonrl.envs.heavy_tail import HeavyTailEnv, HeavyTailSettings

if TYPE_CHECKING:
    from horizonrl.core.config import EngineConfig

log = logging.getLogger("horizonrl.apps.bench.rollout")

# The tiny model the integration tests build (reused from .cache when its spec matches).
TINY_MODEL_DIR = Path(".cache") / "tiny-signpost"
SAMPLING = SamplingSettings(temperature=1.0, top_p=1.0, max_tokens_per_turn=24, max_context_tokens=1024)


@dataclass(frozen=True)
class Workload:
    name: str
    make_env: Callable[[], object]
    max_turns: int
    describe: str


def workloads(latency_median_s: float, latency_sigma: float, turns_median: float, turns_sigma: float) -> list[Workload]:
    from horizonrl.envs.signpost import SignpostEnv

    heavy = HeavyTailSettings(turns_median=turns_median, turns_sigma=turns_sigma, latency_median_s=latency_median_s,
                              latency_sigma=latency_sigma)
    return [
        Workload("signpost", lambda: SignpostEnv(length=4), 10,
                 "real Signpost env (length 4, budget 10): in-process steps, 4-10 turns"),
        Workload("heavy-tail", lambda: HeavyTailEnv(heavy), 24,
                 f"log-normal turns (median {turns_median}, sigma {turns_sigma}, cap 24) and step latency "
                 f"(median {latency_median_s * 1000:.0f} ms, sigma {latency_sigma})"),
    ]


@dataclass
class LoopStats:
    wall_s: float
    episodes: int
    generated_tokens: int
    turns: int
    engine_idle_s: float
    client_cpu_s: float  # CPU time of this process: the loop, tokenization, environment steps, vLLM's client

    def row(self) -> dict[str, float]:
        return {"trajectories_per_s": self.episodes / self.wall_s, "tokens_per_s": self.generated_tokens / self.wall_s,
                "engine_idle_share": self.engine_idle_s / self.wall_s, "mean_turns": self.turns / self.episodes,
                "client_cpu_share": self.client_cpu_s / self.wall_s, "wall_s": self.wall_s}


async def run_async(engine, chat, workload: Workload, task_ids: list[int], concurrency: int) -> list[Episode]:
    """The actor's way: each episode its own coroutine; at most ``concurrency`` in flight."""
    slots = asyncio.Semaphore(concurrency)
    free_envs: list = []

    async def play(task_id: int) -> Episode:
        async with slots:
            env = free_envs.pop() if free_envs else workload.make_env()
            try:
                return await run_episode(engine, env, chat, task_id, max_turns=workload.max_turns, sampling=SAMPLING)
            finally:
                free_envs.append(env)

    return list(await asyncio.gather(*(play(t) for t in task_ids)))


async def run_lockstep(engine, chat, workload: Workload, task_ids: list[int], concurrency: int) -> list[Episode]:
    """The lock-step baseline: batches of ``concurrency`` episodes, all generations then all steps, per round.

    Per episode the same rules as :func:`run_episode` (``Episode.stop_before_turn`` / ``close_turn``).
    """
    envs = [workload.make_env() for _ in range(min(concurrency, len(task_ids)))]
    finished: list[Episode] = []
    for start in range(0, len(task_ids), concurrency):
        batch = task_ids[start:start + concurrency]
        episodes = [Episode() for _ in batch]
        observations = await asyncio.gather(*(env.reset(t) for env, t in zip(envs, batch)))
        for ep, observation in zip(episodes, observations):
            ep.append_context(chat.prompt_ids(observation, SAMPLING.system_prompt))
            ep.prompt_length = len(ep.token_ids)
        active = list(range(len(batch)))
        while active:
            generating = [i for i in active if not episodes[i].stop_before_turn(workload.max_turns,
                                                                                   SAMPLING.max_context_tokens)]
            gens = await asyncio.gather(*(engine.generate(
                episodes[i].token_ids, max_tokens=min(SAMPLING.max_tokens_per_turn,
                                                      SAMPLING.max_context_tokens - len(episodes[i].token_ids)),
                temperature=SAMPLING.temperature, top_p=SAMPLING.top_p, stop_token_ids=chat.stop_token_ids)
                for i in generating))
            replies = []
            for i, gen in zip(generating, gens):
                episodes[i].append_generated(gen.token_ids, gen.logprobs, (0, 0))
                replies.append(chat.decode(gen.token_ids))
                episodes[i].replies.append(replies[-1])
            results = await asyncio.gather(*(envs[i].step(reply) for i, reply in zip(generating, replies)))
            active = [i for i, gen, result in zip(generating, gens, results)
                      if episodes[i].close_turn(chat, gen.token_ids, result, SAMPLING)]
        finished += episodes
    return finished


async def measure(loop, engine, chat, workload: Workload, task_ids: list[int],
                  concurrency: int) -> tuple[LoopStats, list[Episode]]:
    engine.clock.reset()
    start, cpu_start = time.perf_counter(), time.process_time()
    episodes = await loop(engine, chat, workload, task_ids, concurrency)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    idle = engine.clock.idle_s
    failed = [ep for ep in episodes if ep.failure]
    if failed:
        raise RuntimeError(f"{len(failed)} episodes failed in the benchmark: {failed[0].failure_message}")
    return LoopStats(wall, len(episodes), sum(ep.generated_tokens for ep in episodes),
                     sum(ep.num_turns for ep in episodes), idle, cpu), episodes


def tiny_model(model: str | None) -> str:
    if model:
        return model
    from horizonrl.apps.tiny_model import SIGNPOST_TEST_RECIPE, ensure_tiny_model

    progress("bench", f"tiny model in {TINY_MODEL_DIR} (built once, then reused)")
    return str(ensure_tiny_model(TINY_MODEL_DIR, **SIGNPOST_TEST_RECIPE))


def start_engine(model: str, concurrency: int, seed: int = 0, engine: EngineConfig | None = None):
    """A bare engine for ``concurrency`` requests in flight; ``engine``: the training runs' ``EngineConfig`` to
    match (block size, prefix caching), default vLLM's settings as the rollout part uses them."""
    from horizonrl.actors.engine import RolloutEngine
    from horizonrl.core.config import EngineConfig

    if engine is None:
        engine = EngineConfig(max_num_seqs=max(64, concurrency))
    else:
        engine = engine.model_copy(update={"max_num_seqs": max(concurrency, engine.max_num_seqs)})
    # The dtype as the training runs' actors resolve it (rollout.engine.dtype; "auto": float32 on the CPU): a bare
    # engine in float32 beside a bf16 run's engines (SmolLM2's) would compare different arithmetic.
    return RolloutEngine.start(model, dtype=None, engine=engine, max_model_len=SAMPLING.max_context_tokens,
                               seed=seed)


def load_chat(model: str):
    from horizonrl.core.chat import load_chat_tokenizer

    return load_chat_tokenizer(model)


@dataclass(frozen=True)
class BareSpec:
    """Part 3's bare-engine measurement: the training run's engines, requests in flight and prompts."""

    num_engines: int
    concurrency: int  # requests in flight per engine
    env_settings: dict
    max_turns: int
    episodes: int  # random-policy episodes of env_name whose every turn's prompt is replayed
    repeats: int
    env_name: str = "signpost"  # the training run's environment (its config's first), so both see the same prompts


async def _rollout(model: str, repeats: int, episodes: int, concurrency: int, loads: list[Workload],
                   bare: BareSpec | None) -> dict:
    # With part 3 in the same run, its bare engines are started here too (one start-up, not two);
    # the loops use only the first, the others stay idle (an idle engine takes no CPU).
    num_engines = bare.num_engines if bare else 1
    per_engine = max(concurrency, bare.concurrency if bare else 0)
    engines = [start_engine(model, per_engine, seed=i) for i in range(num_engines)]
    engine = engines[0]
    chat = load_chat(model)
    loops = {"lock-step": run_lockstep, "async": run_async}
    stats: dict[tuple[str, str], list[LoopStats]] = {}
    bare_rates = None
    try:
        # One untimed pass: the first requests of a fresh engine are slower (allocation, caches).
        await run_async(engine, chat, loads[0], list(range(concurrency)), concurrency)
        for r in range(repeats):
            for workload in loads:
                task_ids = list(range(r * episodes, (r + 1) * episodes))  # new tasks each repeat, same for both
                for name in alternate(r, list(loops)):
                    s, _ = await measure(loops[name], engine, chat, workload, task_ids, concurrency)
                    stats.setdefault((workload.name, name), []).append(s)
                    progress("rollout", f"repeat {r + 1}/{repeats} {workload.name:10s} {name:9s} "
                             f"{s.episodes / s.wall_s:6.2f} traj/s {s.generated_tokens / s.wall_s:7.0f} tok/s "
                             f"engine idle {s.engine_idle_s / s.wall_s:.0%}")
        if bare is not None:
            prompts = await replay_prompts(chat, bare.env_name, bare.env_settings, bare.episodes, bare.max_turns)
            bare_rates = await _measure_bare(engines, chat, [[p] for p in prompts], bare.concurrency, bare.repeats)
    finally:
        for e in engines:
            e.shutdown()
    rows, ratios = [], {}
    for workload in loads:
        for name in loops:
            runs = [s.row() for s in stats[(workload.name, name)]]
            rows.append({"label": f"{workload.name} / {name}",
                         **{key: summarize([run[key] for run in runs]) for key in runs[0]}})
        a = [s.row() for s in stats[(workload.name, "async")]]
        b = [s.row() for s in stats[(workload.name, "lock-step")]]
        ratios[f"{workload.name}: async / lock-step trajectories/s"] = paired_ratio(
            [x["trajectories_per_s"] for x in a], [x["trajectories_per_s"] for x in b])
        ratios[f"{workload.name}: async / lock-step tokens/s"] = paired_ratio(
            [x["tokens_per_s"] for x in a], [x["tokens_per_s"] for x in b])
    settings = {"model": model, "episodes_per_loop": episodes, "concurrency": concurrency, "repeats": repeats,
                "sampling": SAMPLING.__dict__, "workloads": {w.name: w.describe for w in loads}}
    result = make_result("rollout", rows, ratios, settings,
                         chart={"metric": "trajectories_per_s", "ylabel": "trajectories/s"})
    if bare_rates is not None:
        result["bare_engines"] = {"tokens_per_s": bare_rates, "spec": bare.__dict__}
    return result


def run(quick: bool, out_dir: Path, *, model: str | None = None, latency_median_s: float = 0.05,
        latency_sigma: float = 1.0, turns_median: float = 3.0, turns_sigma: float = 0.8,
        bare: BareSpec | None = None) -> dict:
    """Part 1. ``--quick``: 2 repeats of 48 episodes per loop; full: 3 repeats of 128.

    With ``bare``, also part 3's bare-engine tokens/s (``result["bare_engines"]``) on the same engines.
    """
    model = tiny_model(model)
    repeats, episodes = (2, 48) if quick else (3, 128)
    loads = workloads(latency_median_s, latency_sigma, turns_median, turns_sigma)
    return asyncio.run(_rollout(model, repeats, episodes, concurrency=32, loads=loads, bare=bare))


# ------------------------------------------------------------------------------ part 3: bare engines


async def _measure_bare(engines: list, chat, episodes: list[list[list[int]]], concurrency: int, repeats: int,
                        occupancy: list[float] | None = None) -> list[float]:
    """Generated tokens/s of ``engines`` serving ``episodes`` (split evenly), ``concurrency`` at a time each. An
    episode is a sequence of prompts sent one after another, each once the previous reply is back (as an actor
    plays its turns); random replayed prompts are episodes of one prompt each. Each repeat's mean number of
    requests in flight per engine is appended to ``occupancy`` when given."""
    progress("engine", f"bare engines: {len(engines)} x {concurrency} in flight, {len(episodes)} replayed episodes, "
                       f"{sum(map(len, episodes))} prompts")

    async def serve(engine, share: list[list[list[int]]]) -> int:
        slots = asyncio.Semaphore(concurrency)

        async def one(prompts: list[list[int]]) -> int:
            generated = 0
            async with slots:
                for prompt in prompts:
                    gen = await engine.generate(prompt, max_tokens=SAMPLING.max_tokens_per_turn,
                                                temperature=SAMPLING.temperature, top_p=SAMPLING.top_p,
                                                stop_token_ids=chat.stop_token_ids)
                    generated += len(gen.token_ids)
            return generated

        return sum(await asyncio.gather(*(one(e) for e in share)))

    async def all_engines(es: list[list[list[int]]]) -> int:
        return sum(await asyncio.gather(*(serve(e, es[i::len(engines)]) for i, e in enumerate(engines))))

    await all_engines([e[:1] for e in episodes[: concurrency * len(engines)]])  # untimed warm-up
    rates = []
    for r in range(repeats):
        for engine in engines:
            engine.clock.reset()
        start = time.perf_counter()
        tokens = await all_engines(episodes)
        rates.append(tokens / (time.perf_counter() - start))
        if occupancy is not None:
            occupancy.append(sum(e.clock.unit_s / e.clock.wall_s for e in engines) / len(engines))
        progress("engine", f"bare engines, repeat {r + 1}/{repeats}: {rates[-1]:.0f} generated tokens/s")
    return rates


def bare_engine_tokens_per_s(model: str, spec: BareSpec) -> list[float]:
    """Part 3 alone: start ``spec.num_engines`` engines and measure them bare (no environment, no learner)."""
    async def go() -> list[float]:
        engines = [start_engine(model, spec.concurrency, seed=i) for i in range(spec.num_engines)]
        try:
            chat = load_chat(model)
            prompts = await replay_prompts(chat, spec.env_name, spec.env_settings, spec.episodes, spec.max_turns)
            return await _measure_bare(engines, chat, [[p] for p in prompts], spec.concurrency, spec.repeats)
        finally:
            for engine in engines:
                engine.shutdown()

    return asyncio.run(go())


def main() -> int:
    import argparse

    from horizonrl.apps.bench.report import print_table, write_results

    p = argparse.ArgumentParser(description="Part 1: rollout, async actor loop vs turn-lockstep")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", type=Path, default=Path("runs/bench"))
    p.add_argument("--model", default=None)
    args = p.parse_args()
    result = run(args.quick, args.out, model=args.model)
    print_table(result)
    write_results([result], args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
