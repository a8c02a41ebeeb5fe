"""The messages that cross process boundaries. This is the bottom layer: it imports
neither torch nor vllm, and every other part depends on it (never on each other).

Every message carries ``v`` (the schema version) and, where it concerns a policy,
the policy (weight) version. Arrays travel as raw little-endian bytes (see
``arrays.py``); nothing is pickled.
"""

from __future__ import annotations

import msgspec

SCHEMA_VERSION = 1

# Why an episode did not produce a trainable trajectory. "" means it did.
FAILURE_NONE = ""
FAILURE_ENVIRONMENT = "environment"  # the environment/server failed (crash, timeout, lost session)
FAILURE_ENGINE = "engine"  # generation failed inside the engine
FAILURE_KINDS = (FAILURE_NONE, FAILURE_ENVIRONMENT, FAILURE_ENGINE)

# Why an episode ended.
STOP_DONE = "done"  # the environment said done
STOP_MAX_TURNS = "max_turns"  # the coordinator's turn budget ran out
STOP_CONTEXT = "context_limit"  # the next turn would not fit in the context
STOP_FAILURE = "failure"  # see ``failure``


class Trajectory(msgspec.Struct, tag="trajectory", kw_only=True):
    """One finished episode, token-in/token-out, exactly as the engine saw it.

    Invariants: ``token_ids``, ``loss_mask`` and ``logprobs`` have one entry per token;
    ``loss_mask`` is 1 only on tokens the policy generated; ``logprobs`` holds the
    behaviour policy's log-probability of each generated token (0 elsewhere);
    ``turn_spans[i] = (start, end)`` is the token range of generated turn ``i`` and
    ``turn_versions[i]`` the weight version that produced it (the version when its
    generation started; a turn spanning an update is tagged with the older one).
    ``turn_rewards[i]`` is the environment's reward for the action of turn ``i``.
    """

    v: int = SCHEMA_VERSION
    trajectory_id: str
    group_id: str
    group_size: int
    env: str
    task_id: int
    actor_id: int
    token_ids: bytes  # int32
    loss_mask: bytes  # uint8
    logprobs: bytes  # float32
    prompt_length: int
    turn_spans: list[tuple[int, int]]
    turn_versions: list[int]
    turn_rewards: list[float]
    reward: float  # episode return: the sum of turn rewards
    success: bool
    score: float
    num_turns: int
    max_turns: int  # the turn budget the episode ran under
    stop_reason: str
    failure: str = FAILURE_NONE
    failure_message: str = ""
    category: str = ""
    timings: dict[str, float] = {}

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) // 4

    @property
    def oldest_version(self) -> int:
        return min(self.turn_versions) if self.turn_versions else 0


class Control(msgspec.Struct, tag="control", kw_only=True):
    """Coordinator -> everyone (PUB, republished periodically so late joiners catch up)."""

    v: int = SCHEMA_VERSION
    run_id: str
    learner_step: int  # learner steps completed
    max_turns: int  # turn budget for episodes started now
    weight_version: int  # newest weights the learner has announced for broadcast
    pause_rollout: bool = False  # the buffer is full: finish episodes in flight, start no new groups
    stop: bool = False


class WeightLayout(msgspec.Struct, tag="weight_layout", kw_only=True):
    """Header of one weight broadcast: how to cut the flat buffer into named tensors.

    Sent through the weight process group itself ahead of the payload, so a receiver
    needs no other channel to interpret what follows.
    """

    v: int = SCHEMA_VERSION
    version: int
    names: list[str]
    dtypes: list[str]  # torch dtype names without the "torch." prefix, e.g. "float32"
    shapes: list[list[int]]
    total_bytes: int


class BatchRequest(msgspec.Struct, tag="batch_request", kw_only=True):
    """Learner rank 0 -> buffer: "send me ``num_groups`` groups; my weights are ``learner_version``"."""

    v: int = SCHEMA_VERSION
    request_id: int
    learner_version: int
    num_groups: int


class Batch(msgspec.Struct, tag="batch", kw_only=True):
    """Buffer -> learner: whole groups, oldest first, plus the buffer's counters."""

    v: int = SCHEMA_VERSION
    request_id: int
    groups: list[list[Trajectory]]
    buffer_stats: dict[str, float] = {}


class LearnerReport(msgspec.Struct, tag="learner_report", kw_only=True):
    """Learner rank 0 -> coordinator after each optimizer step."""

    v: int = SCHEMA_VERSION
    step: int
    weight_version: int
    metrics: dict[str, float] = {}
    checkpoint: str = ""
    final: bool = False


class Heartbeat(msgspec.Struct, tag="heartbeat", kw_only=True):
    """Any process -> coordinator, about once a second: liveness plus cumulative counters."""

    v: int = SCHEMA_VERSION
    role: str  # "actor" | "buffer" | "learner"
    index: int
    pid: int
    counters: dict[str, float] = {}


Message = Trajectory | Control | WeightLayout | BatchRequest | Batch | LearnerReport | Heartbeat
