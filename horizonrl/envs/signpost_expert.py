"""Expert (and deliberately wrong) trajectories of the built-in Signpost environment, written in
AgentGym's format, so that the offline paradigms can be tried without any hub.

- SFT data: expert episodes on train-split task ids. The expert reads the sign in the latest
  observation and follows it; its replies have exactly the ReAct format of the tiny model's
  warm-up (``Thought: The sign points left.\\nAction: go left``), only the decision differs.
- DPO data: pairs (expert episode, the same task with a wrong move) — the rejected side follows
  the expert up to a turn drawn at random, where it reads the sign correctly but goes another way,
  and ends with that reply. Both sides share everything before it; they differ in that decision.

Conversations end with the last reply, like an actor's episode (the final observation is never
trained on). The command that writes them: ``horizonrl make-expert-data`` (``apps/env_data.py``).
"""

from __future__ import annotations

import asyncio
import random
import re
from typing import Any, Callable

from horizonrl.envs.signpost import DIRECTIONS, SignpostEnv
from horizonrl.core.agentgym_records import conversation_record

_SIGN = re.compile(r"A sign points (left|right|straight)\.")


def read_sign(observation: str) -> str:
    """The direction of the last sign mentioned in a Signpost observation."""
    signs = _SIGN.findall(observation)
    if not signs:
        raise ValueError(f"no sign in the observation {observation!r}")
    return signs[-1]


def expert_reply(observation: str) -> str:
    sign = read_sign(observation)
    return f"Thought: The sign points {sign}.\nAction: go {sign}"


def wrong_reply(observation: str, rng: random.Random) -> str:
    """Reads the sign right, goes another way (the format stays the expert's)."""
    sign = read_sign(observation)
    return f"Thought: The sign points {sign}.\nAction: go {rng.choice([d for d in DIRECTIONS if d != sign])}"


async def play(env: SignpostEnv, task_id: int, policy: Callable[[int, str], str], max_turns: int) -> tuple[list, bool]:
    """[(role, text), ...] of one episode, ending with the last reply; and whether it succeeded."""
    observation = await env.reset(task_id)
    messages: list[tuple[str, str]] = [("human", observation)]
    for turn in range(max_turns):
        reply = policy(turn, observation)
        messages.append(("gpt", reply))
        result = await env.step(reply)
        if result.done:
            return messages, bool(result.success)
        observation = result.observation
        messages.append(("human", observation))
    return messages[:-1], False


def signpost_records(kind: str, episodes: int, length: int = 4, max_turns: int | None = None,
                     seed: int = 0) -> list[dict[str, Any]]:
    """``episodes`` SFT records or DPO pairs on train-split tasks drawn with ``seed``."""
    if kind not in ("sft", "dpo"):
        raise ValueError(f"kind must be 'sft' or 'dpo', got {kind!r}")
    max_turns = max_turns or 2 * length
    env = SignpostEnv(length=length)
    rng = random.Random(seed)
    train_ids = env.task_ids("train")

    def expert(_turn: int, observation: str) -> str:
        return expert_reply(observation)

    async def build() -> list[dict[str, Any]]:
        records = []
        for _ in range(episodes):
            task_id = rng.choice(train_ids)
            chosen, success = await play(env, task_id, expert, max_turns)
            assert success, f"the Signpost expert failed task {task_id} in {max_turns} turns"
            if kind == "sft":
                records.append(conversation_record(chosen, f"signpost_{task_id}"))
                continue
            wrong_turn = rng.randrange(min(length, max_turns))

            def one_mistake(turn: int, observation: str) -> str:
                return wrong_reply(observation, rng) if turn == wrong_turn else expert_reply(observation)

            # Cut right after the wrong reply: the pair shares everything before it (those tokens cancel
            # in the DPO margin), so the preference is about that one decision. A rejected side that
            # went on would be longer, and DPO could then widen the margin by making every reply less
            # likely (the longer side loses more) — with the tiny model that ruins the reply format.
            rejected, _ = await play(env, task_id, one_mistake, wrong_turn + 1)
            records.append({"item_id": f"signpost_{task_id}",
                            "chosen": conversation_record(chosen), "rejected": conversation_record(rejected)})
        return records

    return asyncio.run(build())
