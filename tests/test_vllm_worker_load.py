"""The engine worker's load path where vLLM is absent: a GPU machine running scripts/gpu_check.py's colocated check
drives actors/vllm_worker.py's extension with a transformers model and no vLLM installed. The extension must take
the reload path there without importing vLLM (it once asked vLLM which platform it ran on, and that check failed
on the H200 with "No module named 'vllm'"). The vLLM-CPU in-place path itself is tested with real engines in
tests/integration/test_engine_weights.py."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

WITHOUT_VLLM = textwrap.dedent("""
    import sys
    sys.modules["vllm"] = None  # import vllm now raises ImportError, as on a machine without it
    import torch
    from horizonrl.actors.vllm_worker import WeightReceiverExtension, packed_cpu_layers

    model = torch.nn.Linear(3, 2)
    assert packed_cpu_layers(model) == [], "a model vLLM-CPU never packed has no packed layers"
    reloaded = []

    class TransformersWorker(WeightReceiverExtension):
        class model_runner:
            @staticmethod
            def get_model():
                return model

        def reload_weights(self, weights_iterator, is_checkpoint_format=True):
            params = dict(model.named_parameters())
            with torch.no_grad():
                for name, tensor in weights_iterator:
                    params[name].copy_(tensor)
                    reloaded.append(name)

    worker = TransformersWorker()
    worker._horizonrl_load([("weight", torch.full((2, 3), 7.0)), ("bias", torch.zeros(2))])
    assert worker._horizonrl_load_path == "reload", worker._horizonrl_load_path
    assert reloaded == ["weight", "bias"], reloaded
    assert bool((model.weight == 7.0).all()), model.weight
    print("ok")
""")


def test_without_vllm_the_extension_loads_by_reload_and_imports_no_vllm():
    done = subprocess.run([sys.executable, "-c", WITHOUT_VLLM], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok")
