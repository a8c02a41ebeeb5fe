"""What several WebArena test files share."""

from __future__ import annotations

from horizonrl.envs.webarena import WebArenaEnv


async def run_expert(env: WebArenaEnv, task_id: int):
    """One episode of the task's scripted expert; the last step's result (at most 20 steps)."""
    await env.reset(task_id)
    state, result = None, None
    for _ in range(20):
        reply, state = env.expert_action(state)
        result = await env.step(reply)
        if result.done:
            break
    return result
