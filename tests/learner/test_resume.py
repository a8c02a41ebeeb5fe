"""A learner stopped at step k and resumed from its checkpoint matches one that never stopped.

Real learner process (W=1, gloo, FSDP2) against a test-owned buffer that serves a FIXED batch
per learner version, so both runs see the same data at the same step. The run trains with the
critic (gae), the KL reference, warm-up + cosine LR, so model, critic, both optimizers, both LR
schedules and the data cursor must all come back for the losses to match.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import zmq

from horizonrl.protocol import Batch, LearnerReport, decode, encode
from horizonrl.protocol.transport import free_ports, make_socket
from horizonrl.core.run_dirs import latest_checkpoint, read_state, resolve_resume, resumed_step

from learner_fixtures import build_tiny_model, groups
from test_learner_main_loop import _fake_actor, _learner

TOTAL_STEPS = 4
STOP_AT = 2


class FixedBuffer(threading.Thread):
    """Answers a BatchRequest with the batch for its learner version; ignores requests past ``serve_up_to``."""

    def __init__(self, context: zmq.Context, port: int, serve_up_to: int) -> None:
        super().__init__(daemon=True)
        self.socket = make_socket(context, zmq.ROUTER)
        self.socket.bind(f"tcp://127.0.0.1:{port}")
        self.serve_up_to = serve_up_to
        self.requests = []
        self.done = threading.Event()

    def run(self) -> None:
        try:
            while not self.done.is_set():
                if not self.socket.poll(100):
                    continue
                identity, payload = self.socket.recv_multipart()
                request = decode(payload)
                self.requests.append(request)
                if request.learner_version >= self.serve_up_to:
                    continue
                batch = Batch(run_id="test-run", request_id=request.request_id, groups=groups(seed=100 + request.learner_version))
                self.socket.send_multipart([identity, encode(batch)])
        finally:
            self.socket.close(linger=0)


def _config(out_dir: Path, model_dir: Path, ports: dict, resume: str | None) -> dict:
    return {
        "run": {"output_dir": str(out_dir), "log_level": "INFO", "seed": 3, "run_id": "test-run"},
        "model": {"path": str(model_dir)},
        "envs": [{"name": "fake"}],
        "rollout": {"num_actors": 1, "n": 4, "temperature": 0.9},
        "algorithm": {"adv_estimator": "gae", "gamma": 0.95, "lam": 0.9,
                      "rounds_ctrl": {"type": "scaling_inter_stepwise", "rounds": [2, 3, 4, 5], "steps_scaling_inter": 1}},
        "learner": {
            "total_steps": TOTAL_STEPS, "groups_per_step": 2, "lr": 1e-3, "micro_batch_size": 4, "save_every": STOP_AT,
            "lr_warmup_steps": 1, "lr_schedule": "cosine", "min_lr_ratio": 0.1, "use_kl_loss": True,
            "kl_loss_coef": 0.05, "entropy_coeff": 0.01, "clip_ratio_high": 0.28,
            "batch_timeout_s": 60, "weight_sync_timeout_s": 90, "resume": resume,
        },
        "network": {"host": "127.0.0.1", **dict(zip(("control_port", "report_port", "trajectory_port", "batch_port", "weight_port", "dist_port"), free_ports(6)))},
    }


def _run(out_dir: Path, model_dir: Path, serve_up_to: int, resume: str | None = None, stop_after: int | None = None):
    """One learner process; returns its reports. With ``stop_after``, SIGTERM it once that step is reported."""
    cfg = _config(out_dir, model_dir, {}, resume)
    ports = cfg["network"]
    context = zmq.Context()
    buffer = FixedBuffer(context, ports["batch_port"], serve_up_to)
    buffer.start()
    pull = make_socket(context, zmq.PULL)
    pull.bind(f"tcp://127.0.0.1:{ports['report_port']}")
    ctx = mp.get_context("spawn")
    actor = ctx.Process(target=_fake_actor, args=(ports["weight_port"], str(out_dir)))
    learner = ctx.Process(target=_learner, args=(cfg, ports["dist_port"]))
    out_dir.mkdir(parents=True, exist_ok=True)
    actor.start()
    learner.start()
    reports = []
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not any(r.final for r in reports):
            if pull.poll(200):
                message = decode(pull.recv())
                if isinstance(message, LearnerReport) and not message.startup:
                    reports.append(message)
                    if stop_after is not None and message.step == stop_after and not message.final:
                        while len(buffer.requests) <= stop_after and time.monotonic() < deadline:
                            time.sleep(0.05)  # it is waiting for the batch it will never get
                        assert len(buffer.requests) > stop_after, "the learner never asked for the next batch"
                        os.kill(learner.pid, signal.SIGTERM)
        learner.join(60)
        assert learner.exitcode == 0
        return reports, buffer.requests
    finally:
        for process in (learner, actor):
            if process.is_alive():
                process.kill()
            process.join(10)
        buffer.done.set()
        buffer.join(5)
        pull.close(linger=0)
        context.term()


KEYS = ("loss/policy", "loss/value", "loss/kl_ref", "loss/entropy", "ratio/mean", "grad/norm", "grad/critic_norm", "optim/lr")


@pytest.mark.slow
def test_resumed_run_matches_uninterrupted_run(tmp_path):
    import torch
    from safetensors.torch import load_file

    model_dir = build_tiny_model(tmp_path / "model")
    straight, _ = _run(tmp_path / "straight", model_dir, serve_up_to=TOTAL_STEPS)

    first, _ = _run(tmp_path / "split", model_dir, serve_up_to=STOP_AT, stop_after=STOP_AT)
    assert [r.step for r in first if not r.final] == [1, 2] and first[-1].final and first[-1].step == STOP_AT
    checkpoint = latest_checkpoint(tmp_path / "split")
    assert checkpoint is not None and checkpoint.name == f"step_{STOP_AT:06d}"
    state = read_state(checkpoint)
    assert state.step == STOP_AT and state.data_cursor.next_request_id == STOP_AT + 1  # requests 1, 2 answered
    assert state.lineage == [(0, 0)] and state.lr_scheduler is not None and state.world_size == 1
    assert (checkpoint / "train_state" / ".metadata").is_file() and (checkpoint / "model.safetensors").is_file()

    resumed, requests = _run(tmp_path / "split", model_dir, serve_up_to=TOTAL_STEPS, resume="auto")
    assert [r.step for r in resumed if not r.final] == [3, 4]
    assert requests[0].learner_version == STOP_AT and requests[0].request_id == STOP_AT + 1

    by_step = {r.step: r.metrics for r in straight if not r.final}
    for report in resumed:
        if report.final:
            continue
        for key in KEYS:
            assert report.metrics[key] == pytest.approx(by_step[report.step][key], rel=1e-4, abs=1e-6), (report.step, key)

    a = load_file(str(tmp_path / "straight" / "checkpoints" / "step_000004" / "model.safetensors"))
    b = load_file(str(tmp_path / "split" / "checkpoints" / "step_000004" / "model.safetensors"))
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=1e-5, rtol=1e-4, msg=name)


def test_turn_budget_after_resume_is_the_uninterrupted_one(tmp_path):
    """The coordinator resumed from a checkpoint of step k publishes the uninterrupted run's budget:
    rounds [2, 3, 4, 5] raised every 2 steps, for step k + 1: rounds[min(k // 2, 3)]."""
    from horizonrl.coordinator import Coordinator
    from horizonrl.core.config import TrainConfig
    from horizonrl.core.runtime import StopFlag
    from horizonrl.launcher import resolve_ports, start_launch

    expected = [2, 2, 3, 3, 4, 4, 5, 5, 5]
    got = []
    for k in range(9):
        ckpt = tmp_path / "checkpoints" / f"step_{k:06d}"
        ckpt.mkdir(parents=True)
        (ckpt / "train_state.json").write_text(f'{{"step": {k}}}')
        data = _config(tmp_path, tmp_path, {}, resume=str(ckpt))
        data["algorithm"]["rounds_ctrl"]["steps_scaling_inter"] = 2
        data["network"] = {"host": "127.0.0.1"}
        config = resolve_ports(TrainConfig.model_validate(data))
        start_launch(tmp_path)  # each a new launch (resume=...): not a restart of the coordinator before it
        coordinator = Coordinator.for_run(config, StopFlag())
        try:
            got.append(coordinator.control().max_turns)
        finally:
            coordinator.close()
    assert got == expected
    assert resumed_step(None, tmp_path) == 0
    assert resolve_resume("auto", tmp_path / "nothing") is None
    (tmp_path / "checkpoints" / "step_000099").mkdir()  # incomplete: no train_state.json
    assert latest_checkpoint(tmp_path).name == "step_000008"
    with pytest.raises(FileNotFoundError):
        resolve_resume(str(tmp_path / "checkpoints" / "step_000099"), tmp_path)


def test_train_state_reads_an_older_checkpoint_and_names_a_file_that_is_not_one(tmp_path):
    """``train_state.json`` is a typed struct (core/run_dirs.py TrainState): a checkpoint written before it (with the
    learner's old "coordinator" entry, which nothing read) still resumes; one that is not a state says which file."""
    from horizonrl.core.run_dirs import DataCursor, TrainState, write_state

    old = tmp_path / "old"
    old.mkdir()
    (old / "train_state.json").write_text('{"step": 4, "weight_version": 4, "data_cursor": {"next_request_id": 5, '
                                          '"batches_consumed": 4}, "coordinator": {"learner_step": 4, '
                                          '"next_max_turns": 3}, "lineage": [[0, 0], [1, 2]], "consumed": [], '
                                          '"consumed_since": 2, "lr_scheduler": {"last_epoch": 4}, "world_size": 1}')
    state = read_state(old)
    assert (state.step, state.data_cursor, state.lineage, state.consumed_since) == (4, DataCursor(5, 4),
                                                                                      [(0, 0), (1, 2)], 2)
    assert state.lr_scheduler == {"last_epoch": 4} and state.critic_lr_scheduler is None

    new = tmp_path / "new"
    new.mkdir()
    write_state(new, TrainState(step=7, lineage=[(0, 0)], consumed=[{"trained": ["a"]}]))
    assert read_state(new) == TrainState(step=7, lineage=[(0, 0)], consumed=[{"trained": ["a"]}])
    assert not (new / "train_state.json.tmp").exists()

    (new / "train_state.json").write_text('{"step": "seven"}')
    with pytest.raises(ValueError, match="train_state.json: not a training state"):
        read_state(new)
