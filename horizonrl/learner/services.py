"""The learner's services, which the loop (loop.py) calls and the algorithm (algorithm.py) never sees: the ranks'
bounded collectives, the batches from the buffer, the reports to the coordinator, the weights to the engines,
the checkpoints. Rank 0 gets the real ones, the other ranks the null ones that only take part in the collectives
(main.py chooses)."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from horizonrl.core.adapter_format import CHECKPOINT_ADAPTER_DIR
from horizonrl.core.config import TrainConfig
from horizonrl.core.disk import Backoff
from horizonrl.core.run_dirs import DataCursor, RunDir, TrainState
from horizonrl.core.run_events import EventLog, NullEventLog, RunEvent
from horizonrl.learner.algorithm import Trainables
from horizonrl.learner.checkpoint import CheckpointWriteError, checkpoint_dir, disk_refusal, save_train_state
from horizonrl.learner.loop import Publication
from horizonrl.learner.lora import LoraSettings, adapter_to_send, merged_state_dict, save_adapter
from horizonrl.learner.model import gather_full_state_dict, save_hf_checkpoint, weights_to_send
from horizonrl.protocol import LearnerReport
from horizonrl.protocol.counters import LearnerCounters
from horizonrl.protocol.registry import LEARNER_GANG_ENV
from horizonrl.protocol.weights import ALIGN_BYTES

log = logging.getLogger("horizonrl.learner")

STOP_SEND_GRACE_S = 5.0  # at a stop, how long a weight broadcast in progress may still take
CHECKPOINT_RETRY_LIMIT_S = 600.0  # a disk refusing a checkpoint this long is not coming back: the learner stops


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int  # 0: rendezvous through the coordinator (rank 0 registers its store; see _init_process_group)
    gang: str = "0"  # this learner incarnation's id (the launcher's $HORIZONRL_LEARNER_GANG), for that rendezvous

    @classmethod
    def from_environ(cls) -> "RankInfo":
        env = os.environ
        return cls(
            rank=int(env.get("RANK", "0")),
            world_size=int(env.get("WORLD_SIZE", "1")),
            local_rank=int(env.get("LOCAL_RANK", "0")),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT") or 0),
            gang=env.get(LEARNER_GANG_ENV, "0"),
        )


@dataclass
class Resources:
    """Everything that must be released on the way out, whatever way that is."""

    context: Any = None  # zmq.Context (rank 0)
    security: Any = None
    batches: Any = None
    reports: Any = None
    heartbeat: Any = None
    end_training_watch: Any = None
    weight_hub: Any = None
    weight_hub_abandoned: bool = False  # a send thread may still be blocked in it: do not touch it
    step_watchdog: Any = None  # bounds a step's time, and a stop's wait for it (step_watchdog.py)
    events: EventLog = NullEventLog()  # rank 0 writes the run's events (core/run_events.py)

    def close(self) -> None:
        if self.step_watchdog is not None:
            self.step_watchdog.close()
        for thread in (self.heartbeat, self.end_training_watch):
            if thread is not None:
                thread.stop()
        for channel in (self.batches, self.reports):
            if channel is not None:
                channel.close()
        if self.weight_hub is not None and not self.weight_hub_abandoned:
            self.weight_hub.close()
        if self.security is not None:
            self.security.stop()
        if dist.is_initialized():
            dist.destroy_process_group()
        if self.context is not None:
            self.context.term()


class DistributedRanks:
    """The learner's process group: every collective bounded by ``timeout_s``."""

    def __init__(self, rank: int, timeout_s: float) -> None:
        self.rank, self.timeout_s = rank, timeout_s

    def share(self, payload: bytes | None) -> bytes | None:
        from horizonrl.learner.channels import share_bytes

        return share_bytes(payload, self.rank)

    def agree_to_stop(self, *reasons: threading.Event) -> bool:
        return _all_agree_to_stop(reasons, self.timeout_s)

    def from_rank_zero(self, value: int, what: str) -> int:
        return from_rank_zero(value, self.timeout_s, what)


class BufferBatches:
    """Rank 0's batches: ``learner.groups_per_step`` groups from the buffer (channels.BatchClient)."""

    def __init__(self, client, learner_config) -> None:
        self.client, self.lc = client, learner_config

    def request(self, step: int, *, should_stop, lineage, committed_step: int) -> bytes | None:
        lc = self.lc
        return self.client.request(step, lc.groups_per_step, lc.batch_timeout_s, should_stop, lineage=lineage,
                                   committed_step=committed_step, resend_s=lc.batch_resend_s)


class NoBatches:
    """The other ranks ask nobody: they get rank 0's bytes."""

    def request(self, step: int, **_) -> None:
        return None


class RunReporter:
    """Rank 0: reports to the coordinator, a log line per step, the run's events."""

    def __init__(self, sender, events: EventLog) -> None:
        self.sender, self.events = sender, events

    def step_trained(self, step: int) -> None:
        self.events.emit(RunEvent.STEP_TRAINED, step=step)

    def report(self, report: LearnerReport) -> None:
        self.sender.send(report)

    def step_done(self, step: int, metrics: dict[str, float], times: dict[str, float], sent: str) -> None:
        self.events.emit(RunEvent.STEP_DONE, step=step, weights_sent="not sent" not in sent)
        log.info("step %d: loss %.4f reward %.3f success %.3f staleness %.2f | wait %.2fs step %.2fs %s", step,
                 metrics["loss/policy"], metrics.get("batch/reward_mean", 0.0), metrics.get("batch/success_mean", 0.0),
                 metrics.get("batch/staleness_mean", 0.0), times["batch_wait"], times["step"], sent)

    def abandoned(self, version: int) -> None:
        self.events.emit(RunEvent.BROADCAST_ABANDONED, version=version)
        log.warning("stopping: abandoned the broadcast of version %d (the engines may be gone); the checkpoint "
                    "comes next", version)

    def done(self, step: int, stopped_early: bool, checkpoint: str, weights: dict[str, float]) -> None:
        self.events.emit(RunEvent.LEARNER_DONE, step=step, stopped_early=stopped_early, checkpoint=checkpoint,
                         weights_dropped=weights.get("weights/dropped", 0.0))
        log.info("learner done after %d steps%s; checkpoint %s", step, " (stopped early)" if stopped_early else "",
                 checkpoint or "-")


class NullReporter:
    def step_trained(self, step: int) -> None: ...

    def report(self, report: LearnerReport) -> None: ...

    def step_done(self, step: int, metrics: dict[str, float], times: dict[str, float], sent: str) -> None: ...

    def abandoned(self, version: int) -> None: ...

    def done(self, step: int, stopped_early: bool, checkpoint: str, weights: dict[str, float]) -> None: ...


class HubPublisher:
    """Rank 0: the weights gathered bucket by bucket and sent to every engine in the hub. After a stop, a send
    the engines do not take within STOP_SEND_GRACE_S is abandoned, and nothing more is sent."""

    def __init__(self, model, res: Resources, epoch: int, bucket_mb: float, dtype: torch.dtype | None,
                 stop: threading.Event, lora: LoraSettings | None = None) -> None:
        self.model, self.res, self.epoch = model, res, epoch
        self.bucket_mb, self.dtype, self.stop, self.lora = bucket_mb, dtype, stop, lora

    @property
    def usable(self) -> bool:
        return not self.res.weight_hub_abandoned

    def publish(self, version: int, *, background: bool) -> Publication:
        stats = publish_weights(self.model, self.res.weight_hub, version=version, epoch=self.epoch,
                                bucket_mb=self.bucket_mb, dtype=self.dtype, stop=self.stop, background=background,
                                lora=self.lora)
        if stats is None:
            return Publication(abandoned=self._abandon(version))
        return Publication(stats=stats)

    def finish_sending(self, in_flight: int) -> int | None:
        hub = self.res.weight_hub
        if hub.wait_for_send(_abandon_after(self.stop, STOP_SEND_GRACE_S)) and hub.abandoned is None:
            return None
        return self._abandon(in_flight)

    def _abandon(self, version: int) -> int:
        """The version abandoned (the hub's own record when it has one); the hub is not touched again."""
        self.res.weight_hub_abandoned = True
        hub = self.res.weight_hub
        return hub.abandoned[1] if hub.abandoned is not None else version

    def metrics(self) -> dict[str, float]:
        hub = self.res.weight_hub
        return {**{f"weights/{k}": float(v) for k, v in hub.counters.items()},
                "weights/members": float(len(hub.members))}


class GatherOnly:
    """The other ranks: their part of each gather (a collective); rank 0 sends."""

    usable = True

    def __init__(self, model, bucket_mb: float, dtype: torch.dtype | None, lora: LoraSettings | None = None) -> None:
        self.model, self.bucket_mb, self.dtype, self.lora = model, bucket_mb, dtype, lora

    def publish(self, version: int, *, background: bool) -> Publication:
        publish_weights(self.model, None, version=version, epoch=0, bucket_mb=self.bucket_mb, dtype=self.dtype,
                        stop=threading.Event(), lora=self.lora)
        return Publication()

    def finish_sending(self, in_flight: int) -> int | None:
        return None

    def metrics(self) -> dict[str, float]:
        return {}


class TrainStateCheckpointer:
    """Collective: the Hugging Face files and the full training state of a step (``_save``).

    A disk that refuses the checkpoint (full, read-only: ``core/disk.py``) is the machine's fault, not the
    learner's: every rank waits and writes it again, together (``Backoff``: up to ``CHECKPOINT_RETRY_LIMIT_S``),
    each refusal counted (``checkpoint_write_retries``) and the outage's start and end written as events — no
    restart is spent on it. Training waits meanwhile: a step past an unwritten checkpoint could not be resumed."""

    def __init__(self, config: TrainConfig, tr: Trainables, res: Resources, ranks: RankInfo,
                 counters: LearnerCounters | None = None, timeout_s: float = 600.0) -> None:
        self.config, self.tr, self.res, self.ranks = config, tr, res, ranks
        self.counters = counters if counters is not None else LearnerCounters()
        self.timeout_s = timeout_s

    def save(self, step: int, lineage: list[tuple[int, int]], consumed: list[dict], since: int) -> str:
        start = time.perf_counter()
        state_dict = gather_full_state_dict(self.tr.model)
        out = checkpoint_dir(self.config.output_dir, step)
        backoff = Backoff(limit_s=CHECKPOINT_RETRY_LIMIT_S)
        while True:
            try:
                _save(self.config, self.tr, state_dict, step, self.res, self.ranks, lineage, consumed, since,
                      lambda error: _first_refusal(error, self.timeout_s))
                break
            except CheckpointWriteError as exc:  # raised on every rank alike: all retry, or all stop
                again, wait_s = backoff.failed()
                self._refused(out, str(exc), backoff.retries == 1)
                if not again:
                    raise CheckpointWriteError(f"checkpoint {out}: the disk still refuses it after "
                                               f"{CHECKPOINT_RETRY_LIMIT_S:.0f} s: {exc}") from exc
                self.counters.checkpoint_write_retries += 1
                time.sleep(wait_s)
        outage_s = backoff.succeeded()
        if outage_s is not None:
            log.warning("checkpoint %s written after the disk refused it for %.1f s (%d retries)", out, outage_s,
                        backoff.retries)
            self.res.events.emit(RunEvent.WRITE_RECOVERED, path=str(out), retries=backoff.retries,
                                 outage_s=round(outage_s, 3))
        log.info("saved %s in %.1f s", out, time.perf_counter() - start)
        return str(out)

    def _refused(self, out: Path, error: str, first: bool) -> None:
        if first:
            log.warning("checkpoint %s: the disk refuses it (%s); training waits and every rank writes it again "
                        "(for up to %.0f s)", out, error, CHECKPOINT_RETRY_LIMIT_S)
            self.res.events.emit(RunEvent.WRITE_FAILED, path=str(out), error=error[:500], critical=True)


def _first_refusal(error: str | None, timeout_s: float) -> str | None:
    """Collective: ``error`` (what the disk refused this rank, or None) of every rank -> this rank's, or that
    another refused its part, or None when every rank wrote its part. Bounded like every wait on the ranks."""
    refused = torch.tensor([0 if error is None else 1], dtype=torch.int64)
    _wait_for_ranks(dist.all_reduce(refused, op=dist.ReduceOp.MAX, async_op=True), timeout_s,
                    "agreeing whether the checkpoint was written")
    return error or ("another learner rank could not write its part" if refused.item() else None)


def _save(config: TrainConfig, tr: Trainables, state_dict: dict[str, torch.Tensor], step: int, res: Resources,
          ranks: RankInfo, lineage: list[tuple[int, int]], consumed: list[dict], since: int,
          agree: Callable[[str | None], str | None]) -> Path:
    """Collective: rank 0 writes the Hugging Face files, then every rank its share of the training state; a
    part the disk refused raises CheckpointWriteError on every rank (``agree`` ends each part).

    The state also names what every step since the checkpoint of step ``since`` (the one this run
    saved or resumed from last) trained on (``consumed``: trajectory ids by outcome), and the weight
    lineage a resumed run continues."""
    out_dir = checkpoint_dir(config.output_dir, step)
    refused = None
    if ranks.rank == 0:
        refused = disk_refusal(lambda: save_policy(config, tr.model.config, state_dict, out_dir))
    refused = agree(refused)
    if refused is not None:
        raise CheckpointWriteError(refused)
    state = TrainState(
        step=step, weight_version=step,
        data_cursor=DataCursor(next_request_id=res.batches.next_request_id if res.batches is not None else 0,
                               batches_consumed=step),
        lineage=[tuple(pair) for pair in lineage], consumed=consumed, consumed_since=since)
    save_train_state(out_dir, state=state, agree=agree, **tr.checkpoint_parts())
    res.events.emit(RunEvent.CHECKPOINT_WRITTEN, step=step, path=str(out_dir))
    return out_dir


def save_policy(config: TrainConfig, model_config, state_dict: dict[str, torch.Tensor], out_dir: Path) -> Path:
    """The policy as a Hugging Face model at ``out_dir``. With ``learner.lora`` the adapter is merged into the
    base weights (W = W₀ + s·BA: a plain model for transformers, vLLM and ``horizonrl eval``) and also kept as a
    PEFT adapter in ``out_dir/adapter``."""
    lora = LoraSettings.from_config(config)
    if lora is None:
        return save_hf_checkpoint(model_config, state_dict, config.model.path, out_dir)
    return save_hf_checkpoint(model_config, merged_state_dict(state_dict, lora), config.model.path, out_dir,
                              extra=lambda tmp: save_adapter(tmp / CHECKPOINT_ADAPTER_DIR, state_dict, lora,
                                                             base_model=config.model.path))


def next_weight_epoch(output_dir: Path) -> int:
    """This learner incarnation's weight epoch: one more than the last one started in this run directory."""
    path = RunDir(output_dir).learner_epoch
    epoch = int(path.read_text()) + 1 if path.is_file() else 0
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(str(epoch))
    os.replace(tmp, path)
    return epoch


def weight_bucket_bytes(bucket_mb: float) -> int:
    return max(ALIGN_BYTES, int(bucket_mb * (1 << 20)))


def publish_weights(model, hub, *, version: int, epoch: int, bucket_mb: float, dtype: torch.dtype | None,
                    stop: threading.Event, grace_s: float = STOP_SEND_GRACE_S,
                    background: bool = False, lora: LoraSettings | None = None) -> dict[str, float] | None:
    """Collective (every rank calls it; ``hub`` is rank 0's, None elsewhere): the model's weights go to
    every engine bucket by bucket, gathered from the FSDP shards on the learner's device in ``dtype``
    (weight_broadcast.py; ``background``: see ``WeightHub.publish``). Rank 0 returns the hub's statistics,
    or None when a stop was requested and the engines still had not taken the version ``grace_s`` later
    (they may have exited already; the checkpoint matters more than this version). Other ranks return None.

    ``lora``: a version is the adapter alone (learner/lora.py ``adapter_to_send``), which the engines load as
    their LoRA adapter in place of the last one; the base weights never leave the learner."""
    from horizonrl.learner.weight_gather import gather_without_sending

    # sharded DTensors: nothing gathered yet
    named = adapter_to_send(model, lora) if lora is not None else weights_to_send(model.config, model.state_dict())
    if hub is None:
        gather_without_sending(named, bucket_bytes=weight_bucket_bytes(bucket_mb), dtype=dtype)
        return None
    return hub.publish(version, epoch, named, dtype=dtype, should_abandon=_abandon_after(stop, grace_s),
                       background=background)


def _abandon_after(stop: threading.Event, grace_s: float):
    """True once ``stop`` has been set for longer than ``grace_s``."""
    seen_at: list[float] = []

    def should_abandon() -> bool:
        if not stop.is_set():
            return False
        if not seen_at:
            seen_at.append(time.monotonic())
        return time.monotonic() - seen_at[0] > grace_s

    return should_abandon


class LearnerRanksError(RuntimeError):
    """A collective among the learner's own ranks did not complete in time: another rank died or hangs."""


def _wait_for_ranks(work, timeout_s: float, what: str) -> None:
    """Wait for ``work`` (an ``async_op`` collective of the learner's group) at most ``timeout_s``.

    These control collectives move CPU tensors, which go over gloo even when the group is NCCL for
    CUDA tensors (``cpu:gloo,cuda:nccl``), so the wait is a real bound and the ``.item()`` after it
    reads a finished result; a dead peer ends it with this error instead of a hang."""
    failure = f"learner rank {dist.get_rank()}: {what} did not complete within {timeout_s:.0f} s " \
              "(another learner rank died or hangs)"
    try:
        completed = work.wait(timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        raise LearnerRanksError(f"{failure}: {exc}") from exc
    if completed is False:
        raise LearnerRanksError(failure)


def from_rank_zero(value: int, timeout_s: float, what: str) -> int:
    """Rank 0's ``value`` on every rank (a collective)."""
    tensor = torch.tensor([value], dtype=torch.int64)
    _wait_for_ranks(dist.broadcast(tensor, src=0, async_op=True), timeout_s, f"sharing rank 0's {what}")
    return int(tensor.item())


def _all_agree_to_stop(reasons: tuple[threading.Event, ...], timeout_s: float) -> bool:
    """A stop signal (or end-training request) seen by any rank stops all of them at the same phase boundary."""
    flag = torch.tensor([int(any(reason.is_set() for reason in reasons))], dtype=torch.int64)
    _wait_for_ranks(dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True), timeout_s,
                    "agreeing whether to stop")
    return bool(flag.item())
