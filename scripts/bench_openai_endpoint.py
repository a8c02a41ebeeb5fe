"""The OpenAI endpoint's overhead: generated tokens/s of agents through it against the same episodes played by
direct engine calls, side by side on one engine, as a ratio.

    python scripts/bench_openai_endpoint.py [--model DIR] [--dtype D] [--sessions 32] [--turns 5] [--max-tokens 32]
        [--rounds 2]

One vLLM engine in this process, with the endpoint in front of it on the same event loop, as in an actor with
``rollout.agent``. Rounds alternate so that both see the same machine:

- **direct**: ``--sessions`` concurrent episodes of ``--turns`` calls, each prompt built as the actor builds its own
  episodes (``ChatTokenizer``: the first prompt, then the generated tokens and the next observation appended), each
  call an ``engine.generate``;
- **openai**: the same episodes played by agents written against the ``openai`` client (``AsyncOpenAI``), one
  session each, in a separate process (as agents are): each call a ``chat.completions.create`` whose history holds
  the replies it got and the same observations;
- **raw**: the same agents on plain aiohttp POSTs of the same bodies: the endpoint's own cost without the
  ``openai`` package's (its request building and answer parsing take CPU from the same cores here).

Every call stops at the end of turn or at ``--max-tokens``, at temperature 1. Tokens/s = generated tokens of a
round / its wall time. Prints one JSON line: the rounds' figures, the CPU seconds of this process and the agents'
per round, the medians, ``ratio`` = openai / direct (the issue's goal: >= 0.9) and ``ratio_raw_http`` = raw / direct.
Default model: the tests' tiny Signpost model (built into .cache/ on first use); ``--model`` SmolLM2's directory
(``python tests/suite_models.py smollm2`` builds .cache/smollm2) for a model whose calls take longer than the HTTP.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FIRST = "Follow the signs to the exit. Actions: go left, go right, go straight.\nA sign points {}."
NEXT = "A sign points {}."
DIRECTIONS = ("left", "right", "straight")


def observation(session: int, turn: int) -> str:
    direction = DIRECTIONS[(session + turn) % 3]
    return FIRST.format(direction) if turn == 0 else NEXT.format(direction)


async def direct_round(engine, chat, sessions: int, turns: int, max_tokens: int) -> tuple[int, float]:
    async def episode(k: int) -> int:
        ids, generated = chat.prompt_ids(observation(k, 0)), 0
        for turn in range(turns):
            gen = await engine.generate(ids, max_tokens=max_tokens, temperature=1.0, top_p=1.0,
                                        stop_token_ids=chat.stop_token_ids)
            generated += len(gen.token_ids)
            ids = ids + gen.token_ids + chat.continuation_ids(observation(k, turn + 1), gen.token_ids)
        return generated

    start, cpu = time.perf_counter(), time.process_time()
    tokens = sum(await asyncio.gather(*(episode(k) for k in range(sessions))))
    return tokens, time.perf_counter() - start, time.process_time() - cpu


async def agents(url: str, sessions: int, turns: int, max_tokens: int, client_kind: str) -> dict:
    """The agents' process: ``sessions`` agents, each in its own session, on the ``openai`` client (``AsyncOpenAI``)
    or, with ``client_kind="raw"``, on plain aiohttp POSTs of the same bodies (the endpoint's own cost without the
    ``openai`` package's). Clients are made before the clock starts (an ``AsyncOpenAI`` costs ~17 ms to make: its
    TLS context)."""
    import aiohttp
    import openai

    async def open_session(http) -> str:
        async with http.post(f"{url}/v1/sessions", json={}) as response:
            return (await response.json())["base_url"]

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=sessions)) as http:
        bases = [await open_session(http) for _ in range(sessions)]
        clients = [openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0) for base in bases] \
            if client_kind == "openai" else []

        async def call(k: int, messages: list) -> tuple[dict, int]:
            if client_kind == "openai":
                reply = await clients[k].chat.completions.create(model="m", messages=messages, max_tokens=max_tokens,
                                                                 temperature=1.0)
                return reply.choices[0].message, reply.usage.completion_tokens
            body = {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 1.0}
            async with http.post(f"{bases[k]}/chat/completions", json=body) as response:
                answer = await response.json()
            return answer["choices"][0]["message"], answer["usage"]["completion_tokens"]

        async def agent(k: int) -> int:
            messages, generated = [{"role": "user", "content": observation(k, 0)}], 0
            for turn in range(turns):
                message, tokens = await call(k, messages)
                generated += tokens
                messages += [message, {"role": "user", "content": observation(k, turn + 1)}]
            async with http.post(f"{bases[k][:-len('/v1')]}/close", json={}) as response:
                await response.read()
            return generated

        start, cpu = time.perf_counter(), time.process_time()
        tokens = sum(await asyncio.gather(*(agent(k) for k in range(sessions))))
        measured = {"tokens": tokens, "wall_s": time.perf_counter() - start, "cpu_s": time.process_time() - cpu}
        for client in clients:
            await client.close()
    return measured


async def endpoint_round(url: str, args: argparse.Namespace, client_kind: str) -> dict:
    """One round of agents in their own process; what it measured, with this process's CPU seconds meanwhile."""
    server_cpu = time.process_time()
    proc = subprocess.Popen([sys.executable, __file__, "--client", url, "--client-kind", client_kind, "--sessions",
                             str(args.sessions), "--turns", str(args.turns), "--max-tokens", str(args.max_tokens)],
                            stdout=subprocess.PIPE, text=True)
    out, _ = await asyncio.to_thread(proc.communicate)
    if proc.returncode != 0:
        raise RuntimeError(f"the agents' process exited with {proc.returncode}")
    return {**json.loads(out.strip().splitlines()[-1]), "server_cpu_s": time.process_time() - server_cpu}


async def bench(args: argparse.Namespace) -> dict:
    from aiohttp import web

    from horizonrl.core.chat import load_chat_tokenizer
    from horizonrl.actors.engine import RolloutEngine
    from horizonrl.actors.openai_endpoint.endpoint import AgentEndpoint, EndpointSettings
    from horizonrl.actors.openai_endpoint.http_app import EndpointApp
    from horizonrl.core.config import EngineConfig

    engine = RolloutEngine.start(args.model, dtype=None, engine=EngineConfig(**({"dtype": args.dtype} if args.dtype
                                                                               else {})), max_model_len=2048, seed=0)
    chat = load_chat_tokenizer(args.model)
    endpoint = AgentEndpoint(engine, chat, EndpointSettings(model_name="m", max_context_tokens=2048,
                                                            default_max_tokens=args.max_tokens),
                             weights=lambda: engine.weights)
    http = EndpointApp(endpoint, open_sessions=True)
    runner = web.AppRunner(http.app(), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = http.public_url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    ways = ("direct", "openai", "raw")
    rounds: dict[str, list[float]] = {way: [] for way in ways}
    # CPU seconds per round: of this process (the engine's client, and with agents the endpoint too) and of the
    # agents' process
    cpu: dict[str, list[tuple[float, float]]] = {way: [] for way in ways}
    try:
        await direct_round(engine, chat, args.sessions, 1, args.max_tokens)  # warm-up: compiled paths, caches
        for _ in range(args.rounds):
            tokens, wall, used = await direct_round(engine, chat, args.sessions, args.turns, args.max_tokens)
            rounds["direct"].append(tokens / wall)
            cpu["direct"].append((used, 0.0))
            for way in ways[1:]:
                measured = await endpoint_round(url, args, way)
                rounds[way].append(measured["tokens"] / measured["wall_s"])
                cpu[way].append((measured["server_cpu_s"], measured["cpu_s"]))
    finally:
        await runner.cleanup()
        engine.shutdown()
    median = {way: statistics.median(values) for way, values in rounds.items()}
    return {"model": args.model, "dtype": args.dtype, "sessions": args.sessions, "turns": args.turns,
            "max_tokens": args.max_tokens, "tokens_per_s": rounds, "cpu_s": cpu,
            "median_tokens_per_s": median, "ratio": median["openai"] / median["direct"],
            "ratio_raw_http": median["raw"] / median["direct"], "endpoint_stats": endpoint.stats.as_dict()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="Hugging Face model directory (default: the tests' tiny model)")
    p.add_argument("--sessions", type=int, default=32)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2, help="rounds of each way, alternating")
    p.add_argument("--dtype", default=None, help="the engine's dtype (default: fp32 on the CPU)")
    p.add_argument("--client", default=None, help=argparse.SUPPRESS)  # the agents' process: the endpoint's URL
    p.add_argument("--client-kind", default="openai", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.client:
        print(json.dumps(asyncio.run(agents(args.client, args.sessions, args.turns, args.max_tokens,
                                            args.client_kind))))
        return 0
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if args.model is None:
        from horizonrl.apps.tiny_model import SIGNPOST_TEST_RECIPE, ensure_tiny_model

        args.model = str(ensure_tiny_model(REPO / ".cache" / "tiny-signpost", **SIGNPOST_TEST_RECIPE))
    result = asyncio.run(bench(args))
    m = result["median_tokens_per_s"]
    print(f"direct {m['direct']:.0f} tokens/s; through the endpoint: openai client {m['openai']:.0f} (ratio "
          f"{result['ratio']:.3f}), plain HTTP {m['raw']:.0f} (ratio {result['ratio_raw_http']:.3f}); "
          f"{args.sessions} sessions x {args.turns} turns", file=sys.stderr)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
