"""What the schema cannot say: the semantic checks of a trajectory (bottom layer, numpy only).

The codec guarantees types; a trajectory can still be well-typed and inconsistent — arrays of
different lengths, an id outside the model's vocabulary, a NaN reward, a turn span outside the
sequence or not matching the loss mask, more tokens than the run's context holds, a group bigger
than the run's — and any of those would crash the learner, hold it in one step for minutes, or
silently poison a step. The buffer runs :func:`trajectory_problem` on every trajectory at the door and
rejects (and counts) what fails; the learner runs it again on every batch it receives.

The checks that need state — a group whose members disagree on task or size, weight versions
from the future — are the buffer's (``buffer/groups.py``).
"""

from __future__ import annotations

import math

import msgspec
import numpy as np

from collections.abc import Collection

from horizonrl.protocol.arrays import LOGPROB_DTYPE, MASK_DTYPE, TOKEN_DTYPE
from horizonrl.protocol.messages import FAILURE_KINDS, FAILURE_NONE, MAX_SAMPLE_TEXT, EpisodeText, Trajectory
from horizonrl.protocol.names import MAX_ID_CHARS, MAX_LABEL_CHARS, is_id, is_label, shown

MAX_TIMINGS = 16  # named timings of one episode (the actor sends two)
LOGPROB_SLACK = 1e-3  # a log-probability is <= 0; float32 rounding may give a hair above

# Rejection reasons (counted by the buffer as rejected_<reason>).
REJECT_IDS = "ids"
REJECT_ARRAYS = "array_lengths"
REJECT_MASK = "loss_mask"
REJECT_VOCAB = "token_out_of_vocab"
REJECT_LOGPROBS = "logprobs"
REJECT_NUMBERS = "non_finite_number"
REJECT_TURNS = "turns"
REJECT_SPANS = "turn_spans"
REJECT_FIELDS = "fields"
REJECT_TOO_LONG = "too_long"
REJECT_SAMPLES = "sample_starts"
REJECT_NAMES = "names"
MAX_SAMPLES = 4096  # samples of one episode (one per turn at most)


class _CountedText(msgspec.Struct, kw_only=True):
    replies: msgspec.Raw = msgspec.Raw(b"")
    actions: msgspec.Raw = msgspec.Raw(b"")
    observations: msgspec.Raw = msgspec.Raw(b"")


class _CountedTrajectory(msgspec.Struct, tag="trajectory", kw_only=True):
    """A trajectory message with its arrays and lists left as msgpack (``Raw``: a view of the bytes, nothing
    built): what :func:`trajectory_size_problem` reads."""

    trajectory_id: str = ""
    token_ids: msgspec.Raw = msgspec.Raw(b"")
    turn_spans: msgspec.Raw = msgspec.Raw(b"")
    turn_versions: msgspec.Raw = msgspec.Raw(b"")
    turn_epochs: msgspec.Raw = msgspec.Raw(b"")
    turn_rewards: msgspec.Raw = msgspec.Raw(b"")
    version_spans: msgspec.Raw = msgspec.Raw(b"")
    sample_starts: msgspec.Raw = msgspec.Raw(b"")
    hidden_turns: msgspec.Raw = msgspec.Raw(b"")
    summary_turns: msgspec.Raw = msgspec.Raw(b"")
    timings: msgspec.Raw = msgspec.Raw(b"")
    text: _CountedText | None = None


_counted_decoder = msgspec.msgpack.Decoder(_CountedTrajectory)


def trajectory_size_problem(message: bytes | memoryview, *, max_tokens: int | None = None,
                            max_turns: int | None = None) -> tuple[str, str, str] | None:
    """The cheap limits, read from the message's msgpack headers before any of it is built into objects:
    ``(trajectory id, reason, detail)`` when it breaks one, else None (also when it does not decode: the full
    decode says why). A list of small items costs far more as Python objects than on the wire (a 3-byte turn
    span is a ~70-byte tuple), so an in-limit message with millions of them would cost many times its size
    before :func:`trajectory_problem` could refuse it. ``max_turns``: the run's largest turn budget (every list
    per turn is at most that long); ``max_tokens``: its context (each sample is at most that long)."""
    try:
        counted = _counted_decoder.decode(message)
    except (msgspec.MsgspecError, ValueError, OverflowError, RecursionError):
        return None
    tid = counted.trajectory_id if is_id(counted.trajectory_id) else counted.trajectory_id[:MAX_ID_CHARS]
    tokens = _msgpack_length(counted.token_ids) // TOKEN_DTYPE.itemsize
    samples = _msgpack_length(counted.sample_starts)
    if samples > MAX_SAMPLES or max(_msgpack_length(counted.hidden_turns), _msgpack_length(counted.summary_turns)) \
            > samples:
        return tid, REJECT_SAMPLES, (f"{samples + 1} samples, {_msgpack_length(counted.hidden_turns)} hidden-turn "
                                     f"counts and {_msgpack_length(counted.summary_turns)} summaries; at most "
                                     f"{MAX_SAMPLES + 1} samples, one count and one summary per start")
    if max_tokens is not None and tokens > max_tokens * (samples + 1):
        return tid, REJECT_TOO_LONG, f"{tokens} tokens in {samples + 1} samples; the run's context holds {max_tokens}"
    turn_limit = tokens if max_turns is None else min(tokens, max_turns)  # every turn generates a token
    lists = {"turn_spans": counted.turn_spans, "turn_versions": counted.turn_versions,
             "turn_epochs": counted.turn_epochs, "turn_rewards": counted.turn_rewards}
    if counted.text is not None:
        lists.update({"text.replies": counted.text.replies, "text.actions": counted.text.actions,
                      "text.observations": counted.text.observations})
    for name, raw in lists.items():
        if _msgpack_length(raw) > turn_limit:
            return tid, REJECT_TURNS, f"{_msgpack_length(raw)} {name} for at most {turn_limit} turns"
    if _msgpack_length(counted.version_spans) > tokens:
        return tid, REJECT_SPANS, f"{_msgpack_length(counted.version_spans)} version spans for {tokens} tokens"
    if _msgpack_length(counted.timings) > MAX_TIMINGS:
        return tid, REJECT_NAMES, f"{_msgpack_length(counted.timings)} timings; at most {MAX_TIMINGS}"
    return None


def _msgpack_length(raw: msgspec.Raw) -> int:
    """The item count (array, map) or byte length (bin, str) a msgpack value's header states; 0 for others."""
    data = memoryview(raw)
    if not data:
        return 0
    first = data[0]
    if 0x90 <= first <= 0x9F or 0x80 <= first <= 0x8F:  # fixarray, fixmap
        return first & 0x0F
    if 0xA0 <= first <= 0xBF:  # fixstr
        return first & 0x1F
    width = {0xC4: 1, 0xD9: 1, 0xC5: 2, 0xDA: 2, 0xDC: 2, 0xDE: 2, 0xC6: 4, 0xDB: 4, 0xDD: 4, 0xDF: 4}.get(first)
    if width is None or len(data) < 1 + width:
        return 0
    return int.from_bytes(data[1:1 + width], "big")


def trajectory_problem(t: Trajectory, vocab_size: int | None = None, *, max_tokens: int | None = None,
                       max_group_size: int | None = None,
                       env_names: Collection[str] | None = None) -> tuple[str, str] | None:
    """``None`` if ``t`` is consistent, else ``(reason, detail)`` (reason: one of the REJECT_* names).
    ``max_tokens``: the run's context limit (rollout.max_context_tokens: no episode of the run is longer);
    ``max_group_size``: its group size (rollout.n); ``env_names``: the run's environments (None: any name)."""
    if not (is_id(t.trajectory_id) and is_id(t.group_id)):
        return REJECT_IDS, (f"trajectory and group ids must be 1..{MAX_ID_CHARS} characters of [A-Za-z0-9._-:+=@], "
                            f"not {shown(t.trajectory_id)}, {shown(t.group_id)}")
    problem = _names_problem(t, env_names)
    if problem:
        return REJECT_NAMES, problem
    longest = max(len(t.token_ids) // TOKEN_DTYPE.itemsize, len(t.loss_mask), len(t.logprobs) // LOGPROB_DTYPE.itemsize)
    problem = _sample_starts_problem(t, longest)
    if problem:
        return REJECT_SAMPLES, problem
    if t.sample_starts:  # each sample is a sequence of its own; the context bounds each
        longest = max(end - start for start, end in zip([0, *t.sample_starts], [*t.sample_starts, longest]))
    if max_tokens is not None and longest > max_tokens:
        return REJECT_TOO_LONG, f"{longest} tokens; the run's context holds {max_tokens}"
    if (t.group_size < 1 or (max_group_size is not None and t.group_size > max_group_size) or t.task_id < 0
            or t.failure not in FAILURE_KINDS):
        return REJECT_FIELDS, f"group_size {t.group_size}, task_id {t.task_id}, failure {t.failure[:64]!r}"
    sizes = (len(t.token_ids), len(t.loss_mask), len(t.logprobs))
    if sizes[0] % TOKEN_DTYPE.itemsize or sizes[2] % LOGPROB_DTYPE.itemsize:
        return REJECT_ARRAYS, f"byte lengths {sizes} are not whole numbers of items"
    tokens = np.frombuffer(t.token_ids, TOKEN_DTYPE)
    mask = np.frombuffer(t.loss_mask, MASK_DTYPE)
    logprobs = np.frombuffer(t.logprobs, LOGPROB_DTYPE)
    n = len(tokens)
    if not n == len(mask) == len(logprobs):
        return REJECT_ARRAYS, f"{n} tokens, {len(mask)} mask entries, {len(logprobs)} logprobs"
    # An episode whose environment failed at reset played nothing: it has no tokens, and still counts for
    # its group (which completes without it).
    if (n == 0 and t.failure == FAILURE_NONE) or not 0 <= t.prompt_length <= n:
        return REJECT_ARRAYS, f"{n} tokens with prompt_length {t.prompt_length}"
    if mask.size and mask.max() > 1:
        return REJECT_MASK, "loss_mask holds values other than 0 and 1"
    if n and (tokens.min() < 0 or (vocab_size is not None and tokens.max() >= vocab_size)):
        return REJECT_VOCAB, f"token ids span [{tokens.min()}, {tokens.max()}]; the vocabulary has {vocab_size}"
    if not np.isfinite(logprobs).all():
        return REJECT_LOGPROBS, "a logprob is NaN or infinite"
    generated = mask == 1
    if (logprobs[generated] > LOGPROB_SLACK).any() or (logprobs[~generated] != 0).any():
        return REJECT_LOGPROBS, "logprobs must be <= 0 on generated tokens and 0 elsewhere"
    numbers = [t.reward, t.score, *t.turn_rewards]
    if not all(math.isfinite(x) for x in numbers):
        return REJECT_NUMBERS, "reward, score or a turn reward is NaN or infinite"
    turns = len(t.turn_spans)
    if not turns == len(t.turn_versions) == len(t.turn_epochs) == t.num_turns:
        return REJECT_TURNS, (f"{turns} spans, {len(t.turn_versions)} versions, {len(t.turn_epochs)} epochs, "
                              f"num_turns {t.num_turns}")
    if len(t.turn_rewards) > turns or (t.failure == FAILURE_NONE and len(t.turn_rewards) != turns):
        return REJECT_TURNS, f"{len(t.turn_rewards)} turn rewards for {turns} turns"
    if min(t.turn_versions, default=0) < 0 or min(t.turn_epochs, default=0) < 0:
        return REJECT_TURNS, "negative weight version or epoch"
    in_spans = np.zeros(n, dtype=bool)
    previous_end = t.prompt_length
    for start, end in t.turn_spans:
        if not previous_end <= start < end <= n:
            return REJECT_SPANS, f"span ({start}, {end}) is not inside ({previous_end}, {n}] after the previous one"
        in_spans[start:end] = True
        previous_end = end
    if not np.array_equal(in_spans, generated):
        return REJECT_SPANS, "the loss mask is not 1 exactly on the turn spans"
    for start in t.sample_starts:  # a sample starts with its prompt: never inside or right at a generated turn
        if generated[start] or any(s < start < e for s, e in t.turn_spans):
            return REJECT_SAMPLES, f"sample start {start} is inside a generated turn"
    if t.version_spans:
        problem = _version_spans_problem(t)
        if problem:
            return REJECT_SPANS, problem
    problem = _text_problem(t.text, turns) if t.text is not None else None
    return (REJECT_FIELDS, problem) if problem else None


def _text_problem(text: EpisodeText, turns: int) -> str | None:
    """The episode's recorded text (``Trajectory.text``): one reply and action per turn, bounded lengths."""
    if not len(text.replies) == len(text.actions) == turns or len(text.observations) > turns:
        return (f"text of {len(text.replies)} replies, {len(text.actions)} actions and "
                f"{len(text.observations)} observations for {turns} turns")
    if any(len(x) > MAX_SAMPLE_TEXT for x in (text.first_observation, *text.replies, *text.actions,
                                               *text.observations)):
        return f"a text of the episode is over {MAX_SAMPLE_TEXT} characters"
    return None


def _names_problem(t: Trajectory, env_names: Collection[str] | None) -> str | None:
    """The strings a trajectory carries beyond its ids, checked before anything else reads them: the environment,
    the stop reason and the timings' names become parts of metric and counter names (``protocol/names.py``), the
    category and the failure message are shown to people."""
    if not is_label(t.env) or (env_names is not None and t.env not in env_names):
        return f"environment {shown(t.env)} is not one of this run's"
    if t.stop_reason and not is_label(t.stop_reason):
        return f"stop reason {shown(t.stop_reason)}"
    if len(t.category) > MAX_LABEL_CHARS or not t.category.isprintable():
        return f"category {shown(t.category)}: at most {MAX_LABEL_CHARS} printable characters"
    if len(t.failure_message) > MAX_SAMPLE_TEXT:
        return f"a failure message of {len(t.failure_message)} characters"
    if len(t.timings) > MAX_TIMINGS or not all(is_label(name) for name in t.timings):
        return f"{len(t.timings)} timings, named {shown(', '.join(list(t.timings)[:4]))}"
    return None


def _sample_starts_problem(t: Trajectory, n: int) -> str | None:
    """``sample_starts`` must increase strictly, after the first prompt and inside the arrays; ``hidden_turns`` has one
    count per start, ``summary_turns`` at most one turn per start, in order."""
    if len(t.sample_starts) > MAX_SAMPLES:
        return f"{len(t.sample_starts) + 1} samples; at most {MAX_SAMPLES + 1}"
    if t.hidden_turns and (len(t.hidden_turns) != len(t.sample_starts)
                           or not all(0 <= h <= t.num_turns for h in t.hidden_turns)):
        return (f"hidden_turns {t.hidden_turns[:8]} for {len(t.sample_starts)} sample starts and {t.num_turns} "
                f"turns: one count per start, each at most the turns")
    summaries = t.summary_turns
    if summaries and (len(summaries) > len(t.sample_starts) or summaries != sorted(set(summaries))
                      or not 0 <= summaries[0] <= summaries[-1] < t.num_turns):
        return (f"summary turns {t.summary_turns[:8]} of {t.num_turns} turns and {len(t.sample_starts)} sample "
                "starts: increasing turn numbers, at most one per start")
    previous = t.prompt_length
    for start in t.sample_starts:
        if not previous < start < n:
            return f"sample start {start} is not inside ({previous}, {n}) after the previous one"
        previous = start
    return None


def _version_spans_problem(t: Trajectory) -> str | None:
    """``version_spans`` must tile each turn span in order, start with the turn's own tag, and never go back
    to older weights within a turn."""
    spans = iter(t.version_spans)
    for (start, end), epoch, version in zip(t.turn_spans, t.turn_epochs, t.turn_versions):
        at, previous = start, None
        while at < end:
            span = next(spans, None)
            if span is None:
                return f"version_spans end before turn span ({start}, {end})"
            s_start, s_end, s_epoch, s_version = span
            if s_start != at or not s_start < s_end <= end or min(s_epoch, s_version) < 0:
                return f"version span {span} does not continue turn span ({start}, {end}) at {at}"
            key = (s_epoch, s_version)
            if previous is None and key != (epoch, version):
                return f"turn span ({start}, {end}) is tagged {(epoch, version)} but its first version span is {key}"
            if previous is not None and key <= previous:
                return f"version span {span} does not come from newer weights than the one before it"
            at, previous = s_end, key
    if next(spans, None) is not None:
        return "version_spans go past the last turn span"
    return None
