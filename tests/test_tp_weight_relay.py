"""A tensor-parallel engine (TP = 2) takes each version from the learner once, and TP rank 0 relays it to rank 1
over the engine's own group (actors/tp_relay.py), inline and staged.

Real parts: the learner's weight hub and its gloo groups, a gloo group between the two workers standing in for
vLLM's tensor-parallel device group, and ``actors/vllm_worker.py``'s extension in each worker (threads of this
process), with a model that copies what it is given in place of vLLM's loader. What is measured: the bytes the
learner sends per version and the host memory each worker holds for a staged version. Before (every worker a
member of the hub, receiving the whole model): two members per engine, twice the model's bytes per version, and
each worker staged the whole model in host memory (pinned on a GPU, beside the learner's pinned copy). Now: one
member, the model's bytes once, and the staged copy on rank 0 alone, pageable (only 64 MiB is pinned on a GPU,
``weight_receiver.HostStaging``; the CPU has no pinned memory to measure).
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import torch
import torch.distributed as dist
import zmq

from horizonrl.actors.tp_relay import TensorParallelGroup
from horizonrl.actors.vllm_worker import WeightReceiverExtension
from horizonrl.learner.weight_broadcast import WeightHub
from horizonrl.protocol.worker_replies import RpcReply, StageOutcome, WorkerReply

TIMEOUT_S = 30.0


class TpWorker(WeightReceiverExtension):
    """One worker of a TP = 2 engine: its rank, its share of the engine's group, a model that keeps what it loads."""

    def __init__(self, rank: int, group: dist.ProcessGroup) -> None:
        self.rank = rank
        self.tp_group = TensorParallelGroup(rank, 2, group, torch.device("cpu"), TIMEOUT_S)
        self.loaded: dict[str, torch.Tensor] = {}
        model = torch.nn.Module()
        model.config = SimpleNamespace(tie_word_embeddings=False)
        self.model_runner = SimpleNamespace(get_model=lambda: model)

    def _horizonrl_tensor_parallel(self, device, timeout_s):
        return self.tp_group

    def reload_weights(self, weights_iterator, is_checkpoint_format=True):
        for name, tensor in weights_iterator:
            self.loaded[name] = tensor.clone()


def call_both(workers, method: str, args, timeout_s: float = TIMEOUT_S) -> list[WorkerReply]:
    """``method`` in both workers at once, as vLLM's executor runs an RPC in every worker."""
    replies: dict[int, object] = {}

    def run(worker) -> None:
        replies[worker.rank] = worker.horizonrl_call(1, time.time() + timeout_s, method, list(args))

    threads = [threading.Thread(target=run, args=(w,)) for w in workers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT_S + 10)
    answers = [RpcReply.from_wire(replies[rank]) for rank in (0, 1)]
    assert not any(a.error for a in answers), answers
    return [WorkerReply.from_wire(a.payload) for a in answers]


def tp_groups() -> list[dist.ProcessGroup]:
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=TIMEOUT_S), wait_for_workers=False)
    groups: dict[int, dist.ProcessGroup] = {}

    def form(rank: int) -> None:
        # each rank its own connection to the store, as each process of a group has
        mine = store if rank == 0 else dist.TCPStore("127.0.0.1", store.port, None, False, timedelta(seconds=TIMEOUT_S))
        stores.append(mine)
        groups[rank] = dist.ProcessGroupGloo(dist.PrefixStore("tp", mine), rank, 2, timedelta(seconds=TIMEOUT_S))

    stores: list = []

    threads = [threading.Thread(target=form, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT_S)
    tp_groups.stores = stores  # kept alive with the groups
    return [groups[0], groups[1]]


def model(version: int) -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(version)
    return [(f"model.layers.{i}.mlp.weight", torch.randn(64, 64, generator=generator)) for i in range(6)]


def test_one_receive_per_engine_relayed_over_its_tensor_parallel_group(tmp_path):
    hub = WeightHub("127.0.0.1", 0, backend="gloo", timeout_s=TIMEOUT_S, run_id="tp", bucket_bytes=40 << 10)
    workers = [TpWorker(rank, group) for rank, group in enumerate(tp_groups())]
    context = zmq.Context()
    actor = context.socket(zmq.PULL)
    address = f"ipc://{tmp_path}/staged"
    actor.bind(address)
    try:
        version0 = hub.pack(0, model(0))
        hub.start()
        model_bytes = version0.nbytes
        assert len(version0.plan) == 3
        # The join: rank 0 becomes the engine's one member, takes version 0 and relays it bucket by bucket.
        replies = call_both(workers, "horizonrl_join_weight_hub", ["127.0.0.1", hub.port, 0, "tp", TIMEOUT_S, "gloo"])
        assert [(r.version, r.worker) for r in replies] == [(0, 0), (0, 1)]
        wait_until = time.monotonic() + 10  # the hub records the member once its admission thread returns
        while not hub.members and time.monotonic() < wait_until:
            time.sleep(0.05)
        assert list(hub.members) == [(0, 0)]  # before: (0, 0) and (0, 1)
        for worker in workers:
            assert all(torch.equal(worker.loaded[name], tensor) for name, tensor in model(0))
        # A staged version: rank 0 alone receives it, in host memory, while the engine would go on generating.
        receiver = workers[0]._horizonrl_receiver
        receiver.stage_in_host = True  # what a receiver on a GPU does (NCCL)
        started = call_both(workers, "horizonrl_stage_weights", [1, address])
        assert [r.stages for r in started] == [True, False]
        version1 = hub.pack(1, model(1))
        sent = hub.send(version1)
        assert actor.poll(int(TIMEOUT_S * 1000))
        outcome = StageOutcome.decode(actor.recv())
        assert (outcome.stage_id, outcome.version, outcome.worker, outcome.error) == (1, 1, 0, "")
        loaded = call_both(workers, "horizonrl_load_staged", [])
        assert [(r.version, r.worker) for r in loaded] == [(1, 0), (1, 1)]
        for worker in workers:
            assert all(torch.equal(worker.loaded[name], tensor) for name, tensor in model(1))
        # What moved and what is held, measured.
        sent_bytes = sent["bytes"] * sent["members"]
        host_staged = [getattr(getattr(w, "_horizonrl_receiver", None), "_host_flat", None) for w in workers]
        figures = {"model_bytes": model_bytes, "learner_sent_bytes_per_version": sent_bytes,
                   "received_from_learner": receiver.received_bytes,
                   "host_staged_bytes": [0 if t is None else t.numel() for t in host_staged],
                   "host_staged_pinned": [bool(t is not None and t.is_pinned()) for t in host_staged]}
        print(figures)
        assert sent_bytes == model_bytes  # before: 2 x model_bytes (each TP rank a member)
        assert receiver.received_bytes == 2 * model_bytes  # versions 0 and 1, once each
        assert figures["host_staged_bytes"] == [model_bytes, 0]  # before: [model_bytes, model_bytes]
        assert figures["host_staged_pinned"] == [False, False]  # before: pinned on a GPU, on every rank
        # The learner goes away: rank 0's receive fails at once and it tells rank 1 there is no version, which
        # answers at once too (no collective left pending on the engine's group), and the engine joins again.
        hub.close()
        start = time.monotonic()
        failed = call_both(workers, "horizonrl_receive_weights", [], timeout_s=20)
        assert time.monotonic() - start < 10 and all(r.version == -1 for r in failed), failed
        assert "no version" in failed[1].error, failed
        hub = WeightHub("127.0.0.1", 0, backend="gloo", timeout_s=TIMEOUT_S, run_id="tp", bucket_bytes=40 << 10)
        hub.pack(2, model(2))
        hub.start()
        rejoined = call_both(workers, "horizonrl_join_weight_hub", ["127.0.0.1", hub.port, 0, "tp", TIMEOUT_S, "gloo"])
        assert [(r.version, r.error) for r in rejoined] == [(2, ""), (2, "")]
        for worker in workers:
            assert all(torch.equal(worker.loaded[name], tensor) for name, tensor in model(2))
    finally:
        actor.close(linger=0)
        context.term()
        for worker in workers:
            if getattr(worker, "_horizonrl_receiver", None) is not None:
                worker._horizonrl_receiver.close()
        hub.close()
