"""How much a turn budget caps success on BabyAI levels: scripted and random policies at several budgets.

    python scripts/babyai_budget_baselines.py [LEVEL ...] [--primitive] [--tasks N] [--turns 1,2,3,4,8]

For each level (default: the demo's three red-ball levels), on its first N test-split tasks (seeds divisible by 5),
prints the success rate within each budget of

- with AgentGym's high-level actions (default): a greedy script (``go to red ball 1`` when it is offered, else
  ``turn left``; only meaningful on the red-ball levels) and a uniformly random valid action;
- with ``--primitive`` (turn left/right, move forward only): minigrid's BabyAI bot (close to the fewest turns
  that solve the task) and a uniformly random valid action.

docs/learning.md ("ScalingInter-RL in miniature") quotes these numbers to choose the budgets of the study.
"""

from __future__ import annotations

import argparse
import asyncio
import random

from horizonrl.envs.babyai import BabyAIEnv

RED_BALL_LEVELS = ["BabyAI-GoToRedBallGrey-v0", "BabyAI-GoToRedBall-v0", "BabyAI-GoToRedBallNoDists-v0"]


async def success_within(env: BabyAIEnv, ids: list[int], turns: int, policy: str) -> float:
    wins = 0
    for k, task_id in enumerate(ids):
        rng = random.Random(k)
        await env.reset(task_id)
        bot = None
        for _ in range(turns):
            if policy == "random":
                reply = env.random_action(rng)
            elif policy == "bot":
                reply, bot = env.expert_action(bot)
            else:  # greedy
                seen = "go to red ball 1" in env.available_actions()
                reply = "Action: go to red ball 1" if seen else "Action: turn left"
            result = await env.step(reply)
            if result.done:
                wins += result.success
                break
    return wins / len(ids)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("levels", nargs="*", default=RED_BALL_LEVELS)
    parser.add_argument("--primitive", action="store_true", help="primitive actions only (high_level_actions=False)")
    parser.add_argument("--tasks", type=int, default=200, help="test-split tasks per level")
    parser.add_argument("--turns", default="1,2,3,4,8", help="comma-separated budgets")
    args = parser.parse_args()
    budgets = [int(t) for t in args.turns.split(",")]
    policies = ["bot", "random"] if args.primitive else ["greedy", "random"]
    print("| level | policy | " + " | ".join(f"{t} turns" for t in budgets) + " |")
    print("|" + " --- |" * (2 + len(budgets)))
    for level in args.levels:
        env = BabyAIEnv(levels=[level], high_level_actions=not args.primitive, observation="compact")
        ids = env.task_ids("test")[: args.tasks]
        for policy in policies:
            rates = [await success_within(env, ids, t, policy) for t in budgets]
            print(f"| {level} | {policy} | " + " | ".join(f"{r:.3f}" for r in rates) + " |")
        await env.close()


if __name__ == "__main__":
    asyncio.run(main())
