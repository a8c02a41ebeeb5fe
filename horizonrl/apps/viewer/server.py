"""``horizonrl view RUN_DIR``: the aiohttp application and the command's main loop.

Routes (all GET; the server only reads):
  /                        episodes, newest first, filtered by query parameters (index.EpisodeFilter)
  /api/episodes            the same as JSON; ``after=SEQ`` gives only the newer ones (the list page polls it)
  /episode/KEY             one episode, turn by turn (``?turn=k``)
  /api/episode/KEY         its record line
  /frame/KEY/K.png         BabyAI's grid at position K (replay.py)
  /steps, /step/N          learner steps and the recorded episodes each trained on
  /compare                 tasks recorded at several policy versions; ``?env=&task=`` (``&a=&b=``) side by side
Each request first reads what was appended to the record files since the last one (at most every
half second), so pages show a run that is still going.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import signal
import sys
from pathlib import Path
from typing import Any, Callable

from aiohttp import web

from horizonrl.core.episode_records import PART_GLOB
from horizonrl.apps.viewer import assets, pages
from horizonrl.apps.viewer.index import EpisodeFilter, EpisodeIndex, Entry
from horizonrl.apps.viewer.replay import Replayer, parse_env_settings
from horizonrl.core.run_dirs import RunDir

log = logging.getLogger("horizonrl.apps.viewer")

DEFAULT_PORT = 8787
SHUTDOWN_TIMEOUT_S = 5.0  # open connections (a polling page) get this long to finish at exit
VIEWER = web.AppKey("viewer", "Viewer")
# Pages and scripts come only from this server: a record's text can never load or run anything.
SECURITY_HEADERS = {"Content-Security-Policy": "default-src 'self'; img-src 'self'; object-src 'none'",
                    "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"}


class NoEpisodesError(Exception):
    """The directory holds no recorded episodes; the message says how to get some."""


def find_episodes_dir(run_dir: Path) -> Path:
    """``RUN_DIR/episodes``, or RUN_DIR itself when it holds record files (``horizonrl eval --record DIR``)."""
    if RunDir(run_dir).episode_records.is_dir():
        return RunDir(run_dir).episode_records
    if run_dir.is_dir() and any(run_dir.glob(PART_GLOB)):
        return run_dir
    if not run_dir.exists():
        raise NoEpisodesError(f"{run_dir} does not exist")
    raise NoEpisodesError(
        f"{run_dir} has no episodes directory ({RunDir(run_dir).episode_records}) and no {PART_GLOB} files. A "
        "training run writes it when monitor.record_fraction > 0 (the default records 10% of groups); `horizonrl "
        "eval ... --record DIR` records evaluation episodes.")


class Viewer:
    """What the handlers share: the index, the replayer, the label of the run."""

    def __init__(self, episodes_dir: Path, env_settings: dict[str, dict[str, Any]] | None = None) -> None:
        self.episodes_dir = episodes_dir
        # config.yaml sits beside episodes/ in a run directory
        run_dir = episodes_dir.parent if RunDir(episodes_dir.parent).episode_records == episodes_dir else episodes_dir
        self.run_label = str(run_dir)
        self.index = EpisodeIndex(episodes_dir)
        self.replayer = Replayer(run_dir, env_settings)

    def entry(self, request: web.Request) -> Entry:
        entry = self.index.by_key.get(request.match_info["key"])
        if entry is None:
            message = f"no episode {request.match_info['key']!r} is recorded here"
            raise web.HTTPNotFound(text=pages.message_page("No such episode", message, self.run_label),
                                   content_type="text/html")
        return entry


def _viewer(request: web.Request) -> Viewer:
    return request.app[VIEWER]


def _html(text: str) -> web.Response:
    return web.Response(text=text, content_type="text/html", charset="utf-8")


def _int_param(request: web.Request, name: str, default: int) -> int:
    try:
        return int(request.query.get(name, default))
    except ValueError:
        raise web.HTTPBadRequest(text=f"{name} must be a whole number") from None


@web.middleware
async def _follow_the_run(request: web.Request, handler: Callable) -> web.StreamResponse:
    _viewer(request).index.refresh()
    response = await handler(request)
    response.headers.update(SECURITY_HEADERS)
    return response


async def list_handler(request: web.Request) -> web.Response:
    v = _viewer(request)
    flt = EpisodeFilter.from_query(request.query)
    return _html(pages.list_page(v.index, flt, max(0, _int_param(request, "offset", 0)), v.run_label))


async def api_episodes(request: web.Request) -> web.Response:
    """Matching episodes newer than ``after`` (all by default), newest first, at most a page of them:
    as table rows (``format=rows``, what the list page inserts) or as summaries."""
    v = _viewer(request)
    flt = EpisodeFilter.from_query(request.query)
    if flt.errors:
        return web.json_response({"errors": flt.errors}, status=400)
    after = _int_param(request, "after", -1)
    total = len(v.index.select(flt))
    new = v.index.select(flt, after_seq=after)[: pages.PAGE_SIZE]
    body: dict[str, Any] = {"latest": v.index.latest_seq, "indexed": len(v.index.entries), "total": total}
    if request.query.get("format") == "rows":
        body["rows"] = [pages.episode_row(e, v.index) for e in new]
    else:
        body["episodes"] = [summary(e, v.index) for e in new]
    return web.json_response(body)


def summary(entry: Entry, index: EpisodeIndex) -> dict[str, Any]:
    r = entry.record
    keys = ("trajectory_id", "group_id", "env", "task_id", "category", "success", "score", "reward", "num_turns",
            "max_turns", "stop_reason", "failure", "evaluation")
    return {"key": entry.key, "seq": entry.seq, **{k: r.get(k) for k in keys}, "versions": entry.versions,
            "trained_step": index.trained_step(entry)}


async def api_episode(request: web.Request) -> web.Response:
    v = _viewer(request)
    entry = v.entry(request)
    return web.json_response({**entry.record, "key": entry.key, "trained_step": v.index.trained_step(entry)})


async def episode_handler(request: web.Request) -> web.Response:
    v = _viewer(request)
    entry = v.entry(request)
    replay = await v.replayer.replay(entry.key, entry.record)
    return _html(pages.episode_page(entry, v.index, replay, _int_param(request, "turn", 0), v.run_label))


async def frame_handler(request: web.Request) -> web.Response:
    v = _viewer(request)
    entry = v.entry(request)
    position = int(request.match_info["position"])
    replay = await v.replayer.replay(entry.key, entry.record)
    if replay is None or position >= len(replay.frames):
        raise web.HTTPNotFound(text=f"no frame {position} for {entry.key}: "
                                    f"{replay.problem if replay else 'this environment is not drawn'}")
    # A frame of a recorded episode never changes.
    return web.Response(body=replay.frames[position], content_type="image/png",
                        headers={"Cache-Control": "max-age=86400"})


async def steps_handler(request: web.Request) -> web.Response:
    v = _viewer(request)
    return _html(pages.steps_page(v.index, v.run_label))


async def step_handler(request: web.Request) -> web.Response:
    v = _viewer(request)
    return _html(pages.step_page(int(request.match_info["step"]), v.index, v.run_label))


async def compare_handler(request: web.Request) -> web.Response:
    v = _viewer(request)
    env, task = request.query.get("env"), request.query.get("task")
    if not env or task is None:
        return _html(pages.compare_index_page(v.index, v.run_label))
    # the query's task is text; the records' ids are numbers (or whatever the environment uses)
    task_id = next((t for e, t in v.index.by_task if e == env and str(t) == task), task)
    pair = v.index.early_and_late(env, task_id)
    chosen = {e.key: e for e in v.index.task_episodes(env, task_id)}
    if pair is None and not (request.query.get("a") in chosen and request.query.get("b") in chosen):
        raise web.HTTPNotFound(text=pages.message_page(
            "Nothing to compare", f"{env} task {task} has no two episodes from different policy versions "
            "recorded here (yet)", v.run_label), content_type="text/html")
    left = chosen.get(request.query.get("a", ""), pair[0] if pair else None)
    right = chosen.get(request.query.get("b", ""), pair[1] if pair else None)
    replays = (await v.replayer.replay(left.key, left.record), await v.replayer.replay(right.key, right.record))
    return _html(pages.compare_page(v.index, env, task_id, left, right, replays, _int_param(request, "turn", 0),
                                    v.run_label))


def _static(text: str, content_type: str) -> Callable:
    async def handler(request: web.Request) -> web.Response:
        return web.Response(text=text, content_type=content_type, charset="utf-8",
                            headers={"Cache-Control": "no-cache"})
    return handler


def make_app(episodes_dir: Path, env_settings: dict[str, dict[str, Any]] | None = None) -> web.Application:
    viewer = Viewer(episodes_dir, env_settings)
    viewer.index.refresh(force=True)
    app = web.Application(middlewares=[_follow_the_run])
    app[VIEWER] = viewer
    app.router.add_get("/", list_handler)
    app.router.add_get("/api/episodes", api_episodes)
    app.router.add_get("/api/episode/{key}", api_episode)
    app.router.add_get("/episode/{key}", episode_handler)
    app.router.add_get(r"/frame/{key}/{position:\d+}.png", frame_handler)
    app.router.add_get("/steps", steps_handler)
    app.router.add_get(r"/step/{step:\d+}", step_handler)
    app.router.add_get("/compare", compare_handler)
    app.router.add_get("/static/viewer.css", _static(assets.STYLE, "text/css"))
    app.router.add_get("/static/viewer.js", _static(assets.SCRIPT, "text/javascript"))

    async def close_replays(app: web.Application) -> None:
        await app[VIEWER].replayer.close()

    app.on_cleanup.append(close_replays)
    return app


def _url(host: str, port: int) -> str:
    try:
        if ipaddress.ip_address(host).version == 6:
            return f"http://[{host}]:{port}/"
    except ValueError:
        pass  # a name, not an address
    return f"http://{host}:{port}/"


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


async def serve(episodes_dir: Path, host: str, port: int, env_settings: dict[str, dict[str, Any]] | None = None,
                ready: Callable[[str], None] | None = None) -> None:
    """Serve until SIGINT or SIGTERM; ``ready(url)`` is called once the socket listens."""
    app = make_app(episodes_dir, env_settings)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port, shutdown_timeout=SHUTDOWN_TIMEOUT_S)
        await site.start()
        bound_host, bound_port = runner.addresses[0][:2]
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        if ready is not None:
            ready(_url(host if host not in ("", "0.0.0.0", "::") else bound_host, bound_port))
        await stop.wait()  # a server: it runs until it is told to stop
    finally:
        await runner.cleanup()


def main(run_dir: Path, host: str = "127.0.0.1", port: int = DEFAULT_PORT,
         env_settings: list[str] | None = None) -> int:
    try:
        settings = parse_env_settings(env_settings or [])
        episodes_dir = find_episodes_dir(run_dir)
    except (ValueError, NoEpisodesError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if not _is_loopback(host):
        print(f"warning: serving on {host}: anyone who can reach this machine can read the episodes", file=sys.stderr)

    def ready(url: str) -> None:
        print(f"horizonrl view: {episodes_dir} at {url} (Ctrl-C to stop)", flush=True)

    try:
        asyncio.run(serve(episodes_dir, host, port, settings, ready))
    except KeyboardInterrupt:  # Ctrl-C while the records were still being read, before the handlers
        return 130
    except OSError as exc:  # the port is taken, the address is not this machine's
        print(f"error: cannot listen on {host}:{port}: {exc} (--port 0 picks a free port)", file=sys.stderr)
        return 1
    return 0
