"""The messages that cross process boundaries. This is the bottom layer: it imports
neither torch nor vllm, and every other part depends on it (never on each other).

Every message carries ``v`` (the schema version) and ``run_id`` (the run it belongs to: a
process rejects and counts messages of another run), and, where it concerns a policy, the
policy (weight) version. Arrays travel as raw little-endian bytes (see ``arrays.py``);
nothing is pickled.

The messages that change the run's state — a learner's report or batch request, a supervision event, a
registration, a held-out evaluation, a heartbeat (a buffer's pauses the rollout), an engine's join of the
weight hub, the coordinator's ``Control`` — also carry ``key``: the run's key (``<output_dir>/run_key``, made
by the launcher, readable only by the run's owner). A receiver that holds the key accepts such a message only
with it, so a process that merely knows the run id (it is in ``config.yaml``) cannot end the run, re-wire its
endpoints, pause its rollout, join its weight hub or forge its fault record.

Weight versions and epochs: the weight version is the learner step that produced the weights
(0: the starting model). A learner restarted from the checkpoint of step c starts a new *weight
epoch* (a counter the learner persists in the run directory) at version c: versions c+1, c+2, ...
of the new epoch are not those of the old one, and turns the old epoch generated above c come
from weights that no longer exist. A turn is identified by (epoch, version).
"""

from __future__ import annotations

import msgspec

SCHEMA_VERSION = 2

# Why an episode did not produce a trainable trajectory. "" means it did.
FAILURE_NONE = ""
FAILURE_ENVIRONMENT = "environment"  # the environment/server failed (crash, timeout, lost session)
FAILURE_ENGINE = "engine"  # generation failed inside the engine
FAILURE_PROMPT_TOO_LONG = "prompt_too_long"  # the task's first prompt alone fills the context: no turn was played
FAILURE_TIMEOUT = "timeout"  # a generation or the episode ran past its wall-clock limit (a straggler)
FAILURE_ACTOR_LOST = "actor_lost"  # the actor died while this episode was in progress
FAILURE_KINDS = (FAILURE_NONE, FAILURE_ENVIRONMENT, FAILURE_ENGINE, FAILURE_PROMPT_TOO_LONG, FAILURE_TIMEOUT,
                 FAILURE_ACTOR_LOST)

# Why an episode ended.
STOP_DONE = "done"  # the environment said done
STOP_MAX_TURNS = "max_turns"  # the coordinator's turn budget ran out
STOP_CONTEXT = "context_limit"  # the next turn would not fit in the context
STOP_FAILURE = "failure"  # see ``failure``


MAX_SAMPLE_TEXT = 4000  # characters of one observation or reply kept for people to read


class EpisodeText(msgspec.Struct, kw_only=True):
    """An episode as a person reads it: the task's first observation, then per turn the model's
    reply, the action taken from it and the environment's answer (each cut to MAX_SAMPLE_TEXT
    characters). A failed episode may have fewer observations than replies."""

    first_observation: str
    replies: list[str]
    actions: list[str]
    observations: list[str]


class Trajectory(msgspec.Struct, tag="trajectory", kw_only=True):
    """One finished episode, token-in/token-out, exactly as the engine saw it.

    Invariants: ``token_ids``, ``loss_mask`` and ``logprobs`` have one entry per token;
    ``loss_mask`` is 1 only on tokens the policy generated; ``logprobs`` holds the
    behaviour policy's log-probability of each generated token (0 elsewhere);
    ``turn_spans[i] = (start, end)`` is the token range of generated turn ``i`` and
    ``turn_versions[i]`` the weight version that produced it (the version when its
    generation started; a turn spanning an update is tagged with the older one).
    ``turn_epochs[i]`` is the weight epoch of that version (see the module docstring).
    ``version_spans`` says exactly which weights generated which tokens: ``(start, end, epoch,
    version)`` per run of tokens of one version, in order, tiling the turn spans (a turn in
    flight during a weight update has two or more); empty from senders that only tag turns.
    ``turn_rewards[i]`` is the environment's reward for the action of turn ``i``.
    ``trajectory_id`` is unique in the run: the buffer acknowledges each id once and
    de-duplicates resends.

    An episode played with a chat template that rewrites history is several *samples*, one
    after another in the arrays: ``sample_starts`` lists where each sample after the first
    begins (empty: one sample). Each sample is a sequence of its own — its first tokens are
    the prompt the engine was given (loss mask 0), no turn span crosses a start, and no sample
    is longer than the context. The trajectory is still one episode: one reward, one member
    of its group, one advantage shared by its samples (``docs/algorithms.md``). An episode that
    went on past the context (``rollout.context.policy``: window, summarize) is several samples the same
    way; ``hidden_turns[k]`` says how many earlier turns the prompt of sample ``k + 1`` does not
    show (0 for a template's rendering, which shows them all; empty: none hidden anywhere).
    ``summary_turns`` lists the turns that are the model's summaries of the episode
    (``rollout.context.policy: summarize``): generated and trained like any turn, reward 0, no
    environment step, not counted against ``max_turns``.
    """

    v: int = SCHEMA_VERSION
    run_id: str
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
    turn_epochs: list[int]
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
    text: EpisodeText | None = None  # on the episodes the actor samples for recording (monitor.record_*)
    version_spans: list[tuple[int, int, int, int]] = []
    sample_starts: list[int] = []
    hidden_turns: list[int] = []
    summary_turns: list[int] = []

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) // 4

    def sample_bounds(self) -> list[tuple[int, int]]:
        """``(start, end)`` of each sample, in order (one sample: the whole trajectory)."""
        starts = [0, *self.sample_starts]
        return list(zip(starts, [*starts[1:], self.num_tokens]))

    @property
    def oldest_version(self) -> int:
        return min(self.turn_versions) if self.turn_versions else 0

    def weight_keys(self) -> list[tuple[int, int]]:
        """Every (epoch, version) that generated a token of this trajectory."""
        if self.version_spans:
            return [(epoch, version) for _, _, epoch, version in self.version_spans]
        return list(zip(self.turn_epochs, self.turn_versions))


MAX_CONTROL_BYTES = 64 * 1024  # the largest Control a subscriber accepts (actors, buffer, learner)


class Control(msgspec.Struct, tag="control", kw_only=True):
    """Coordinator -> everyone (PUB, republished periodically so late joiners catch up)."""

    v: int = SCHEMA_VERSION
    run_id: str
    learner_step: int  # learner steps completed
    max_turns: int  # turn budget for episodes started now
    weight_version: int  # newest weights the learner has announced for broadcast
    weight_epoch: int = 0  # the learner incarnation those weights belong to
    pause_rollout: bool = False  # the buffer is full: finish episodes in flight, start no new groups
    stop: bool = False
    eval_step: int = -1  # the newest learner step whose held-out evaluation actor 0 should run (-1: none; eval.every)
    end_training: bool = False  # held-out success has plateaued (eval.stop_after_plateau): the learner saves and stops
    # The registry (see Registration): every endpoint registered so far, by name, the newest registration of a name
    # winning. A process that connects to a registered endpoint follows it here, and reconnects when it changes.
    endpoints: dict[str, str] = {}
    key: str = ""  # the run's key (see the module docstring): a subscriber takes only the coordinator's Control


# Endpoint names (Registration.endpoints, Control.endpoints).
ENDPOINT_TRAJECTORIES = "trajectories"  # the buffer's ROUTER for actors' trajectories: tcp://HOST:PORT
ENDPOINT_BATCHES = "batches"  # the buffer's ROUTER for the learner's batch requests: tcp://HOST:PORT
ENDPOINT_WEIGHTS = "weights"  # the learner's weight hub (a TCPStore): tcp://HOST:PORT
ENDPOINT_WEIGHTS_EPOCH = "weights_epoch"  # the weight epoch of the hub at ENDPOINT_WEIGHTS (a number, as text)
ENDPOINT_LEARNER_RENDEZVOUS = "learner_rendezvous/"  # + the gang's id: learner rank 0's TCPStore for its process group
# The engine on the learner's GPU (colocated) has started: its pid, as text. The learner waits for it before it
# touches the GPU (vLLM sizes its memory from the device's free memory while it starts).
ENDPOINT_COLOCATED_ENGINE = "colocated_engine"


def learner_rendezvous_name(gang: str) -> str:
    """The endpoint name of one learner incarnation's rendezvous: a restarted learner (a new gang) never
    finds its predecessor's address."""
    return f"{ENDPOINT_LEARNER_RENDEZVOUS}{gang}"


class Registration(msgspec.Struct, tag="registration", kw_only=True):
    """Any process -> coordinator (on its report socket): "my endpoints are here".

    The coordinator is the registry: it is the one address every process is given; the others
    bind wherever they run (a port of 0: any free port of their host) and register what they bound.
    The coordinator publishes every registered endpoint in ``Control.endpoints``, so a process that
    restarts on a new port (or node) re-wires the others by registering again.
    """

    v: int = SCHEMA_VERSION
    run_id: str
    name: str  # the registering process, e.g. "buffer", "learner-0"
    pid: int
    endpoints: dict[str, str]  # ENDPOINT_* -> "tcp://HOST:PORT" (or a plain value such as an epoch)
    key: str = ""  # the run's key (see the module docstring)


class WeightLayout(msgspec.Struct, tag="weight_layout", kw_only=True):
    """Header of one weight broadcast: how to cut the flat buffer into named tensors.

    Sent through the weight process group itself ahead of the payload, so a receiver
    needs no other channel to interpret what follows.
    """

    v: int = SCHEMA_VERSION
    run_id: str
    version: int
    epoch: int  # the learner incarnation these weights belong to (see the module docstring)
    names: list[str]
    dtypes: list[str]  # torch dtype names without the "torch." prefix, e.g. "float32"
    shapes: list[list[int]]
    total_bytes: int


class CudaIpcBuffer(msgspec.Struct, kw_only=True):
    """A CUDA allocation another process on the same GPU can open (torch's CUDA-IPC fields of a
    ``uint8`` tensor's storage, ``torch.multiprocessing.reductions``): plain bytes and integers, so
    the handle travels in msgpack like every other message, never pickled."""

    device: int  # the sender's CUDA device index (colocated processes see the same GPU)
    handle: bytes  # cudaIpcMemHandle of the allocation that holds the storage
    storage_bytes: int
    storage_offset: int  # the storage's byte offset inside that allocation
    ref_counter_handle: bytes  # the producer's shared counter of open handles (keeps the memory alive)
    ref_counter_offset: int
    event_handle: bytes | None  # the producer's event: the consumer waits on it before the first read
    event_sync_required: bool
    tensor_offset: int  # the tensor's element offset inside the storage
    nbytes: int


class IpcWeights(msgspec.Struct, tag="ipc_weights", kw_only=True):
    """Learner -> a colocated engine (same GPU, no NCCL group possible): version ``layout.version``
    will arrive bucket by bucket in ``buffer`` (``learner/weight_ipc.py`` documents the exchange)."""

    v: int = SCHEMA_VERSION
    run_id: str
    layout: WeightLayout
    bucket_bytes: int
    buffer: CudaIpcBuffer


class IpcBucketReady(msgspec.Struct, tag="ipc_bucket_ready", kw_only=True):
    """Learner -> colocated engine: bucket ``index`` of ``version`` is in the shared buffer, written
    and synchronized; it stays there until the engine's :class:`IpcBucketAck` of it."""

    v: int = SCHEMA_VERSION
    run_id: str
    version: int
    index: int


class IpcBucketAck(msgspec.Struct, tag="ipc_bucket_ack", kw_only=True):
    """Colocated engine -> learner: done reading bucket ``index`` of ``version`` (the last bucket's
    ack means the whole version is loaded)."""

    v: int = SCHEMA_VERSION
    run_id: str
    version: int
    index: int


class WeightJoin(msgspec.Struct, tag="weight_join", kw_only=True):
    """Engine worker -> learner, through the weight store (``protocol/weights.py``): "admit me"."""

    v: int = SCHEMA_VERSION
    run_id: str
    actor: int  # the actor index whose engine this is (a newer join of the same actor replaces the older)
    pid: int
    worker: int = 0  # the engine worker (tensor-parallel rank): each worker of an engine is its own member
    # A colocated engine (on the learner's GPU) takes its versions through CUDA IPC rather than a two-rank
    # group: the ZeroMQ address (tcp://127.0.0.1:PORT) where it waits for the hub (learner/weight_ipc.py).
    ipc_address: str = ""
    key: str = ""  # the run's key (see the module docstring): a member receives every version and may evict another


class BatchRequest(msgspec.Struct, tag="batch_request", kw_only=True):
    """Learner rank 0 -> buffer: "send me ``num_groups`` groups for step ``learner_version + 1``".

    A request for a step the buffer already served a batch for means that batch never trained
    (its reply was lost, or the learner restarted from an earlier checkpoint): the buffer takes
    its groups back. ``committed_step`` is the learner's newest checkpoint: batches of steps up to
    it are trained for good. ``lineage`` lists (weight epoch, the step it resumed from), oldest
    first; its last entry is the learner's current epoch (see the module docstring).
    """

    v: int = SCHEMA_VERSION
    run_id: str
    request_id: int
    learner_version: int
    num_groups: int
    lineage: list[tuple[int, int]] = msgspec.field(default_factory=lambda: [(0, 0)])
    committed_step: int = 0
    key: str = ""  # the run's key (see the module docstring): a request rolls batches back and commits them


class Batch(msgspec.Struct, tag="batch", kw_only=True):
    """Buffer -> learner: whole groups, oldest first, plus the buffer's counters."""

    v: int = SCHEMA_VERSION
    run_id: str
    request_id: int
    groups: list[list[Trajectory]]
    buffer_stats: dict[str, float] = {}


class LearnerReport(msgspec.Struct, tag="learner_report", kw_only=True):
    """Learner rank 0 -> coordinator after each optimizer step."""

    v: int = SCHEMA_VERSION
    run_id: str
    step: int
    weight_version: int
    weight_epoch: int = 0
    metrics: dict[str, float] = {}
    checkpoint: str = ""
    startup: bool = False  # the learner (re)started at ``step``: announce its epoch, no step was made
    final: bool = False
    key: str = ""  # the run's key (see the module docstring)


class Heartbeat(msgspec.Struct, tag="heartbeat", kw_only=True):
    """Any process -> coordinator, about once a second: liveness plus cumulative counters."""

    v: int = SCHEMA_VERSION
    run_id: str
    role: str  # "actor" | "buffer" | "learner"
    index: int
    pid: int
    counters: dict[str, float] = {}
    key: str = ""  # the run's key (see the module docstring): a buffer's gauges pause the rollout


# What happened to a process of the run (ProcessEvent.event).
EVENT_DIED = "died"  # it exited before the run was over (exit_code says how)
EVENT_RESTARTED = "restarted"  # a replacement was started (after delay_s)
EVENT_GAVE_UP = "gave_up"  # too many restarts in the window, or restarts are off: the run stops
EVENT_RECOVERED = "recovered"  # the replacement works again (the coordinator sees it itself, but for servers)


class ProcessEvent(msgspec.Struct, tag="process_event", kw_only=True):
    """Launcher -> coordinator: a supervision decision about one process (counted under ``faults/``)."""

    v: int = SCHEMA_VERSION
    run_id: str
    name: str  # "actor-1", "buffer", "learner-0", "env-babyai"
    role: str
    event: str  # EVENT_*
    exit_code: int | None = None
    restarts: int = 0  # restarts of this process within the supervision window, this one included
    delay_s: float = 0.0  # the back-off before this restart
    at: float = 0.0  # wall-clock time of the event (time.time())
    key: str = ""  # the run's key (see the module docstring)


class EpisodeSample(msgspec.Struct, tag="episode_sample", kw_only=True):
    """Actor -> coordinator, now and then: one episode as text, so a person can see what the agent did.

    ``transcript`` alternates ("observation", text) and ("reply", text), starting with the task's
    first observation; texts are cut to ``MAX_SAMPLE_TEXT`` characters each.
    """

    v: int = SCHEMA_VERSION
    run_id: str
    env: str
    task_id: int
    actor_id: int
    weight_version: int
    max_turns: int
    reward: float
    success: bool
    score: float
    num_turns: int
    stop_reason: str
    failure: str = FAILURE_NONE
    transcript: list[tuple[str, str]] = []


class HeldOutEval(msgspec.Struct, tag="held_out_eval", kw_only=True):
    """Actor 0 -> coordinator: a held-out evaluation during training (``eval.every``), per environment.

    Played on test-split tasks with the actor's weights at the time; those episodes never go to the
    buffer. ``weight_versions`` is the (oldest, newest) version that generated a turn of them: the
    engine may take newer weights while the evaluation runs, as it does during any episode.
    """

    v: int = SCHEMA_VERSION
    run_id: str
    learner_step: int  # the step the evaluation was asked for (Control.eval_step)
    weight_versions: tuple[int, int]
    results: dict[str, dict[str, float]]  # env -> success_rate, episodes_valid, infra_failures, mean_reward, ...
    wall_s: float
    key: str = ""  # the run's key (see the module docstring)


# What the buffer says about each trajectory it received (TrajectoryAck.statuses).
ACK_ACCEPTED = "accepted"  # durable in the buffer's log: the actor may forget it
ACK_DUPLICATE = "duplicate"  # already accepted earlier (a resend): the actor may forget it
ACK_REJECTED = "rejected"  # invalid (``reason`` says why); resending cannot help: the actor forgets it


class TrajectoryAck(msgspec.Struct, tag="trajectory_ack", kw_only=True):
    """Buffer -> actor: the fate of the trajectories of one message, once it is durable."""

    v: int = SCHEMA_VERSION
    run_id: str
    trajectory_ids: list[str]
    statuses: list[str]
    reasons: list[str] = []  # per trajectory, "" unless rejected


Message = (Trajectory | Control | WeightLayout | WeightJoin | BatchRequest | Batch | LearnerReport | Heartbeat
           | EpisodeSample | TrajectoryAck | ProcessEvent | HeldOutEval | Registration | IpcWeights | IpcBucketReady
           | IpcBucketAck)
