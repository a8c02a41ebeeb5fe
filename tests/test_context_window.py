"""Episodes past the context (``rollout.context.policy``: window, summarize): when the next turn would not fit, the
episode goes on in a new segment whose prompt drops the oldest turns, or replaces them with the model's summary. Checked on the tiny model's tokenizer with the scripted,
recording engine of the branching tests: each segment the learner trains on is, token for token, what the engine
was prompted with and generated; the segments survive the buffer's log; the bounds and the records hold."""

from __future__ import annotations

import copy

import msgspec
import pytest

from horizonrl.actors.episode_messages import to_trajectory
from horizonrl.actors.context import SUMMARY_REQUEST, ContextPolicy, shown_conversation
from horizonrl.actors.episode import SamplingSettings, run_episode
from horizonrl.apps.tiny_model import THINKING_CHAT_TEMPLATE, build_tokenizer
from horizonrl.buffer.groups import GroupBuffer
from horizonrl.buffer.records import Accepted, apply, decode_record, encode_record
from horizonrl.buffer.wal import WriteAheadLog
from horizonrl.core.chat import ChatTokenizer
from horizonrl.core.config import ConfigError, load_config
from horizonrl.core.episode_records import episode_record
from horizonrl.envs.signpost import SignpostEnv
from horizonrl.protocol import Trajectory, decode_as, encode
from horizonrl.protocol.validation import REJECT_SAMPLES, trajectory_problem, trajectory_size_problem

from test_branching import TASK, TEXTS, RecordingEngine, assert_token_exact, chat_with, correct_moves

CONTEXT = 300  # four Signpost turns of the tiny tokenizer fill it: the fifth does not fit
WRONG = ["Action: go nowhere"] * 8  # invalid replies: the episode goes on, each turn adds a long observation


def sampling(policy: str = "window", context: int = CONTEXT, **kw) -> SamplingSettings:
    return SamplingSettings(temperature=1.0, top_p=1.0, max_tokens_per_turn=16, max_context_tokens=context,
                            system_prompt="Follow the signs.", context=ContextPolicy(policy, **{"max_segments": 8, **kw}))


@pytest.fixture(scope="module")
def chat():
    return ChatTokenizer(copy.deepcopy(build_tokenizer(TEXTS, vocab_size=400)))


class SummarizingEngine(RecordingEngine):
    """The recording engine that answers a request for a summary with ``SUMMARY`` (else the next scripted reply)."""

    async def generate(self, prompt_ids, *, max_tokens, temperature, top_p, stop_token_ids):
        if SUMMARY_REQUEST in self.chat.decode(prompt_ids[-200:]):
            self.replies.insert(0, SUMMARY)
        return await super().generate(prompt_ids, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                      stop_token_ids=stop_token_ids)


SUMMARY = "The sign points left."
SUMMARIZE = sampling("summarize", context=600, summary_tokens=16)  # room for the request (~160 tokens) and summary


async def play(chat, replies, settings, max_turns=20):
    engine = SummarizingEngine(chat, replies)
    ep = await run_episode(engine, SignpostEnv(length=3), chat, TASK, max_turns=max_turns, sampling=settings,
                           weights=lambda: (0, 4))
    trajectory = to_trajectory(ep, run_id="r", trajectory_id="t0", group_id="g", group_size=2, env="signpost",
                               task_id=TASK, actor_id=0, max_turns=max_turns, category="", with_text=True)
    return ep, engine, decode_as(encode(trajectory), Trajectory)


def winning(moves=None):
    return WRONG + [f"Action: go {m}" for m in (moves or correct_moves())]


async def test_a_cut_episode_ends_at_the_context_and_a_windowed_one_goes_on_in_token_exact_segments(chat):
    assert chat.append_only
    cut, _, _ = await play(chat, winning(), sampling("cut"))
    assert cut.stop_reason == "context_limit" and not cut.success and cut.num_turns == 4

    ep, engine, trajectory = await play(chat, winning(), sampling())
    assert ep.success and ep.stop_reason == "done" and ep.num_turns == 11
    assert len(trajectory.sample_starts) == len(trajectory.hidden_turns) >= 2
    assert all(hidden > 0 for hidden in trajectory.hidden_turns)
    assert trajectory.hidden_turns == sorted(trajectory.hidden_turns)  # each window drops more of the past
    # Each segment fits the context, the whole episode does not: the buffer and the learner take it as it is.
    assert max(e - s for s, e in trajectory.sample_bounds()) <= CONTEXT < trajectory.num_tokens
    assert trajectory_problem(trajectory, 400, max_tokens=CONTEXT) is None
    assert trajectory_size_problem(encode(trajectory), max_tokens=CONTEXT, max_turns=20) is None
    # The learner's sequences are, turn by turn, the engine's prompts and generations (and their logprobs).
    samples = assert_token_exact(engine, trajectory)
    assert len(samples) == len(trajectory.sample_starts) + 1
    # A segment's prompt: the system prompt, the task, a note of what is not shown, the newest turns.
    for start, hidden in zip(trajectory.sample_starts, trajectory.hidden_turns):
        first_turn = next(k for k, (s, _) in enumerate(trajectory.turn_spans) if s >= start)
        prompt = engine.prompts[first_turn]
        assert prompt == chat.conversation_ids(*shown_conversation(ep, hidden, first_turn), "Follow the signs.")
        text = chat.decode(prompt)
        assert text.count("Follow the signs to the exit") == 1 and f"[{hidden} earlier turns not shown]" in text
        assert len(prompt) <= CONTEXT // 2 or hidden == first_turn  # window_fill, unless only the newest fits


async def test_a_window_keeps_the_newest_turns_that_fit_its_fill_and_no_fewer(chat):
    ep, engine, trajectory = await play(chat, winning(), sampling(window_fill=0.9))
    assert ep.success
    budget, previous = int(0.9 * CONTEXT), 0
    for start, hidden in zip(trajectory.sample_starts, trajectory.hidden_turns):
        first_turn = next(k for k, (s, _) in enumerate(trajectory.turn_spans) if s >= start)
        assert previous < hidden < first_turn  # with room for 90 % of the context some turns are kept
        assert len(engine.prompts[first_turn]) <= budget
        assert "Action: go nowhere" in chat.decode(engine.prompts[first_turn])  # the kept turns' replies
        # Keeping one turn more would not have fitted (or that turn was already hidden by the window before).
        one_more = chat.conversation_ids(*shown_conversation(ep, hidden - 1, first_turn), "Follow the signs.")
        assert hidden - 1 == previous or len(one_more) > budget
        previous = hidden


async def test_max_segments_bounds_an_episode_and_it_ends_at_the_context(chat):
    ep, _, trajectory = await play(chat, WRONG * 3, sampling(max_segments=2))
    assert ep.stop_reason == "context_limit" and len(trajectory.sample_starts) == 1
    assert trajectory_problem(trajectory, 400, max_tokens=CONTEXT) is None


async def test_the_turn_budget_after_a_window_leaves_no_empty_segment(chat):
    settings = sampling()
    full, _, _ = await play(chat, winning(), settings)
    first_window_turn = next(k for k, (s, _) in enumerate(full.turn_spans) if s >= full.sample_starts[0])
    ep, _, trajectory = await play(chat, winning(), settings, max_turns=first_window_turn)
    assert ep.stop_reason == "max_turns" and trajectory.sample_starts == [] and trajectory.hidden_turns == []
    assert trajectory.sample_bounds()[-1][1] == trajectory.turn_spans[-1][1]


async def test_a_template_that_rewrites_history_renders_only_the_turns_a_window_shows(chat):
    thinking = chat_with(chat.tokenizer, THINKING_CHAT_TEMPLATE)
    assert not thinking.append_only
    ep, engine, trajectory = await play(thinking, winning(), sampling())
    assert ep.success and any(trajectory.hidden_turns) and trajectory_problem(trajectory, 400, max_tokens=CONTEXT) is None
    assert_token_exact(engine, trajectory)
    last_window = max(trajectory.hidden_turns)
    assert "not shown]" in thinking.decode(engine.prompts[-1])
    assert engine.prompts[-1] == thinking.conversation_ids(*shown_conversation(ep, last_window, ep.num_turns - 1),
                                                           "Follow the signs.")


@pytest.mark.parametrize("policy", ["window", "summarize"])
async def test_segments_come_back_whole_from_the_buffers_log(chat, tmp_path, policy):
    """Resume in the middle of a windowed or summarized episode's group: the log holds the trajectory, segments,
    summaries and all, and the buffer rebuilt from it serves exactly what arrived."""
    settings = sampling() if policy == "window" else SUMMARIZE
    _, _, trajectory = await play(chat, winning(), settings)
    assert len(trajectory.sample_starts) >= 2 and bool(trajectory.summary_turns) == (policy == "summarize")
    mate = msgspec.structs.replace(trajectory, trajectory_id="t1", reward=0.0, success=False)
    wal = WriteAheadLog(tmp_path)
    for t in (trajectory, mate):
        wal.append(encode_record(Accepted(encode(t))))
    wal.sync()
    wal.close()
    state = GroupBuffer(capacity_groups=2, max_staleness=10, skip_equal_reward_groups=False, group_timeout_s=1e9)
    for data in WriteAheadLog(tmp_path).replay():
        apply(state, decode_record(data))
    [group] = state.serve(0, 1, 4, state.choose(1, 4))
    served = {t.trajectory_id: t for t in group}["t0"]
    assert encode(served) == encode(trajectory) and served.hidden_turns == trajectory.hidden_turns
    assert served.summary_turns == trajectory.summary_turns


async def test_the_record_and_the_viewer_say_what_each_segment_leaves_out(chat):
    from horizonrl.apps.viewer.pages import _segment_note

    ep, _, trajectory = await play(chat, winning(), sampling())
    record = episode_record(trajectory)
    assert record["samples"] == len(trajectory.sample_starts) + 1
    assert record["hidden_turns"] == [0, *trajectory.hidden_turns]
    hidden, start = trajectory.hidden_turns[0], trajectory.sample_starts[0]
    first_turn = next(k for k, (s, _) in enumerate(trajectory.turn_spans) if s >= start)
    assert record["turns"][first_turn]["sample"] == 1 and record["turns"][first_turn - 1]["sample"] == 0
    note = _segment_note(record, first_turn + 1)
    assert f"turns 1–{hidden} are not shown" in note and "context window" in note
    assert _segment_note(record, first_turn) == "" and _segment_note(record, 1) == ""


async def test_malformed_hidden_turn_counts_are_rejected(chat):
    _, _, good = await play(chat, winning(), sampling())
    assert trajectory_problem(good, 400) is None
    starts, turns = good.hidden_turns, good.num_turns
    for hidden in ([*starts, 1], starts[:-1], [turns + 1] * len(starts), [-1] * len(starts)):
        bad = msgspec.structs.replace(good, hidden_turns=hidden)
        assert trajectory_problem(bad, 400)[0] == REJECT_SAMPLES, hidden
    flood = msgspec.structs.replace(good, hidden_turns=[0] * 10_000)
    assert trajectory_size_problem(encode(flood))[1] == REJECT_SAMPLES


def test_the_config_bounds_a_step_by_the_segments_and_keeps_agents_to_cut():
    base = ["model.path=/m", "envs=[{name: signpost}]"]
    window = load_config(None, [*base, "rollout.context.policy=window", "rollout.context.max_segments=3"])
    assert window.step_token_budget == 3 * load_config(None, base).step_token_budget
    summarize = load_config(None, [*base, "rollout.context.policy=summarize", "rollout.context.max_segments=3"])
    assert summarize.step_token_budget == window.step_token_budget
    assert (summarize.rollout.context.max_summaries, window.rollout.context.max_summaries) == (2, 0)
    with pytest.raises(ConfigError, match="keeps its own history"):
        load_config(None, [*base, "rollout.context.policy=window", "rollout.agent.command=[python, agent.py]"])
    with pytest.raises(ConfigError, match="window_fill"):
        load_config(None, [*base, "rollout.context.window_fill=1.0"])


async def test_a_summarized_episode_trains_its_summaries_as_turns_and_goes_on_from_them(chat):
    cut, _, _ = await play(chat, winning(), sampling("cut", context=600))
    assert cut.stop_reason == "context_limit" and not cut.success

    ep, engine, trajectory = await play(chat, winning(), SUMMARIZE)
    assert ep.success and ep.env_turns == 11 and ep.num_turns == 11 + len(ep.summary_turns)
    assert len(trajectory.summary_turns) == len(trajectory.sample_starts) == 2
    assert trajectory_problem(trajectory, 400, max_tokens=600) is None
    assert trajectory_size_problem(encode(trajectory), max_tokens=600, max_turns=11 + 7) is None
    # The summaries are generated turns like any other: in the learner's sequences, token for token, loss mask 1.
    assert_token_exact(engine, trajectory)
    for turn, start in zip(trajectory.summary_turns, trajectory.sample_starts):
        asked, written = engine.prompts[turn], engine.generated[turn]
        assert SUMMARY_REQUEST in chat.decode(asked[-200:]) and chat.decode(written).strip() == SUMMARY
        assert trajectory.turn_rewards[turn] == 0.0 and trajectory.text.actions[turn] == ""
        assert trajectory.turn_spans[turn][1] <= start  # the segment after it starts from the summary
        # The next segment's prompt: the task, the summary, the latest observation; no earlier reply.
        text = chat.decode(engine.prompts[turn + 1])
        assert text.count("Follow the signs to the exit") == 1 and SUMMARY in text and "go nowhere" not in text
        assert f"[Your summary of the {turn - trajectory.summary_turns.index(turn)} turns so far]" in text
        assert engine.prompts[turn + 1] == chat.conversation_ids([trajectory.text.observations[turn]], [],
                                                                 "Follow the signs.")
    assert trajectory.hidden_turns == [t + 1 for t in trajectory.summary_turns]


async def test_summaries_do_not_count_against_the_turn_budget(chat):
    ep, _, trajectory = await play(chat, winning(), SUMMARIZE, max_turns=11)
    assert ep.success and ep.env_turns == 11 and trajectory.num_turns == 13
    ep, _, trajectory = await play(chat, winning(), SUMMARIZE, max_turns=8)
    assert ep.stop_reason == "max_turns" and ep.env_turns == 8 and len(trajectory.summary_turns) == 1


async def test_where_the_request_and_the_summary_do_not_fit_a_window_carries_the_episode(chat):
    ep, engine, trajectory = await play(chat, winning(), sampling("summarize", context=500, summary_tokens=16))
    assert ep.success and trajectory.summary_turns == [] and all(trajectory.hidden_turns)
    assert not any(SUMMARY_REQUEST in chat.decode(p[-200:]) for p in engine.prompts)
    assert_token_exact(engine, trajectory)


async def test_malformed_summary_turns_are_rejected(chat):
    _, _, good = await play(chat, winning(), SUMMARIZE)
    assert trajectory_problem(good, 400) is None
    turns = good.num_turns
    for summaries in ([5, 5], [11, 5], [turns], [-1], [1, 2, 3]):
        bad = msgspec.structs.replace(good, summary_turns=summaries)
        assert trajectory_problem(bad, 400)[0] == REJECT_SAMPLES, summaries
    flood = msgspec.structs.replace(good, summary_turns=list(range(10_000)))
    assert trajectory_size_problem(encode(flood))[1] == REJECT_SAMPLES


async def test_the_record_and_the_viewer_show_a_summary_and_the_segment_it_starts(chat):
    from horizonrl.apps.viewer.pages import _segment_note

    _, _, trajectory = await play(chat, winning(), SUMMARIZE)
    record = episode_record(trajectory)
    summary = trajectory.summary_turns[0]
    assert [t["summary"] for t in record["turns"]].count(True) == 2 and record["turns"][summary]["summary"]
    assert record["turns"][summary]["reply"].strip() == SUMMARY
    note = _segment_note(record, summary + 2)
    assert "context summary" in note and f"summary of turn {summary + 1}" in note


def test_a_window_after_a_summary_keeps_the_summary_in_the_tasks_place():
    from horizonrl.actors.episode import Episode

    ep = Episode(observations=["task", "o1", "o2", "task + summary + o2", "o4", "o5", "o6"],
                 replies=["r0", "r1", "summary", "r3", "r4", "r5"], summary_heads={3})
    assert shown_conversation(ep, 3) == (["task + summary + o2", "o4", "o5", "o6"], ["r3", "r4", "r5"])
    assert shown_conversation(ep, 5) == (["task + summary + o2\n\n[2 turns since the summary not shown]\n\no5", "o6"],
                                         ["r5"])
    assert shown_conversation(ep, 2, turns=2) == (["task\n\n[2 earlier turns not shown]\n\no2"], [])


async def test_the_viewer_counts_the_windows_and_the_summaries_of_an_episode(chat):
    from horizonrl.apps.viewer.pages import _samples_text

    for settings, expected in ((sampling(), "3 samples (2 context windows)"),
                               (SUMMARIZE, "3 samples (2 context summaries)"),
                               (sampling("summarize", context=520, summary_tokens=16),
                                "4 samples (1 context window and 2 context summaries)")):
        _, _, trajectory = await play(chat, winning(), settings)
        assert _samples_text(episode_record(trajectory)) == f" · trained as {expected}"
