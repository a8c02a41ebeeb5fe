"""The OpenAI endpoint's overhead: generated tokens/s of agents through it against the same episodes played by
direct engine calls, side by side on one engine, as a ratio.

    python scripts/bench_openai_endpoint.py [--model DIR] [--sessions 32] [--turns 5] [--max-tokens 32] [--rounds 2]

One vLLM engine in this process, with the endpoint in front of it on the same event loop, as in an actor with
``rollout.agent``. Rounds alternate so that both see the same machine:

- **direct**: ``--sessions`` concurrent episodes of ``--turns`` calls, each prompt built as the actor builds its own
  episodes (``ChatTokenizer``: the first prompt, then the generated tokens and the next observation appended), each
  call an ``engine.generate``;
- **endpoint**: the same episodes played by agents written against the ``openai`` client (``AsyncOpenAI``), one
  session each, in a separate process (as agents are): each call a ``chat.completions.create`` whose history holds
  the replies it got and the same observations.

Every call stops at the end of turn or at ``--max-tokens``, at temperature 1. Tokens/s = generated tokens of a
round / its wall time. Prints one JSON line: the rounds' figures, the medians and ``ratio`` = endpoint / direct
(the issue's goal: >= 0.9). Default model: the tests' tiny Signpost model (built into .cache/ on first use).
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

    start = time.perf_counter()
    tokens = sum(await asyncio.gather(*(episode(k) for k in range(sessions))))
    return tokens, time.perf_counter() - start


async def agents(url: str, sessions: int, turns: int, max_tokens: int) -> dict:
    """The client process: ``sessions`` agents on the openai client, each in its own session."""
    import openai
    import urllib.request

    def open_session() -> str:
        request = urllib.request.Request(f"{url}/v1/sessions", data=b"{}", method="POST")
        with urllib.request.urlopen(request, timeout=60) as response:
            return json.loads(response.read())["base_url"]

    bases = [open_session() for _ in range(sessions)]

    async def agent(k: int) -> int:
        client = openai.AsyncOpenAI(base_url=bases[k], api_key="unused", max_retries=0)
        messages, generated = [{"role": "user", "content": observation(k, 0)}], 0
        for turn in range(turns):
            reply = await client.chat.completions.create(model="m", messages=messages, max_tokens=max_tokens,
                                                         temperature=1.0)
            generated += reply.usage.completion_tokens
            messages += [reply.choices[0].message, {"role": "user", "content": observation(k, turn + 1)}]
        request = urllib.request.Request(f"{bases[k][:-len('/v1')]}/close", data=b"{}", method="POST")
        await asyncio.to_thread(lambda: urllib.request.urlopen(request, timeout=60).read())
        await client.close()
        return generated

    start = time.perf_counter()
    tokens = sum(await asyncio.gather(*(agent(k) for k in range(sessions))))
    return {"tokens": tokens, "wall_s": time.perf_counter() - start}


def endpoint_round(url: str, sessions: int, turns: int, max_tokens: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, "--client", url, "--sessions", str(sessions), "--turns",
                             str(turns), "--max-tokens", str(max_tokens)], stdout=subprocess.PIPE, text=True)


async def bench(args: argparse.Namespace) -> dict:
    from aiohttp import web

    from horizonrl.actors.actor import load_chat_tokenizer
    from horizonrl.actors.engine import RolloutEngine
    from horizonrl.actors.openai_endpoint.endpoint import AgentEndpoint, EndpointSettings
    from horizonrl.actors.openai_endpoint.http_app import EndpointApp
    from horizonrl.core.config import EngineConfig

    engine = RolloutEngine.start(args.model, dtype=None, engine=EngineConfig(), max_model_len=2048, seed=0)
    chat = load_chat_tokenizer(args.model)
    endpoint = AgentEndpoint(engine, chat, EndpointSettings(model_name="m", max_context_tokens=2048,
                                                            default_max_tokens=args.max_tokens),
                             weights=lambda: engine.weights)
    http = EndpointApp(endpoint, open_sessions=True)
    runner = web.AppRunner(http.app(), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = http.public_url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    rounds: dict[str, list[float]] = {"direct": [], "endpoint": []}
    try:
        await direct_round(engine, chat, args.sessions, 1, args.max_tokens)  # warm-up: compiled paths, caches
        for _ in range(args.rounds):
            tokens, wall = await direct_round(engine, chat, args.sessions, args.turns, args.max_tokens)
            rounds["direct"].append(tokens / wall)
            proc = endpoint_round(url, args.sessions, args.turns, args.max_tokens)
            out, _ = await asyncio.to_thread(proc.communicate)
            if proc.returncode != 0:
                raise RuntimeError(f"the agents' process exited with {proc.returncode}")
            measured = json.loads(out.strip().splitlines()[-1])
            rounds["endpoint"].append(measured["tokens"] / measured["wall_s"])
    finally:
        await runner.cleanup()
        engine.shutdown()
    direct, through = statistics.median(rounds["direct"]), statistics.median(rounds["endpoint"])
    return {"model": args.model, "sessions": args.sessions, "turns": args.turns, "max_tokens": args.max_tokens,
            "rounds": rounds, "direct_tokens_per_s": direct, "endpoint_tokens_per_s": through,
            "ratio": through / direct, "endpoint_stats": endpoint.stats.as_dict()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="Hugging Face model directory (default: the tests' tiny model)")
    p.add_argument("--sessions", type=int, default=32)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2, help="rounds of each way, alternating")
    p.add_argument("--client", default=None, help=argparse.SUPPRESS)  # the agents' process: the endpoint's URL
    args = p.parse_args(argv)
    if args.client:
        print(json.dumps(asyncio.run(agents(args.client, args.sessions, args.turns, args.max_tokens))))
        return 0
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if args.model is None:
        from horizonrl.apps.tiny_model import SIGNPOST_TEST_RECIPE, ensure_tiny_model

        args.model = str(ensure_tiny_model(REPO / ".cache" / "tiny-signpost", **SIGNPOST_TEST_RECIPE))
    result = asyncio.run(bench(args))
    print(f"endpoint {result['endpoint_tokens_per_s']:.0f} tokens/s, direct {result['direct_tokens_per_s']:.0f} "
          f"tokens/s: ratio {result['ratio']:.3f} ({args.sessions} sessions x {args.turns} turns)", file=sys.stderr)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
