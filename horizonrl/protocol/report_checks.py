"""What the schema cannot say about the messages on the coordinator's report socket (bottom layer).

The codec guarantees types; a well-typed message can still name a process the run does not have,
an environment it does not play, a step beyond its last one or a NaN reward, and any of those would
crash the coordinator (an index it looks up, a key it reads) or poison what it writes. The
coordinator runs :func:`report_problem` on every message it reads and counts what fails under
``coordinator/rejected_<kind>_<reason>``; the checks that need its state (a learner report going back
in steps) take that state as arguments.

Who may send what is checked first, by the run's key (protocol/messages.py): :data:`KEYED_KINDS`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from horizonrl.protocol.messages import (ENDPOINT_BATCHES, ENDPOINT_COLOCATED_ENGINE, ENDPOINT_LEARNER_RENDEZVOUS,
                                         ENDPOINT_TRAJECTORIES, ENDPOINT_WEIGHTS, ENDPOINT_WEIGHTS_EPOCH, EVENT_DIED,
                                         EVENT_GAVE_UP, EVENT_RECOVERED, EVENT_RESTARTED, FAILURE_KINDS,
                                         MAX_SAMPLE_TEXT, STOP_CONTEXT, STOP_DONE, STOP_FAILURE, STOP_MAX_TURNS,
                                         EpisodeSample, Heartbeat, HeldOutEval, LearnerReport, ProcessEvent,
                                         Registration)
from horizonrl.protocol.names import MAX_NAME_CHARS, is_label, is_name, shown

# The kinds that change the run's state: accepted only with the run's key.
KEYED_KINDS = (LearnerReport, ProcessEvent, Registration, HeldOutEval, Heartbeat)

MAX_COUNTERS = 1024  # counters in a heartbeat, metrics in a report, endpoints in a registration
MAX_PID = 2**22  # Linux's pid_max ceiling
MAX_EXIT_CODE = 255
HEARTBEAT_ROLES = ("actor", "buffer", "learner")
PROCESS_EVENTS = (EVENT_DIED, EVENT_RESTARTED, EVENT_GAVE_UP, EVENT_RECOVERED)
STOP_REASONS = (STOP_DONE, STOP_MAX_TURNS, STOP_CONTEXT, STOP_FAILURE)
TRANSCRIPT_ROLES = ("observation", "reply")
HELD_OUT_REQUIRED = ("success_rate", "episodes_valid")
ENDPOINT_NAMES = (ENDPOINT_TRAJECTORIES, ENDPOINT_BATCHES, ENDPOINT_WEIGHTS, ENDPOINT_WEIGHTS_EPOCH,
                  ENDPOINT_COLOCATED_ENGINE)
NUMBER_ENDPOINTS = (ENDPOINT_WEIGHTS_EPOCH, ENDPOINT_COLOCATED_ENGINE)  # a number as text, not an address

# Rejection reasons (counted as rejected_<kind>_<reason>).
REJECT_UNAUTHENTICATED = "unauthenticated"
REJECT_PROCESS = "unknown_process"
REJECT_ENV = "unknown_env"
REJECT_RANGE = "out_of_range"
REJECT_NUMBER = "non_finite_number"
REJECT_NAMES = "bad_names"
REJECT_BACKWARDS = "run_state_backwards"
REJECT_VALUE = "bad_value"
REJECT_NOT_REGISTERED = "not_registered"


@dataclass(frozen=True)
class RunShape:
    """What the run's config says about who may report what."""

    num_actors: int
    learner_ranks: int
    env_names: frozenset[str]
    total_steps: int
    max_turns: int  # the largest turn budget of any episode of the run (training schedule, held-out evaluation)
    env_servers: int  # processes env-<i> the launcher may run (one per configured environment)


Problem = tuple[str, str]  # (reason, detail)


def report_problem(message, shape: RunShape) -> Problem | None:
    """``None`` when ``message`` (a report-socket kind) is consistent with the run, else (reason, detail).
    A learner report's order against the coordinator's state is :func:`learner_report_order_problem`'s."""
    check = _CHECKS.get(type(message))
    return check(message, shape) if check is not None else None


def process_name_problem(name: str, role: str, shape: RunShape) -> Problem | None:
    """The launcher's names: coordinator, buffer, tensorboard, learner (the whole gang), learner-<rank>,
    actor-<index>, env-<index>; ``role`` is the part before the dash."""
    prefix, dash, number = name.partition("-")
    if role != prefix:
        return REJECT_PROCESS, f"{name[:MAX_NAME_CHARS]!r} is not of role {role[:MAX_NAME_CHARS]!r}"
    limits = {"actor": shape.num_actors, "learner": shape.learner_ranks, "env": shape.env_servers}
    if not dash:
        return None if name in ("coordinator", "buffer", "tensorboard", "learner") else (
            REJECT_PROCESS, f"no process {name[:MAX_NAME_CHARS]!r} in this run")
    index = _small_number(number)
    if prefix not in limits or index is None or index >= limits[prefix] or number != str(index):
        return REJECT_PROCESS, f"no process {name[:MAX_NAME_CHARS]!r} in this run"
    return None


def _heartbeat_problem(beat: Heartbeat, shape: RunShape) -> Problem | None:
    indices = {"actor": shape.num_actors, "buffer": 1, "learner": 1}
    if beat.role not in indices or not 0 <= beat.index < indices[beat.role]:
        return REJECT_PROCESS, f"no process {beat.role}-{beat.index} in this run"
    if not 0 < beat.pid < MAX_PID:
        return REJECT_RANGE, f"pid {beat.pid}"
    return _numbers_problem(beat.counters, "counter")


def _process_event_problem(event: ProcessEvent, shape: RunShape) -> Problem | None:
    if event.event not in PROCESS_EVENTS:
        return REJECT_VALUE, f"event {event.event!r}"
    problem = process_name_problem(event.name, event.role, shape)
    if problem is not None:
        return problem
    if event.exit_code is not None and not -MAX_EXIT_CODE <= event.exit_code <= MAX_EXIT_CODE:
        return REJECT_RANGE, f"exit code {event.exit_code}"
    if not all(math.isfinite(x) for x in (event.delay_s, event.at)):
        return REJECT_NUMBER, "delay_s or at is NaN or infinite"
    if event.restarts < 0 or event.delay_s < 0 or event.at < 0:
        return REJECT_RANGE, f"restarts {event.restarts}, delay_s {event.delay_s}, at {event.at}"
    return None


def _learner_report_problem(report: LearnerReport, shape: RunShape) -> Problem | None:
    if not 0 <= report.step <= shape.total_steps or not 0 <= report.weight_version <= report.step:
        return REJECT_RANGE, (f"step {report.step} (of {shape.total_steps}), weight version "
                              f"{report.weight_version}")
    if report.weight_epoch < 0 or len(report.checkpoint) > 4096:
        return REJECT_RANGE, f"weight epoch {report.weight_epoch}, checkpoint of {len(report.checkpoint)} characters"
    # A NaN loss is the learner's own measurement, worth seeing: only the names and their number are checked.
    return _names_problem(report.metrics, "metric")


def learner_report_order_problem(report: LearnerReport, step: int, epoch: int) -> Problem | None:
    """A report must not take the run back: within the learner's weight epoch steps only go forward (the
    closing report repeats the last); only a restarted learner (``startup``, a newer epoch) may go back, to
    its checkpoint's step; a report of an older epoch is a late word of a learner that is gone."""
    if report.weight_epoch < epoch:
        return REJECT_BACKWARDS, f"weight epoch {report.weight_epoch} after epoch {epoch}"
    if report.step < step and not (report.startup and report.weight_epoch > epoch):
        return REJECT_BACKWARDS, f"step {report.step} after step {step} in weight epoch {epoch}"
    return None


# Roles whose process registers (Registration, under the role's name) before its first heartbeat.
REGISTERED_BEFORE_BEATING = ("buffer",)


def heartbeat_incarnation_problem(beat: Heartbeat, registered_pids: Mapping[str, int]) -> Problem | None:
    """A heartbeat of a role that registers before it beats must come from the pid that registered last: any
    other is a stale incarnation or someone else's, and its gauges would be taken for the run's state (a
    buffer's ``ready_groups`` pause the rollout)."""
    registered = registered_pids.get(beat.role) if beat.role in REGISTERED_BEFORE_BEATING else None
    if registered is not None and registered != beat.pid:
        return REJECT_NOT_REGISTERED, f"pid {beat.pid}; the {beat.role} that registered last is pid {registered}"
    return None


def _held_out_problem(result: HeldOutEval, shape: RunShape) -> Problem | None:
    if not result.results:
        return REJECT_VALUE, "no environment's results"
    unknown = sorted(set(result.results) - shape.env_names)
    if unknown:
        return REJECT_ENV, f"environments {unknown[:3]} are not this run's"
    oldest, newest = result.weight_versions
    if not 0 <= result.learner_step <= shape.total_steps or not -1 <= oldest <= newest <= shape.total_steps:
        return REJECT_RANGE, f"learner step {result.learner_step}, weight versions {result.weight_versions}"
    if not math.isfinite(result.wall_s) or result.wall_s < 0:
        return REJECT_NUMBER, f"wall_s {result.wall_s}"
    for env, metrics in result.results.items():
        problem = _numbers_problem(metrics, "metric")
        if problem is not None:
            return problem
        if not all(is_label(key) for key in metrics):  # charted as eval/<env>/<key>: a part of a name
            return REJECT_NAMES, f"{env}: a metric name over a label's length or charset (protocol/names.py)"
        missing = [key for key in HELD_OUT_REQUIRED if key not in metrics]
        if missing:
            return REJECT_VALUE, f"{env}: no {missing}"
        if not 0 <= metrics["success_rate"] <= 1 or metrics["episodes_valid"] < 0:
            return REJECT_RANGE, f"{env}: success rate {metrics['success_rate']}, {metrics['episodes_valid']} valid"
    return None


def _episode_sample_problem(sample: EpisodeSample, shape: RunShape) -> Problem | None:
    if sample.env not in shape.env_names:
        return REJECT_ENV, f"environment {sample.env[:MAX_NAME_CHARS]!r} is not this run's"
    if not 0 <= sample.actor_id < shape.num_actors:
        return REJECT_PROCESS, f"no actor {sample.actor_id} in this run"
    if (sample.task_id < 0 or not 0 <= sample.weight_version <= shape.total_steps
            or not 0 <= sample.num_turns <= sample.max_turns <= shape.max_turns):
        return REJECT_RANGE, (f"task {sample.task_id}, weight version {sample.weight_version}, {sample.num_turns} "
                              f"of {sample.max_turns} turns (the run's budget is at most {shape.max_turns})")
    if not (math.isfinite(sample.reward) and math.isfinite(sample.score)):
        return REJECT_NUMBER, "reward or score is NaN or infinite"
    if sample.stop_reason not in STOP_REASONS or sample.failure not in FAILURE_KINDS:
        return REJECT_VALUE, f"stop reason {sample.stop_reason[:64]!r}, failure {sample.failure[:64]!r}"
    if len(sample.transcript) > 2 * sample.num_turns + 2:
        return REJECT_RANGE, f"{len(sample.transcript)} transcript entries for {sample.num_turns} turns"
    if any(role not in TRANSCRIPT_ROLES or len(text) > MAX_SAMPLE_TEXT for role, text in sample.transcript):
        return REJECT_VALUE, f"a transcript entry is not an observation or reply of <= {MAX_SAMPLE_TEXT} characters"
    return None


def _registration_problem(registration: Registration, shape: RunShape) -> Problem | None:
    problem = process_name_problem(registration.name, registration.name.partition("-")[0], shape)
    if problem is not None:
        return problem
    if not 0 < registration.pid < MAX_PID or not 0 < len(registration.endpoints) <= MAX_COUNTERS:
        return REJECT_RANGE, f"pid {registration.pid}, {len(registration.endpoints)} endpoints"
    for name, value in registration.endpoints.items():
        if name not in ENDPOINT_NAMES and not (name.startswith(ENDPOINT_LEARNER_RENDEZVOUS) and is_name(name)):
            return REJECT_NAMES, f"endpoint name {name[:MAX_NAME_CHARS]!r}"
        if not (_small_number(value) is not None if name in NUMBER_ENDPOINTS else _is_tcp_endpoint(value)):
            return REJECT_VALUE, f"{name}: {value[:MAX_NAME_CHARS]!r}"
    return None


def _is_tcp_endpoint(value: str) -> bool:
    """``tcp://HOST:PORT`` with a port that exists and a host of sane characters."""
    host, sep, port = value.removeprefix("tcp://").rpartition(":")
    number = _small_number(port)
    return (value.startswith("tcp://") and bool(sep) and number is not None and 0 < number < 65536
            and 0 < len(host) <= 255 and all(c.isascii() and (c.isalnum() or c in ".-_[]:") for c in host))


def _small_number(text: str) -> int | None:
    """A non-negative decimal of at most 9 ASCII digits (int() of a long or non-ASCII digit string raises)."""
    return int(text) if 0 < len(text) <= 9 and text.isascii() and text.isdigit() else None


def _names_problem(values: dict, what: str) -> Problem | None:
    if len(values) > MAX_COUNTERS:
        return REJECT_RANGE, f"{len(values)} {what}s"
    bad = next((name for name in values if not is_name(name)), None)
    if bad is not None:
        return REJECT_NAMES, (f"{what} name {shown(bad)}: 1..{MAX_NAME_CHARS} characters of [A-Za-z0-9._-/:+=@] "
                              "(protocol/names.py)")
    return None


def _numbers_problem(values: dict, what: str) -> Problem | None:
    problem = _names_problem(values, what)
    if problem is None and not _all_finite(values.values()):
        return REJECT_NUMBER, f"a {what} is NaN or infinite"
    return problem


def _all_finite(numbers: Iterable[float]) -> bool:
    return all(math.isfinite(x) for x in numbers)


_CHECKS = {
    Heartbeat: _heartbeat_problem,
    ProcessEvent: _process_event_problem,
    LearnerReport: _learner_report_problem,
    HeldOutEval: _held_out_problem,
    EpisodeSample: _episode_sample_problem,
    Registration: _registration_problem,
}
