"""An engine's LoRA adapter (``learner.lora``): the policy is the base model plus one adapter, replaced in place by
each version the learner sends.

vLLM serves LoRA adapters (``enable_lora``; on the CPU through ``PunicaWrapperCPU``): every request names one
(``LoRARequest``) and the worker's adapter manager applies it. The engine serves exactly one, the policy's, under a
fixed name and id, so every request of the run names the same adapter whatever its version. A version arrives over
the weight hub like full weights (a few megabytes instead of the model): the worker writes it as a PEFT adapter
directory and asks its own adapter manager to load it with ``load_inplace`` (vLLM's LRU worker manager then loads the
new tensors, drops the old adapter and activates the new one under the same id, ``lora/worker_manager.py``). That
runs inside the weight RPC, between two engine steps, as a full-weight load does, so the requests in flight and
their version labels are handled exactly as for full weights (engine.py's swap); the prefix cache is keyed by weight
version there too.

The directory: each worker writes its versions to ``<directory>/worker-<rank>``; requests name worker 0's. vLLM
reads a request's path only when the adapter is not loaded in that worker, which after the first version (the
join) happens only if something evicted it: it then loads the newest version from there.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from horizonrl.core.adapter_format import (ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, is_adapter_tensor,
                                           wire_adapter_config)

ADAPTER_NAME = "horizonrl-policy"
ADAPTER_ID = 1  # vLLM's adapter ids start at 1
# The ranks vLLM's LoRAConfig.max_lora_rank accepts (vllm/config/lora.py, MaxLoRARanks); an adapter of a lower rank
# is served by the next one up.
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def served_rank(rank: int) -> int:
    """vLLM's ``max_lora_rank`` for an adapter of ``rank``: the smallest it accepts that is not below it."""
    for allowed in VLLM_MAX_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"LoRA rank {rank} is above vLLM's largest max_lora_rank, {VLLM_MAX_LORA_RANKS[-1]}")


def engine_lora_args(rank: int) -> dict:
    """vLLM engine arguments for serving the policy's adapter of ``rank``: one adapter in a batch, one held."""
    return {"enable_lora": True, "max_lora_rank": served_rank(rank), "max_loras": 1, "max_cpu_loras": 1}


@dataclass(frozen=True)
class AdapterSlot:
    """Where an engine's workers keep the policy's adapter, and the request that names it."""

    directory: str

    @classmethod
    def create(cls) -> "AdapterSlot":
        return cls(tempfile.mkdtemp(prefix="horizonrl-lora-"))

    def worker_directory(self, rank: int) -> str:
        return os.path.join(self.directory, f"worker-{rank}")

    def request(self):
        """The ``LoRARequest`` every generation carries (never ``load_inplace``: that would reload it every step)."""
        from vllm.lora.request import LoRARequest

        return LoRARequest(ADAPTER_NAME, ADAPTER_ID, self.worker_directory(0))

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


def write_adapter_version(directory: str | Path, named_tensors) -> dict[str, list[int]]:
    """One received version as a PEFT adapter directory (engine convention: the scaling is in B, alpha = r);
    returns its tensors' shapes. The tensors are copied out of the receive buffers (views into one bucket, which
    safetensors would refuse as shared memory, and which the next version overwrites). Files are replaced whole."""
    from safetensors.torch import save_file

    tensors = {}
    for name, tensor in named_tensors:
        if not is_adapter_tensor(name):
            raise ValueError(f"an adapter version holds {name!r}, which is not a LoRA factor: a version is either "
                             "an adapter or full weights, never both")
        tensors[name] = tensor.detach().to("cpu").clone()
    if not tensors:
        raise ValueError("an adapter version with no tensors")
    shapes = {name: list(tensor.shape) for name, tensor in tensors.items()}
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for file, write in ((ADAPTER_WEIGHTS_FILE, lambda p: save_file(tensors, p, metadata={"format": "pt"})),
                        (ADAPTER_CONFIG_FILE, lambda p: Path(p).write_text(json.dumps(wire_adapter_config(shapes))))):
        partial = directory / (file + ".tmp")
        write(str(partial))
        os.replace(partial, directory / file)
    return shapes


def load_adapter_version(worker, named_tensors, slot: AdapterSlot, rank: int) -> None:
    """Inside the vLLM worker: write the version to this worker's directory and load it in place of the last one
    (the module docstring). A refused load raises."""
    from vllm.lora.request import LoRARequest

    directory = slot.worker_directory(rank)
    write_adapter_version(directory, named_tensors)
    worker.add_lora(LoRARequest(ADAPTER_NAME, ADAPTER_ID, directory, load_inplace=True))
    if ADAPTER_ID not in worker.list_loras():
        raise RuntimeError(f"vLLM did not keep the adapter loaded from {directory}")
