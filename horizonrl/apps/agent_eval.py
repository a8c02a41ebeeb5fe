"""Held-out success of an agent program (``rollout.agent``) with a model: the agent plays the first ``--episodes``
test-split tasks of the config's first environment through the endpoint, as in training (one session and one run
of the program per episode), and one JSON line of metrics is printed (``actors/evaluate.py``'s ``summarise``).

``horizonrl agent-eval CONFIG [--model DIR] [--episodes N] [key=value ...]``:
run it on ``model.path`` before training and on the final checkpoint after, for the agent's before -> after
(docs/agents.md). Sampling is at ``eval.temperature``; the turn budget ``eval.max_turns`` (default: the turn
schedule's last value).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

MAX_CONCURRENT_EPISODES = 16


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="horizonrl agent-eval", description=__doc__.splitlines()[0])
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides of the config")
    p.add_argument("--model", default=None, help="the model directory (default: the config's model.path)")
    p.add_argument("--episodes", type=int, default=None, help="default: eval.episodes")
    args = p.parse_args(argv)
    from horizonrl.core.config import load_config

    config = load_config(args.config, args.overrides)
    if config.rollout.agent is None:
        print("error: the config has no rollout.agent", file=sys.stderr)
        return 2
    result = asyncio.run(evaluate_agent(config, args.model or config.model.path,
                                        args.episodes if args.episodes is not None else config.eval.episodes))
    print(json.dumps(result))
    return 0


async def evaluate_agent(config, model_path: str, episodes: int) -> dict:
    from horizonrl.core.chat import load_chat_tokenizer
    from horizonrl.actors.engine import RolloutEngine
    from horizonrl.actors.evaluate import summarise
    from horizonrl.actors.openai_endpoint.agent_runs import AgentRunner
    from horizonrl.core.schedule import TurnBudgetSchedule
    from horizonrl.envs.registry import make_env

    r, spec = config.rollout, config.envs[0]
    max_turns = config.eval.max_turns or TurnBudgetSchedule.from_config(config.algorithm.rounds_ctrl).final_max_turns
    engine = RolloutEngine.start(model_path, dtype=None, engine=r.engine, max_model_len=r.max_context_tokens,
                                 seed=config.run.seed)
    runner = None
    try:
        runner = await AgentRunner.start(
            r.agent, generator=engine, chat=load_chat_tokenizer(model_path), weights=lambda: engine.weights,
            model_name=Path(model_path).name, temperature=config.eval.temperature, top_p=1.0,
            max_tokens_per_turn=r.max_tokens_per_turn, max_context_tokens=r.max_context_tokens,
            turn_timeout_s=r.turn_timeout_s, episode_timeout_s=r.episode_timeout_s,
            log_path=Path(tempfile.gettempdir()) / f"horizonrl-agent-eval-{int(time.time())}.log")
        task_ids = make_env(spec.name, spec.settings).task_ids("test")[:episodes]
        semaphore = asyncio.Semaphore(MAX_CONCURRENT_EPISODES)

        async def play(task_id: int):
            async with semaphore:
                env = make_env(spec.name, spec.settings)
                try:
                    return task_id, await runner.play(env, spec.name, task_id, max_turns)
                finally:
                    await env.close()

        start = time.perf_counter()
        results = await asyncio.gather(*(play(t) for t in task_ids))
        wall = time.perf_counter() - start
        valid = [(t, ep) for t, ep in results if not ep.failure]
        return {"model": model_path, "env": spec.name, "episodes": len(results), "max_turns": max_turns,
                "infra_failures": len(results) - len(valid),
                "failures_by_kind": dict(Counter(ep.failure for _, ep in results if ep.failure)),
                **summarise(valid, 1), "endpoint": runner.endpoint.stats.as_dict(), "wall_s": wall,
                "agent_log": str(runner.log_path)}
    finally:
        if runner is not None:
            await runner.stop()
        engine.shutdown()


if __name__ == "__main__":
    sys.exit(main())
