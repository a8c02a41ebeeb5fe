"""The colocated weight path's messages, handle checks and bounded waits (learner/weight_ipc.py,
actors/weight_ipc.py) on the CPU.

CUDA IPC itself needs a GPU: ``scripts/gpu_check.py``'s ``colocated_handoff`` check sends 1 GB through
the same two functions between two processes on one GPU and compares every byte, and its
``colocated_training`` check runs the weight hub with an engine joining through CUDA IPC (measured on
an H200, docs/gpu.md). Here: what travels, what is refused, and that every wait ends within its bound.
"""

from __future__ import annotations

import time

import pytest
import torch
import zmq

from horizonrl.actors import weight_ipc as engine_side
from horizonrl.actors.weight_ipc import IpcReceiver, open_ipc_weight_stream
from horizonrl.actors.weight_receiver import join_weight_hub
from horizonrl.learner.weight_broadcast import WeightHub
from horizonrl.learner.weight_ipc import send_version_over_ipc, share_cuda_buffer
from horizonrl.protocol.codec import decode, encode
from horizonrl.protocol.messages import (CudaIpcBuffer, IpcBucketAck, IpcBucketReady, IpcWeights, WeightJoin,
                                         WeightLayout)
from horizonrl.protocol.transport import free_port, make_socket
from horizonrl.protocol.weights import WeightSyncError


def _layout(total_bytes: int = 64) -> WeightLayout:
    return WeightLayout(run_id="run-a", version=3, epoch=1, names=["w"], dtypes=["bfloat16"], shapes=[[32]],
                        total_bytes=total_bytes)


def _buffer(event: bytes | None = b"\x01" * 64) -> CudaIpcBuffer:
    return CudaIpcBuffer(device=0, handle=b"\x00\xff" * 32, storage_bytes=1 << 20, storage_offset=512,
                         ref_counter_handle=b"/torch_123_456", ref_counter_offset=8, event_handle=event,
                         event_sync_required=True, tensor_offset=0, nbytes=1 << 20)


@pytest.mark.parametrize("event", [b"\x01" * 64, None])
def test_the_messages_travel_in_msgpack_with_their_handle_bytes_intact(event):
    messages = [IpcWeights(run_id="run-a", layout=_layout(), bucket_bytes=1 << 20, buffer=_buffer(event)),
                IpcBucketReady(run_id="run-a", version=3, index=0), IpcBucketAck(run_id="run-a", version=3, index=0)]
    for message in messages:
        assert decode(encode(message)) == message
    assert decode(encode(messages[0])).buffer.handle == b"\x00\xff" * 32


def test_only_a_flat_uint8_cuda_buffer_is_shared_and_opening_needs_cuda(monkeypatch):
    with pytest.raises(ValueError, match="only a CUDA buffer"):
        share_cuda_buffer(torch.zeros(16, dtype=torch.uint8))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="sees a CUDA device"):
        engine_side.open_cuda_buffer(_buffer())


@pytest.fixture
def pair():
    context = zmq.Context()
    learner = make_socket(context, zmq.PAIR, server=True)
    port = learner.bind_to_random_port("tcp://127.0.0.1")
    engine = make_socket(context, zmq.PAIR)
    engine.connect(f"tcp://127.0.0.1:{port}")
    yield learner, engine
    learner.close()
    engine.close()
    context.term()


def test_an_engine_whose_learner_is_silent_gives_up_within_the_bound(pair):
    _, engine = pair
    start = time.monotonic()
    with pytest.raises(WeightSyncError, match="the next version did not arrive within 0.5 s"):
        open_ipc_weight_stream(engine, run_id="run-a", timeout_s=0.5)
    assert time.monotonic() - start < 5.0


def test_an_announcement_of_another_run_or_a_bad_plan_is_refused_before_any_memory_is_mapped(pair):
    learner, engine = pair
    learner.send(encode(IpcWeights(run_id="run-b", layout=_layout(), bucket_bytes=1 << 20, buffer=_buffer())))
    with pytest.raises(WeightSyncError, match="run 'run-b'"):
        open_ipc_weight_stream(engine, run_id="run-a", timeout_s=5.0)
    # 32 bf16 values are 64 bytes; a layout claiming 128 does not match its own plan
    learner.send(encode(IpcWeights(run_id="run-a", layout=_layout(128), bucket_bytes=1 << 20, buffer=_buffer())))
    with pytest.raises(WeightSyncError, match="says 128 bytes"):
        open_ipc_weight_stream(engine, run_id="run-a", timeout_s=5.0)


def test_the_sender_refuses_a_layout_its_plan_contradicts_before_sending(pair):
    learner, engine = pair
    named = [("w", torch.zeros(32, dtype=torch.bfloat16))]
    with pytest.raises(ValueError, match="says 128 bytes"):
        send_version_over_ipc(learner, named, _layout(128), bucket_bytes=1 << 20, device=torch.device("cpu"),
                              timeout_s=1.0)
    assert not engine.poll(100, zmq.POLLIN)  # nothing was sent


def test_a_join_names_its_cuda_ipc_address_and_an_older_join_decodes_without_one():
    join = WeightJoin(run_id="run-a", actor=0, pid=12, ipc_address="tcp://127.0.0.1:5555")
    assert decode(encode(join)).ipc_address == "tcp://127.0.0.1:5555"
    assert decode(encode(WeightJoin(run_id="run-a", actor=0, pid=12))).ipc_address == ""


def test_a_hub_without_a_gpu_refuses_a_cuda_ipc_join_and_the_engine_learns_it_within_its_bound():
    """A real hub (gloo, TCPStore) and a real join through ``join_weight_hub(backend="cuda_ipc")``: the
    engine listens on loopback and names that address; a hub on the CPU cannot hand weights over by CUDA
    IPC, so it counts a failed join and sends nothing, and the engine's wait for its first version ends
    with WeightSyncError at its bound."""
    hub = WeightHub("127.0.0.1", free_port(), backend="gloo", timeout_s=30, run_id="run-a")
    hub.pack(0, [("w", torch.zeros(4))])
    hub.start()
    receiver = None
    try:
        receiver = join_weight_hub("127.0.0.1", hub.port, actor=0, run_id="run-a", timeout_s=2.0, backend="cuda_ipc")
        assert isinstance(receiver, IpcReceiver) and receiver.backend == "cuda_ipc"
        deadline = time.monotonic() + 30
        while hub.counters["failed_joins"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert hub.counters["failed_joins"] == 1 and not hub.members
        start = time.monotonic()
        with pytest.raises(WeightSyncError, match="the next version did not arrive within 2 s"):
            receiver.open_stream()
        assert time.monotonic() - start < 10
    finally:
        if receiver is not None:
            receiver.close()
        hub.close()


def test_a_cuda_ipc_join_to_no_hub_fails_within_its_bound():
    start = time.monotonic()
    with pytest.raises(WeightSyncError, match="CUDA IPC.*could not join within 2 s"):
        IpcReceiver.join("127.0.0.1", free_port(), actor=0, run_id="run-a", timeout_s=2.0)
    assert time.monotonic() - start < 15


def test_the_engine_maps_the_learners_buffer_once_per_export_not_once_per_version(pair, monkeypatch):
    """torch counts CUDA-IPC references in a shared file: one per export (the learner exports its staging buffer
    once), one released per mapping the engine drops, and one released at once whenever torch's rebuild finds the
    storage already mapped. Opening the buffer with every version released a reference per version that was never
    added. The engine now keeps one mapping per export, and opens a new one only for a new buffer."""
    learner, engine = pair
    opened: list[bytes] = []

    def open_buffer(shared):  # what torch's rebuild_cuda_tensor does, minus the GPU
        opened.append(shared.handle)
        return torch.zeros(shared.nbytes, dtype=torch.uint8)

    monkeypatch.setattr(engine_side, "open_cuda_buffer", open_buffer)
    receiver = IpcReceiver(1, "run-a", 5.0, engine, context=None, store=None)
    bigger = CudaIpcBuffer(**{**{f: getattr(_buffer(), f) for f in CudaIpcBuffer.__struct_fields__},
                              "handle": b"\x07" * 64})
    for buffer in (_buffer(), _buffer(), _buffer(), bigger, bigger):
        learner.send(encode(IpcWeights(run_id="run-a", layout=_layout(), bucket_bytes=1 << 20, buffer=buffer)))
        stream = receiver.open_stream()
        assert stream.buffer.numel() == 1 << 20
    assert opened == [_buffer().handle, bigger.handle]
