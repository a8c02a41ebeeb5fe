"""Colocated (the learner and one engine on one GPU): the engine starts first and the learner touches the GPU
only once the engine has registered that it is up. vLLM sizes its memory at start from the device's free memory
and fails (or shrinks its KV cache) when another process allocates or frees device memory while it profiles
(learner/main.py's _wait_for_colocated_engine says where). No GPU here: the learner's CUDA calls are recorded,
and the coordinator's Control is stood in for by the registry lookup."""

from __future__ import annotations

import threading

import horizonrl.learner.main as learner_main
from horizonrl.core.config import TrainConfig
from horizonrl.core.placement import COLOCATED_ENV
from horizonrl.protocol import ENDPOINT_COLOCATED_ENGINE


def test_a_colocated_learner_waits_for_its_engine_before_it_touches_the_gpu(monkeypatch):
    calls: list[str] = []

    def registered(config, name, timeout_s, stop, what):
        calls.append(f"wait for {name}")
        assert timeout_s >= 600  # a large model's engine start takes minutes
        return "4242"

    monkeypatch.setenv(COLOCATED_ENV, "1")
    monkeypatch.setattr(learner_main, "visible_gpus", lambda environ, count: [0])
    monkeypatch.setattr(learner_main, "local_device_type", lambda device, gpus: "cuda")
    monkeypatch.setattr(learner_main, "_registered", registered)
    monkeypatch.setattr(learner_main.torch.cuda, "set_device", lambda index: calls.append("set_device"))
    monkeypatch.setattr(learner_main.torch.cuda, "set_per_process_memory_fraction",
                        lambda fraction, index: calls.append(f"memory fraction {fraction}"))
    config = TrainConfig.model_validate({"model": {"path": "unused"}, "envs": [{"name": "signpost"}]})
    backend, device = learner_main._backend_and_device(config, 0, threading.Event())
    assert (backend, str(device)) == ("nccl", "cuda:0")
    assert calls == [f"wait for {ENDPOINT_COLOCATED_ENGINE}", "set_device",
                     f"memory fraction {config.resources.learner_memory_fraction}"]
    monkeypatch.delenv(COLOCATED_ENV)  # a learner with a GPU of its own waits for nobody
    calls.clear()
    learner_main._backend_and_device(config, 0, threading.Event())
    assert calls == ["set_device"]
