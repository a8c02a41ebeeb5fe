"""The learner's main loop for real (W=1) against a fake buffer, a fake coordinator and one fake actor: the real
services wired as learner/main.py wires them. The loop's logic (weight_sync_every, stops, early ends, abandoned
broadcasts, resumes) is tested in-process in test_learner_loop.py."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import zmq

from horizonrl.protocol import Batch, BatchRequest, Heartbeat, LearnerReport, Registration, decode, encode
from horizonrl.protocol.transport import free_ports, make_socket

from learner_fixtures import build_tiny_model, groups

pytestmark = pytest.mark.slow


def _learner(config_data: dict, dist_port: int) -> None:
    from horizonrl.core.config import TrainConfig
    from horizonrl.core.runtime import exit_skipping_finalization
    from horizonrl.learner.main import main

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(dist_port))
    exit_skipping_finalization(main(TrainConfig.model_validate(config_data)))  # as `horizonrl learner` does


def _fake_actor(port: int, out_dir: str) -> None:
    from safetensors.torch import save_file

    from horizonrl.actors.weight_receiver import join_weight_hub, receive_weights

    receiver = join_weight_hub("127.0.0.1", port, actor=0, run_id="test-run", timeout_s=120)
    versions = []
    while True:
        try:
            layout, named = receive_weights(receiver)  # first: the version the learner answers the join with
            version = layout.version
        except Exception:
            break  # the learner is gone: done
        versions.append(version)
        save_file({name: tensor.clone() for name, tensor in named}, str(Path(out_dir) / "received.safetensors"))
        (Path(out_dir) / "versions.json").write_text(json.dumps(versions))


class FakeBuffer(threading.Thread):
    """A ROUTER answering each BatchRequest; before the first real reply, one stale reply. It answers
    nothing before ``ready()`` (the fake engine has joined), so the engine sees every version."""

    def __init__(self, context: zmq.Context, port: int, replies: int, ready=lambda: True) -> None:
        super().__init__(daemon=True)
        self.ready = ready
        self.socket = make_socket(context, zmq.ROUTER)
        self.socket.bind(f"tcp://127.0.0.1:{port}")
        self.replies = replies
        self.requests: list[BatchRequest] = []
        self.done = threading.Event()

    def run(self) -> None:
        try:
            while not self.done.is_set():
                if not self.socket.poll(100):
                    continue
                identity, payload = self.socket.recv_multipart()
                request = decode(payload)
                self.requests.append(request)
                if len(self.requests) > self.replies:
                    continue  # never answered: the learner must stop while waiting
                while not self.ready() and not self.done.is_set():
                    time.sleep(0.05)
                if len(self.requests) == 1:
                    self.socket.send_multipart([identity, encode(Batch(run_id="test-run", request_id=999, groups=[]))])
                batch = Batch(run_id="test-run", request_id=request.request_id, groups=groups(seed=len(self.requests)), buffer_stats={"depth": 3.0})
                self.socket.send_multipart([identity, encode(batch)])
        finally:
            self.socket.close(linger=0)


def _config(tmp_path: Path, model_dir: Path, total_steps: int, ports: dict, sync_every: int = 1) -> dict:
    return {
        "run": {"output_dir": str(tmp_path / "run"), "log_level": "INFO", "run_id": "test-run"},
        "model": {"path": str(model_dir)},
        "envs": [{"name": "fake"}],
        "rollout": {"num_actors": 1, "n": 4, "temperature": 0.8, "weight_sync_every": sync_every},
        "learner": {
            "total_steps": total_steps, "groups_per_step": 2, "lr": 1e-3, "micro_batch_size": 4,
            "save_every": 1, "batch_timeout_s": 60, "weight_sync_timeout_s": 90,
        },
        "network": {"host": "127.0.0.1", **ports},
    }


def _ports() -> dict:
    names = ("control_port", "report_port", "trajectory_port", "batch_port", "weight_port", "dist_port")
    return dict(zip(names, free_ports(len(names))))


def _start(tmp_path: Path, total_steps: int, replies: int, sync_every: int = 1):
    model_dir = build_tiny_model(tmp_path / "model")
    ports = _ports()
    context = zmq.Context()
    buffer = FakeBuffer(context, ports["batch_port"], replies, ready=(tmp_path / "versions.json").exists)
    buffer.start()
    coordinator = make_socket(context, zmq.PULL)
    coordinator.bind(f"tcp://127.0.0.1:{ports['report_port']}")
    ctx = mp.get_context("spawn")
    actor = ctx.Process(target=_fake_actor, args=(ports["weight_port"], str(tmp_path)))
    learner = ctx.Process(target=_learner, args=(_config(tmp_path, model_dir, total_steps, ports, sync_every),
                                                 ports["dist_port"]))
    actor.start()
    learner.start()
    return model_dir, context, buffer, coordinator, actor, learner


def _stop_all(context, buffer, coordinator, processes) -> None:
    for process in processes:
        if process.is_alive():
            process.kill()
        process.join(10)
    buffer.done.set()
    buffer.join(5)
    coordinator.close(linger=0)
    context.term()


def _collect(coordinator, until, timeout_s: float, registrations: list | None = None):
    reports, heartbeats = [], []
    registrations = [] if registrations is None else registrations
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not until(reports):
        if coordinator.poll(200):
            message = decode(coordinator.recv())
            if isinstance(message, LearnerReport) and message.startup:
                continue  # the learner announcing its weight epoch: not a step
            if isinstance(message, Registration):
                registrations.append(message)  # the weight hub's address and epoch, for the registry
                continue
            (reports if isinstance(message, LearnerReport) else heartbeats).append(message)
    return reports, heartbeats


def test_learner_trains_reports_broadcasts_and_saves(tmp_path):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model_dir, context, buffer, coordinator, actor, learner = _start(tmp_path, total_steps=2, replies=2)
    try:
        registrations: list[Registration] = []
        reports, heartbeats = _collect(coordinator, lambda r: any(x.final for x in r), timeout_s=150,
                                       registrations=registrations)
        learner.join(60)
        actor.join(30)
        assert learner.exitcode == 0
        assert [r.step for r in reports] == [1, 2, 2] and [r.final for r in reports] == [False, False, True]
        assert heartbeats and all(isinstance(h, Heartbeat) and h.role == "learner" for h in heartbeats)
        assert registrations and {"weights", "weights_epoch"} <= set(registrations[0].endpoints), registrations
        assert [r.learner_version for r in buffer.requests] == [0, 1]
        metrics = reports[1].metrics
        for key in (
            "loss/policy", "loss/entropy", "loss/approx_kl", "ratio/mean", "ratio/min", "ratio/max",
            "ratio/clip_fraction", "grad/norm", "time/batch_wait_s", "time/step_s", "time/gather_s",
            "time/weight_sync_s", "throughput/learner_tokens_per_s", "batch/reward_mean", "batch/success_mean",
            "batch/turns_mean", "batch/max_turns", "batch/staleness_mean", "batch/staleness_max", "batch/groups",
            "batch/trajectories", "env/fake/success_mean", "env/fake/reward_mean", "buffer/depth",
        ):
            assert key in metrics, key
        assert metrics["batch/failed_skipped"] == 1 and metrics["batch/staleness_max"] == 1
        assert reports[0].checkpoint.endswith("step_000001") and Path(reports[0].checkpoint).is_dir()
        final = Path(reports[2].checkpoint)
        assert final.name == "step_000002" and (final / "tokenizer.json").is_file()

        assert json.loads((tmp_path / "versions.json").read_text()) == [0, 1, 2]  # the join's, then each step's
        received = load_file(str(tmp_path / "received.safetensors"))
        saved = load_file(str(final / "model.safetensors"))
        assert set(received) == set(saved)
        for name in saved:
            assert torch.equal(received[name], saved[name]), name

        trained = AutoModelForCausalLM.from_pretrained(final)
        reference = AutoModelForCausalLM.from_pretrained(model_dir)
        missing, unexpected = reference.load_state_dict(received, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embedding
        input_ids = torch.randint(2, 300, (2, 16))
        with torch.no_grad():
            torch.testing.assert_close(trained(input_ids).logits, reference(input_ids).logits, atol=0, rtol=0)
            initial = AutoModelForCausalLM.from_pretrained(model_dir)
            assert not torch.allclose(initial(input_ids).logits, trained(input_ids).logits)
    finally:
        _stop_all(context, buffer, coordinator, [learner, actor])


def test_sigterm_while_waiting_for_a_batch_stops_cleanly(tmp_path):
    model_dir, context, buffer, coordinator, actor, learner = _start(tmp_path, total_steps=50, replies=1)
    try:
        reports, _ = _collect(coordinator, lambda r: len(r) >= 1, timeout_s=150)
        assert [r.step for r in reports] == [1]
        deadline = time.monotonic() + 30
        while len(buffer.requests) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(buffer.requests) >= 2, "the learner never asked for its second batch"
        os.kill(learner.pid, signal.SIGTERM)
        more, _ = _collect(coordinator, lambda r: any(x.final for x in r), timeout_s=60)
        learner.join(60)
        assert learner.exitcode == 0
        assert more[-1].final and more[-1].step == 1 and more[-1].metrics["learner/stopped_early"] == 1.0
        assert Path(more[-1].checkpoint).name == "step_000001"
    finally:
        _stop_all(context, buffer, coordinator, [learner, actor])
