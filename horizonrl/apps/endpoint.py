"""``horizonrl endpoint``: the OpenAI-compatible endpoint alone, in front of one engine, outside a training run.

For trying an agent against the endpoint, recording its episodes, and the tests and the overhead benchmark:
clients open sessions themselves (``POST /v1/sessions``, optionally with one of horizonrl's environments bound
to it), and every ended session's trajectory is appended to ``--out`` in the actor outbox's file format
(``core/outbox.py``: ``read_outbox(DIR)`` reads them back). The agent's own sampling settings apply (no
learner to match). Once listening it prints ``serving the OpenAI endpoint on http://HOST:PORT`` to stderr
(``--port 0`` binds a free port); SIGINT/SIGTERM stop it (sessions still open are not written).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from pathlib import Path

log = logging.getLogger("horizonrl.apps.endpoint")

REAP_INTERVAL_S = 10.0


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="horizonrl endpoint", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0: a free port (printed)")
    p.add_argument("--out", default=None, help="directory for the sessions' trajectories (outbox format)")
    p.add_argument("--max-context-tokens", type=int, default=2048)
    p.add_argument("--max-tokens", type=int, default=256, help="a call's max_tokens when the agent does not say")
    p.add_argument("--tool-call-format", default="hermes", choices=["hermes", "llama3_json"])
    p.add_argument("--tool-prompt", default="hermes", choices=["hermes", "refuse"],
                   help="for templates that cannot render tools: describe them in hermes style, or refuse")
    p.add_argument("--served-model-name", default=None, help="the model's name in /v1/models (default: the "
                   "directory's name)")
    p.add_argument("--api-key-file", default=None, help="a file holding the key clients must send (or set "
                   "HORIZONRL_ENDPOINT_KEY); required off loopback")
    p.add_argument("--kv-cache-gib", type=float, default=1.0)
    p.add_argument("--max-sessions", type=int, default=1024)
    p.add_argument("--idle-timeout", type=float, default=600.0, help="end sessions idle this long (seconds)")
    p.add_argument("--max-body-bytes", type=int, default=4 << 20)
    p.add_argument("--env-settings", default="{}", help='settings of the environments sessions may ask for, as JSON: '
                   '{"babyai": {"observation": "compact"}}')
    return p.parse_args(argv)


def read_api_key(path: str | None) -> str | None:
    if path:
        return Path(path).read_text().strip() or None
    return os.environ.get("HORIZONRL_ENDPOINT_KEY") or None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from horizonrl.actors.openai_endpoint.http_app import check_binding

    api_key = read_api_key(args.api_key_file)
    try:
        check_binding(args.host, api_key)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    asyncio.run(_serve(args, api_key))
    return 0


async def _serve(args: argparse.Namespace, api_key: str | None) -> None:
    from aiohttp import web

    from horizonrl.core.chat import load_chat_tokenizer
    from horizonrl.actors.episode_messages import to_trajectory
    from horizonrl.actors.engine import RolloutEngine
    from horizonrl.actors.openai_endpoint.endpoint import AgentEndpoint, EndpointSettings
    from horizonrl.actors.openai_endpoint.http_app import EndpointApp
    from horizonrl.core.config import EngineConfig
    from horizonrl.core.outbox import framed, segment_path
    from horizonrl.envs.registry import make_env
    from horizonrl.protocol import encode

    env_settings = json.loads(args.env_settings)
    engine = RolloutEngine.start(args.model, dtype=None, engine=EngineConfig(kv_cache_gib=args.kv_cache_gib),
                                 max_model_len=args.max_context_tokens, seed=0)
    out = Path(args.out) if args.out else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    runner = None
    try:
        async def write(session, episode) -> None:
            if session.env is not None:
                await session.env.close()
            if out is None:
                return
            trajectory = to_trajectory(episode, run_id="endpoint", trajectory_id=session.session_id,
                                       group_id=session.group_id, group_size=session.group_size, env=session.env_name,
                                       task_id=session.task_id, actor_id=0, max_turns=min(session.max_turns, 1 << 30),
                                       category="", with_text=True)
            with open(segment_path(out, 0), "ab") as f:
                f.write(framed(encode(trajectory)))

        async def open_env(name: str, task_id: int):
            env = make_env(name, env_settings.get(name, {}))
            return env, await env.reset(task_id)

        settings = EndpointSettings(model_name=args.served_model_name or Path(args.model).name,
                                    max_context_tokens=args.max_context_tokens, default_max_tokens=args.max_tokens,
                                    tool_call_format=args.tool_call_format, tool_prompt=args.tool_prompt,
                                    max_sessions=args.max_sessions, idle_timeout_s=args.idle_timeout)
        endpoint = AgentEndpoint(engine, load_chat_tokenizer(args.model), settings, weights=lambda: engine.weights,
                                 on_finished=write)
        http = EndpointApp(endpoint, api_key=api_key, max_body_bytes=args.max_body_bytes, open_sessions=True,
                           make_env=open_env)
        runner = web.AppRunner(http.app(), access_log=None)  # a line per model call is noise
        await runner.setup()
        await web.TCPSite(runner, args.host, args.port).start()
        port = runner.addresses[0][1]
        http.public_url = f"http://{args.host}:{port}"
        log.info("model %s; tool calls %s (the template %s tools)", settings.model_name, settings.tool_call_format,
                 "renders" if endpoint.renderer.native_tools else f"cannot render: {settings.tool_prompt} prompt for")
        print(f"serving the OpenAI endpoint on {http.public_url}", file=sys.stderr, flush=True)
        await _until_stopped(endpoint)
        log.info("stopping: %d sessions open (not written); %s", len(endpoint.sessions), endpoint.stats.as_dict())
    finally:
        if runner is not None:
            await runner.cleanup()
        engine.shutdown()


async def _until_stopped(endpoint) -> None:
    stopped = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stopped.set)
    while not stopped.is_set():
        try:
            await asyncio.wait_for(stopped.wait(), REAP_INTERVAL_S)
        except asyncio.TimeoutError:
            await endpoint.reap_idle()


if __name__ == "__main__":
    sys.exit(main())
