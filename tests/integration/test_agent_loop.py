"""An agent program written against the ``openai`` client only (examples/babyai_agent.py, here on Signpost) trains
through the whole asynchronous system: the actor serves its OpenAI-compatible endpoint, runs the agent once per
episode, and the sessions' episodes reach the learner through the buffer and its write-ahead log like any other.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import horizonrl_cmd, start_process, stop_process

from horizonrl.buffer.records import Accepted, decode_record
from horizonrl.buffer.wal import WriteAheadLog
from horizonrl.protocol.arrays import MASK_DTYPE, TOKEN_DTYPE, unpack

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
STEPS = 2
TURNS = 2


def test_an_openai_agent_trains_through_the_whole_system(tiny_model, tmp_path):
    from transformers import AutoTokenizer

    run_dir, log_path = tmp_path / "run", tmp_path / "train.log"
    # One process (launcher.type=inline, apps/inline_run.py): this test is about the loop's logic, not processes.
    proc = start_process(horizonrl_cmd(
        "train", str(REPO / "configs" / "signpost_test.yaml"), f"model.path={tiny_model}", f"run.output_dir={run_dir}",
        "launcher.type=inline", "rollout.num_actors=1", "rollout.n=4", "rollout.max_context_tokens=2048", f"learner.total_steps={STEPS}",
        "learner.groups_per_step=2", "buffer.capacity_groups=4", "buffer.skip_equal_reward_groups=false",
        "monitor.record_fraction=1.0", f"algorithm.rounds_ctrl.rounds=[{TURNS}]",
        f"rollout.agent.command=[python, {REPO / 'examples' / 'babyai_agent.py'}]"), log_path)
    try:
        rc = proc.wait(timeout=600)
    finally:
        stop_process(proc)
    assert rc == 0, log_path.read_text()[-4000:]

    trajectories = [r.trajectory for r in map(decode_record, WriteAheadLog(run_dir / "buffer_wal").replay())
                    if isinstance(r, Accepted)]
    played = [t for t in trajectories if not t.failure]
    assert len(played) >= STEPS * 2 * 4, f"{len(played)} of {len(trajectories)} episodes played"
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    for t in played:
        ids, mask = unpack(t.token_ids, TOKEN_DTYPE).tolist(), unpack(t.loss_mask, MASK_DTYPE).tolist()
        assert 1 <= t.num_turns <= TURNS and t.max_turns == TURNS  # the coordinator's budget capped the calls
        prompt = tokenizer.decode(ids[:t.prompt_length])
        assert '"name": "look"' in prompt and '"name": "act"' in prompt  # the agent's tools, in the prompt
        assert sum(mask) == sum(e - s for s, e in t.turn_spans) and t.text.replies
        # what the agent was told after each act call is the environment's answer (the scripted-model test in
        # tests/test_openai_endpoint_http.py checks that its rewards are the episode's); the untrained model,
        # under a tool prompt it never saw, rarely names a valid action
        assert all(o.startswith(("Invalid action", "Dead end", "A sign points", "You reached the exit"))
                   for o in t.text.observations), t.text.observations
        assert t.stop_reason in ("max_turns", "done")
    agent_log = run_dir / "logs" / "agents-actor-0.log"
    assert agent_log.exists() and "Traceback" not in agent_log.read_text()
