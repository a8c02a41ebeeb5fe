"""The calling convention between ``RolloutEngine`` and its workers, for the tests' stand-ins of vLLM's client.

The engine calls every worker method through ``horizonrl_call(call, deadline, method, args)`` and reads each
worker's answer from an ``RpcReply`` envelope naming the call (``actors/vllm_worker.py``, ``actors/engine.py``
``_rpc``). A stand-in written against the methods themselves defines ``direct_rpc(method, timeout, args)`` (one
answer per worker) and takes ``collective_rpc = enveloped_rpc``; a test may replace ``direct_rpc`` on an instance.
"""

from __future__ import annotations

from horizonrl.protocol.worker_replies import RpcReply


async def enveloped_rpc(self, method, timeout=None, args=()):
    if method != "horizonrl_call":
        raise AssertionError(f"the engine called {method!r} directly, not through horizonrl_call")
    call, deadline, name, inner = args
    self.deadlines = [*getattr(self, "deadlines", []), (name, deadline, timeout)]
    answers = await self.direct_rpc(name, timeout, tuple(inner))
    return [RpcReply(call, answer).wire() for answer in answers]
