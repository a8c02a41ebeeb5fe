"""Messages no process of a run sends: the malformed-message storm of ``horizonrl chaos --storm`` and the fuzz tests.

Every function returns encoded bytes (what goes on a socket), made from a seeded ``random.Random`` so a
storm can be replayed. The kinds, each a way a peer or a bad day gets it wrong:
- :func:`junk`: random bytes, truncated msgpack, msgpack of the wrong shape, a length that lies, a
  well-formed message of another run, or of a kind the socket does not take;
- :func:`invalid_utf8`: a well-formed message with invalid UTF-8 in one string (a field, a dict key, the
  type tag) — every string of every kind, one at a time (:func:`string_paths`);
- :func:`wrong_report`: reports on the coordinator's socket that are well-formed, of this run and wrong —
  an unknown process, environment or role, a NaN, a step beyond the run, a forged final report or
  supervision event without the run's key (``protocol/report_checks.py`` names the reasons);
- :func:`oversized_trajectory`: a consistent trajectory far longer than the run's context, within the
  socket's size limit (so it reaches the buffer's door, where it must be refused and counted);
- :func:`future_trajectory`: a consistent trajectory from weights past the run's last step.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Iterator
from typing import Any

import msgspec

from horizonrl.protocol import (EVENT_DIED, Batch, BatchRequest, Control, CudaIpcBuffer, EpisodeSample, EpisodeText,
                                Heartbeat, HeldOutEval, IpcBucketAck, IpcBucketReady, IpcWeights, LearnerReport,
                                ProcessEvent, Registration, Trajectory, TrajectoryAck, WeightJoin, WeightLayout, encode)
from horizonrl.protocol.arrays import LOGPROB_DTYPE, MASK_DTYPE, TOKEN_DTYPE, pack

OTHER_RUN = "another-run"
_KEY = object()  # in a path: the dict key itself, not its value


def trajectory(run_id: str, trajectory_id: str, *, tokens: int = 12, version: int = 0, epoch: int = 0,
               group_size: int = 2, with_text: bool = False) -> Trajectory:
    """A consistent one-turn trajectory of ``tokens`` tokens (protocol/validation.py passes it)."""
    half = tokens // 2
    mask = [0] * half + [1] * (tokens - half)
    return Trajectory(
        run_id=run_id, trajectory_id=trajectory_id, group_id=trajectory_id.rsplit("-", 1)[0], group_size=group_size,
        env="signpost", task_id=1, actor_id=0, token_ids=pack([i % 100 for i in range(tokens)], TOKEN_DTYPE),
        loss_mask=pack(mask, MASK_DTYPE), logprobs=pack([-0.5 * m for m in mask], LOGPROB_DTYPE), prompt_length=half,
        turn_spans=[(half, tokens)], turn_versions=[version], turn_epochs=[epoch], turn_rewards=[0.0], reward=0.0,
        success=False, score=0.0, num_turns=1, max_turns=2, stop_reason="done", category="depth-2",
        timings={"generate_s": 0.1}, version_spans=[(half, tokens, epoch, version)],
        text=EpisodeText(first_observation="task", replies=["reply"], actions=["go"], observations=["seen"])
        if with_text else None)


def sample_messages(run_id: str) -> list[Any]:
    """One message of every kind, with something in every string field, dict and list."""
    layout = WeightLayout(run_id=run_id, version=1, epoch=0, names=["w"], dtypes=["float32"], shapes=[[2]],
                          total_bytes=8)
    cuda = CudaIpcBuffer(device=0, handle=b"h", storage_bytes=8, storage_offset=0, ref_counter_handle=b"r",
                         ref_counter_offset=0, event_handle=None, event_sync_required=False, tensor_offset=0, nbytes=8)
    traj = trajectory(run_id, "g-0", with_text=True)
    return [
        traj,
        Control(run_id=run_id, learner_step=1, max_turns=2, weight_version=1, endpoints={"batches": "tcp://h:1"}),
        layout,
        WeightJoin(run_id=run_id, actor=0, pid=1, ipc_address="tcp://127.0.0.1:1"),
        BatchRequest(run_id=run_id, request_id=1, learner_version=0, num_groups=1),
        Batch(run_id=run_id, request_id=1, groups=[[traj]], buffer_stats={"received": 1.0}),
        LearnerReport(run_id=run_id, step=1, weight_version=1, metrics={"loss/policy": 0.1}, checkpoint="c", key="k"),
        Heartbeat(run_id=run_id, role="actor", index=0, pid=1, counters={"episodes": 1.0}),
        EpisodeSample(run_id=run_id, env="signpost", task_id=1, actor_id=0, weight_version=0, max_turns=2, reward=0.0,
                      success=False, score=0.0, num_turns=1, stop_reason="done", failure="",
                      transcript=[("observation", "task"), ("reply", "go")]),
        TrajectoryAck(run_id=run_id, trajectory_ids=["g-0"], statuses=["accepted"], reasons=[""]),
        ProcessEvent(run_id=run_id, name="actor-0", role="actor", event=EVENT_DIED, key="k"),
        HeldOutEval(run_id=run_id, learner_step=0, weight_versions=(0, 0), wall_s=1.0,
                    results={"signpost": {"success_rate": 0.5, "episodes_valid": 4.0}}, key="k"),
        Registration(run_id=run_id, name="buffer", pid=1, endpoints={"batches": "tcp://h:1"}, key="k"),
        IpcWeights(run_id=run_id, layout=layout, bucket_bytes=8, buffer=cuda),
        IpcBucketReady(run_id=run_id, version=1, index=0),
        IpcBucketAck(run_id=run_id, version=1, index=0),
    ]


def string_paths(message: Any) -> list[tuple]:
    """Where every string of ``message`` is: its fields', its dicts' keys and values, its lists' items."""
    paths: list[tuple] = []

    def walk(value: Any, path: tuple) -> None:
        if isinstance(value, msgspec.Struct):
            for name in value.__struct_fields__:
                walk(getattr(value, name), path + (name,))
        elif isinstance(value, dict):
            for key, item in value.items():
                paths.append(path + (key, _KEY))
                walk(item, path + (key,))
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                walk(item, path + (index,))
        elif isinstance(value, str):
            paths.append(path)

    walk(message, ())
    return paths


def invalid_utf8(message: Any, path: tuple | None) -> bytes:
    """``message`` encoded with invalid UTF-8 in the string at ``path`` (None: in its type tag), the rest as is."""
    if path is None:
        tag = type(message).__struct_config__.tag.encode()
        data = encode(message)
        at = data.index(tag)
        return data[:at] + b"\xff" + data[at + 1:]
    marker = "\x7fhorizonrl-marker"  # one per message: no other string of it looks like this
    tree = msgspec.msgpack.decode(encode(message))  # the same msgpack, as plain dicts and lists
    key = path[-1] is _KEY
    parent = tree
    for step in path[:-2] if key else path[:-1]:
        parent = parent[step]
    if key:
        parent[marker] = parent.pop(path[-2])
    else:
        parent[path[-1]] = marker
    data = msgspec.msgpack.encode(tree)
    return data.replace(marker.encode(), b"\xff" + marker[1:].encode(), 1)


def invalid_utf8_messages(run_id: str) -> Iterator[bytes]:
    """Every string of every kind of message made invalid UTF-8, one at a time, and every kind's type tag."""
    for message in sample_messages(run_id):
        yield invalid_utf8(message, None)
        for path in string_paths(message):
            yield invalid_utf8(message, path)


def junk(rng: random.Random, run_id: str, n: int) -> bytes:
    """One of: random bytes, truncated msgpack, msgpack of the wrong shape, a huge declared length, a
    well-formed message of another run, or one of a kind no receiving socket takes (a Control)."""
    valid = encode(trajectory(run_id, f"junk{n}-0"))
    kind = n % 6
    if kind == 0:
        return rng.randbytes(rng.randint(0, 2000))
    if kind == 1:
        return valid[: rng.randint(0, len(valid) - 1)]
    if kind == 2:
        return msgspec.msgpack.encode(rng.choice([{"type": "trajectory", "v": 2, "run_id": 7}, [1, 2, 3],
                                                  {"type": rng.choice(["nope", "batch"]), "v": 2}, "a string", None,
                                                  1.5]))
    if kind == 3:  # msgpack bin32 that claims 2 GB and holds 10 bytes
        return b"\xc6" + struct.pack(">I", 2**31) + rng.randbytes(10)
    if kind == 4:
        return encode(trajectory(OTHER_RUN, f"junk{n}-0"))
    return encode(Control(run_id=run_id, learner_step=0, max_turns=1, weight_version=0))


def flipped(rng: random.Random, data: bytes, flips: int = 3) -> bytes:
    """``data`` with a few random bytes replaced."""
    out = bytearray(data)
    for _ in range(flips):
        out[rng.randrange(len(out))] = rng.randrange(256)
    return bytes(out)


def wrong_reports(run_id: str, key: str, *, total_steps: int, num_actors: int) -> list[tuple[bytes, str]]:
    """Well-formed reports of this run that must be rejected, each with the counter the coordinator counts it
    under (``rejected_<kind>_<reason>``)."""
    nan = float("nan")
    cases = [
        (ProcessEvent(run_id=run_id, name="actor", role="actor", event=EVENT_DIED, key=key),
         "process_event_unknown_process"),
        (ProcessEvent(run_id=run_id, name="actor-x", role="actor", event=EVENT_DIED, key=key),
         "process_event_unknown_process"),
        (ProcessEvent(run_id=run_id, name=f"actor-{num_actors}", role="actor", event=EVENT_DIED, key=key),
         "process_event_unknown_process"),
        (ProcessEvent(run_id=run_id, name="actor-0", role="actor", event="exploded", key=key),
         "process_event_bad_value"),
        (ProcessEvent(run_id=run_id, name="actor-0", role="actor", event=EVENT_DIED, delay_s=nan, key=key),
         "process_event_non_finite_number"),
        (ProcessEvent(run_id=run_id, name="actor-0", role="actor", event=EVENT_DIED), "process_event_unauthenticated"),
        (HeldOutEval(run_id=run_id, learner_step=0, weight_versions=(0, 0), wall_s=1.0, results={"signpost": {}},
                     key=key), "held_out_eval_bad_value"),
        (HeldOutEval(run_id=run_id, learner_step=0, weight_versions=(0, 0), wall_s=1.0,
                     results={"nowhere": {"success_rate": 1.0, "episodes_valid": 1.0}}, key=key),
         "held_out_eval_unknown_env"),
        (HeldOutEval(run_id=run_id, learner_step=0, weight_versions=(0, 0), wall_s=1.0,
                     results={"signpost": {"success_rate": 0.0, "episodes_valid": 9.0}}),
         "held_out_eval_unauthenticated"),
        (LearnerReport(run_id=run_id, step=total_steps, weight_version=total_steps, final=True),
         "learner_report_unauthenticated"),
        (LearnerReport(run_id=run_id, step=total_steps + 1, weight_version=0, key=key), "learner_report_out_of_range"),
        (LearnerReport(run_id=run_id, step=10**9, weight_version=10**9, final=True, key="not-the-key"),
         "learner_report_unauthenticated"),
        (Heartbeat(run_id=run_id, role="actr", index=0, pid=1, key=key), "heartbeat_unknown_process"),
        (Heartbeat(run_id=run_id, role="actor", index=num_actors, pid=1, key=key), "heartbeat_unknown_process"),
        (Heartbeat(run_id=run_id, role="buffer", index=0, pid=1, counters={"ready_groups": float("inf")}, key=key),
         "heartbeat_non_finite_number"),
        (Heartbeat(run_id=run_id, role="buffer", index=0, pid=-5, key=key), "heartbeat_out_of_range"),
        (Heartbeat(run_id=run_id, role="buffer", index=0, pid=31337, counters={"ready_groups": 1e6}),
         "heartbeat_unauthenticated"),
        (EpisodeSample(run_id=run_id, env="signpost", task_id=1, actor_id=0, weight_version=0, max_turns=10**9,
                       reward=nan, success=False, score=0.0, num_turns=10**9, stop_reason="done"),
         "episode_sample_out_of_range"),
        (EpisodeSample(run_id=run_id, env="signpost", task_id=1, actor_id=0, weight_version=0, max_turns=1,
                       reward=nan, success=False, score=0.0, num_turns=1, stop_reason="done"),
         "episode_sample_non_finite_number"),
        (EpisodeSample(run_id=run_id, env="elsewhere", task_id=1, actor_id=0, weight_version=0, max_turns=1,
                       reward=0.0, success=False, score=0.0, num_turns=1, stop_reason="done"),
         "episode_sample_unknown_env"),
        (Registration(run_id=run_id, name="buffer", pid=1, endpoints={"batches": "tcp://evil:1"}),
         "registration_unauthenticated"),
        (Registration(run_id=run_id, name="buffer", pid=1, endpoints={"batches": "ipc:///tmp/x"}, key=key),
         "registration_bad_value"),
        (Registration(run_id=run_id, name="mallory", pid=1, endpoints={"batches": "tcp://h:1"}, key=key),
         "registration_unknown_process"),
    ]
    return [(encode(message), counter) for message, counter in cases]


def oversized_trajectory(run_id: str, trajectory_id: str, tokens: int) -> bytes:
    """A consistent trajectory of ``tokens`` tokens (9 bytes each on the wire)."""
    return encode(trajectory(run_id, trajectory_id, tokens=tokens))


def future_trajectory(run_id: str, trajectory_id: str, version: int) -> bytes:
    """A consistent trajectory from weights (epoch 0, ``version``) that no learner step of the run can make."""
    return encode(trajectory(run_id, trajectory_id, version=version))


# Storms: many messages per socket, each with the counter it must land in (bad:<what the receiver counts a bad
# message as> | rejected:<kind>_<reason> or rejected:<reason> | accepted[:<kind>]).

def inconsistent_trajectory(run_id: str, n: int) -> tuple[bytes, str]:
    """Schema-valid, of this run, and wrong inside; with the buffer's reason for it."""
    t = trajectory(run_id, f"bad{n}-0")
    kind = n % 4
    if kind == 0:
        return encode(msgspec.structs.replace(t, logprobs=t.logprobs[:-4])), "array_lengths"
    if kind == 1:
        return encode(msgspec.structs.replace(t, reward=float("nan"))), "non_finite_number"
    if kind == 2:
        return encode(msgspec.structs.replace(t, token_ids=pack([0] * 11 + [-1], TOKEN_DTYPE))), "token_out_of_vocab"
    return encode(msgspec.structs.replace(t, logprobs=pack([0] * 6 + [float("nan")] * 6, LOGPROB_DTYPE))), "logprobs"


def junk_outcome(n: int, where: str) -> str:
    """What ``junk(rng, run_id, n)`` is counted as, on the coordinator or at the buffer's intake."""
    kind = n % 6
    if where == "report":
        return {4: "bad:ForeignRunError", 5: "bad:UnexpectedMessage"}.get(kind, "bad:ProtocolError")
    return {4: "bad:intake_other_run"}.get(kind, "bad:intake_malformed")


def report_storm(rng: random.Random, run_id: str, key: str, n: int, *, total_steps: int, num_actors: int,
                 real_run: bool) -> list[tuple[bytes, str]]:
    """``n`` messages for the coordinator's report socket, each with the counter it must land in. ``real_run``:
    aimed at a running training, whose state none of them may touch (no heartbeat of one of its processes)."""
    wrong = wrong_reports(run_id, key, total_steps=total_steps, num_actors=num_actors)
    utf8 = list(invalid_utf8_messages(run_id))
    out = []
    for i in range(n):
        kind = i % 4
        if kind == 0:
            out.append((junk(rng, run_id, i // 4), junk_outcome(i // 4, "report")))
        elif kind == 1:
            out.append((utf8[(i // 4) % len(utf8)], "bad:ProtocolError"))
        elif kind == 2:
            data, counter = wrong[(i // 4) % len(wrong)]
            out.append((data, f"rejected:{counter}"))
        elif real_run:  # a heartbeat of an actor the run does not have
            out.append((encode(Heartbeat(run_id=run_id, role="actor", index=num_actors, pid=100, key=key)),
                        "rejected:heartbeat_unknown_process"))
        else:  # the run's own heartbeats go on meanwhile
            out.append((encode(Heartbeat(run_id=run_id, role="actor", index=0, pid=100, counters={"episodes": i},
                                         key=key)), "accepted:heartbeat"))
    return out


def intake_storm(rng: random.Random, run_id: str, n: int, *, context_tokens: int,
                 real_run: bool) -> list[tuple[bytes, str]]:
    """``n`` trajectory messages for the buffer's intake, with the counter each must land in. ``real_run``:
    aimed at a running training, which must not be given a single trajectory to train on."""
    t = trajectory(run_id, "utf8-0")
    utf8 = [invalid_utf8(t, path) for path in string_paths(t)] + [invalid_utf8(t, None)]
    out = []
    for i in range(n):
        kind = i % 6
        if kind == 0:
            out.append((junk(rng, run_id, i // 6), junk_outcome(i // 6, "intake")))
        elif kind == 1:
            out.append((utf8[(i // 6) % len(utf8)], "bad:intake_malformed"))
        elif kind == 2:
            data, reason = inconsistent_trajectory(run_id, i // 6)
            out.append((data, f"rejected:{reason}"))
        elif kind == 3 or (kind == 5 and real_run):  # ten times the context; once 10^6 tokens (9 MB: under 64 MB)
            tokens = 10**6 if i == 3 else 10 * context_tokens
            out.append((oversized_trajectory(run_id, f"long{i}-0", tokens), "rejected:too_long"))
        elif kind == 4:
            out.append((future_trajectory(run_id, f"future{i}-0", 10**6), "rejected:future_version"))
        else:  # a real one now and then: accepted (a group of 2 completes with its partner)
            out.append((encode(trajectory(run_id, f"good{i // 12}-{(i // 6) % 2}")), "accepted"))
    return out


def request_storm(rng: random.Random, run_id: str, key: str, n: int, *, total_steps: int) -> list[tuple[bytes, str]]:
    """Never a valid request: one would take a batch from a real learner, or roll its served batches back."""
    out = []
    for i in range(n):
        kind = i % 4
        if kind == 0:
            out.append((encode(BatchRequest(run_id=OTHER_RUN, request_id=i, learner_version=0, num_groups=1)),
                        "bad:request_other_run"))
        elif kind == 1:  # with the key, but asking for nothing, or for a step past the run
            bad = {"num_groups": 0} if i % 8 == 1 else {"num_groups": 1, "learner_version": total_steps + 1}
            out.append((encode(BatchRequest(run_id=run_id, request_id=i, key=key, **{"learner_version": 0, **bad})),
                        "bad:request_malformed"))
        elif kind == 2:  # well-formed, but not from the learner: it would roll the served batches back
            out.append((encode(BatchRequest(run_id=run_id, request_id=i, learner_version=0, num_groups=1)),
                        "bad:request_unauthenticated"))
        else:
            out.append((junk(rng, run_id, i), "bad:request_other_run" if i % 6 == 4 else "bad:request_malformed"))
    return out
