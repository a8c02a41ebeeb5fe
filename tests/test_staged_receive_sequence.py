"""The staged receive's state machine against a real weight hub (gloo, one process), in the sequence where a staged
receive ended, the engine took its outcome by asking, and the next stage request found a receive still under way
in the worker. The worker used to answer "a staged receive is already in progress", the actor joined the hub
again, and that join waited for the old receive (blocked on the closed group until its timeout) while the hub's
admission of the new join waited for the engine: both for weight_sync_timeout_s, the learner without a step for as
long. Now a stage request adopts a receive under way (it brings the next version, the
one that stage asks for), and a join leaves an old receive behind after a moment. The worker here is the real
extension over a transformers-sized stand-in of vLLM's model runner (the real engine: tests/integration/)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import zmq
from helpers import wait_until

from horizonrl.actors.vllm_worker import WeightReceiverExtension
from horizonrl.learner.weight_broadcast import WeightHub
from horizonrl.protocol.worker_replies import StageOutcome, WorkerReply

pytestmark = pytest.mark.slow  # real gloo groups between the hub and the worker (14 s for both tests here)

RUN_ID = "sequence"
TIMEOUT_S = 60.0  # the hub's and the engine's weight_sync_timeout_s: what a stall would last


def weights(version: int) -> list[tuple[str, torch.Tensor]]:
    return [("weight", torch.full((4, 3), float(version))), ("bias", torch.full((4,), float(version)))]


class Worker(WeightReceiverExtension):
    """vLLM's Worker as far as the extension uses it: a model runner and the layer-wise reload."""

    def __init__(self) -> None:
        self.model = torch.nn.Linear(3, 4)
        self.model_runner = type("Runner", (), {"get_model": lambda _self: self.model})()

    def reload_weights(self, weights_iterator, is_checkpoint_format=True) -> None:
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, tensor in weights_iterator:
                params[name].copy_(tensor)


@pytest.fixture
def setting(tmp_path):
    hub = WeightHub("127.0.0.1", 0, backend="gloo", timeout_s=TIMEOUT_S, run_id=RUN_ID)
    hub.pack(0, weights(0))
    hub.start()
    context = zmq.Context()
    actor = context.socket(zmq.PULL)  # where the worker's staging threads tell the actor
    address = f"ipc://{tmp_path}/stages"
    actor.bind(address)
    worker = Worker()
    yield hub, worker, actor, address
    receiver = getattr(worker, "_horizonrl_receiver", None)
    if receiver is not None:
        receiver.close()
    hub.close()
    actor.close(linger=0)
    context.term()


def told(actor) -> tuple[int, int, int]:
    """(stage, version, epoch) of the staging thread's word to the actor."""
    assert actor.poll(30_000), "no word from the staging thread"
    outcome = StageOutcome.decode(actor.recv())
    return outcome.stage_id, outcome.version, outcome.epoch


def asked(worker, stage: int) -> tuple[int, int] | None:
    """(stage, version) of the worker's answer when the engine asks how ``stage`` ended; None: not ended."""
    answer = worker.horizonrl_staged_outcome(stage)
    return None if answer is None else (StageOutcome.from_wire(answer).stage_id, StageOutcome.from_wire(answer).version)


def reply(answer: list) -> WorkerReply:
    return WorkerReply.from_wire(answer)


def publish(hub, version: int) -> threading.Thread:
    sender = threading.Thread(target=hub.send, args=(hub.pack(version, weights(version)),), daemon=True)
    sender.start()
    return sender


def join(worker, hub) -> WorkerReply:
    return reply(worker.horizonrl_join_weight_hub("127.0.0.1", hub.port, 0, RUN_ID, TIMEOUT_S, "gloo"))


def test_a_stage_request_while_a_receive_is_under_way_takes_that_receive_over(setting):
    hub, worker, actor, address = setting
    assert join(worker, hub).version == 0 and worker.model.weight[0, 0] == 0.0
    # Stage 1 ends; the engine takes its outcome by asking (its message "lost"), and loads it.
    assert reply(worker.horizonrl_stage_weights(1, address)).error == ""
    publish(hub, 1).join(30)
    assert told(actor) == (1, 1, 0)
    worker._horizonrl_staging.thread.join(10)
    assert asked(worker, 1) == (1, 1)
    assert reply(worker.horizonrl_load_staged()).version == 1 and worker.model.weight[0, 0] == 1.0
    # Stage 2 starts receiving; before version 2 comes, the engine asks for stage 3.
    assert reply(worker.horizonrl_stage_weights(2, address)).error == ""
    assert reply(worker.horizonrl_stage_weights(3, address)).error == ""  # was: "a staged receive is already in progress"
    publish(hub, 2).join(30)
    assert told(actor) == (3, 2, 0)  # the receive under way brought version 2, for stage 3
    worker._horizonrl_staging.thread.join(10)
    assert asked(worker, 3) == (3, 2) and asked(worker, 2) is None
    assert reply(worker.horizonrl_load_staged()).version == 2 and worker.model.weight[0, 0] == 2.0


def test_a_rejoin_while_a_staged_receive_waits_on_the_old_membership_takes_seconds_not_the_timeout(setting):
    hub, worker, actor, address = setting
    join(worker, hub)
    assert reply(worker.horizonrl_stage_weights(1, address)).error == ""  # waits for a version that is not coming
    time.sleep(0.5)
    start = time.monotonic()
    done: list = []
    rejoin = threading.Thread(target=lambda: done.append(join(worker, hub)), daemon=True)
    rejoin.start()
    rejoin.join(40)
    assert not rejoin.is_alive(), "the rejoin waited for the old staged receive"
    assert time.monotonic() - start < 20  # the stall it replaces lasted the timeout (60 s here, 300 s by default)
    assert (done[0].version, done[0].epoch, done[0].error) == (0, 0, "")  # admitted again, at the newest version
    wait_until(lambda: hub.counters["admitted"] == 2, 10, "the hub to count the second admission")
    assert len(hub.members) == 1
    # The learner's next version reaches the new membership without waiting for the old one.
    assert reply(worker.horizonrl_stage_weights(2, address)).error == ""
    sender = publish(hub, 1)
    sender.join(30)
    assert not sender.is_alive()
    assert [m for m in (told(actor), told(actor)) if m[0] == 2][0][:2] == (2, 1)
