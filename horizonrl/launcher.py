"""The launcher: start every process of a run from one config, watch them, stop them.

It only starts, watches and stops: each role is a separate program
(``horizonrl coordinator|buffer|learner|actor --config run/config.yaml``) that can also
be started by hand for debugging. The launcher resolves free ports, writes the
resolved config next to the logs, streams progress lines and warnings to the terminal
(full logs go to ``<output_dir>/logs/``), and on Ctrl-C, SIGTERM or any process's
failure stops all of them — each in its own process group, so the engine processes
vLLM spawns go too — and exits non-zero.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from horizonrl.core.config import ConfigError, TrainConfig, dump_config
from horizonrl.protocol.transport import free_ports, is_loopback
from horizonrl.core.runtime import StopFlag

log = logging.getLogger("horizonrl.launcher")

TERMINATE_GRACE_S = 20.0
ACTOR_STOP_S = 30.0  # an actor lets its last sends be acknowledged (10 s), then shuts its engine down
# Lines of a child's output shown on the terminal; everything goes to its log file.
_SHOWN = ("step ", "ERROR", "WARNING", "Traceback", "Error", "horizonrl.", "error:")


def resolve_ports(config: TrainConfig) -> TrainConfig:
    """A copy of ``config`` with every port that is 0 replaced by a free one."""
    net = config.network.model_dump()
    keys = ("control_port", "report_port", "trajectory_port", "batch_port", "weight_port", "dist_port")
    fixed = {net[key] for key in keys if net[key]}
    candidates = iter(p for p in free_ports(2 * len(keys), config.network.host) if p not in fixed)
    for key in keys:
        if not net[key]:
            net[key] = next(candidates)
    return config.model_copy(update={"network": type(config.network).model_validate(net)})


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    essential: bool  # the run is over when every essential child has exited 0
    threads: list[threading.Thread] = field(default_factory=list)

    @property
    def role(self) -> str:
        return self.name.split("-")[0]


def _pump(stream: IO[bytes], log_file: IO[bytes], name: str, show_all: bool) -> None:
    for raw in iter(stream.readline, b""):
        log_file.write(raw)
        log_file.flush()
        line = raw.decode(errors="replace").rstrip()
        if show_all or any(tag in line for tag in _SHOWN):
            print(f"[{name}] {line}" if not line.startswith("step ") else line, flush=True)
    stream.close()


class Launcher:
    def __init__(self, config: TrainConfig, config_path: Path, *, tensorboard: bool = False) -> None:
        self.config = config
        self.config_path = config_path
        self.tensorboard = tensorboard
        self.children: list[Child] = []
        self.log_dir = config.output_dir / "logs"

    def spawn(self, name: str, args: list[str], *, essential: bool, env: dict[str, str] | None = None,
              show_all: bool = False) -> Child:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_file = open(self.log_dir / f"{name}.log", "ab")
        proc = subprocess.Popen(
            args,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            start_new_session=True,  # its own process group: stopping it stops what it spawned
        )
        child = Child(name, proc, essential)
        t = threading.Thread(target=_pump, args=(proc.stdout, log_file, name, show_all), daemon=True)
        t.start()
        child.threads.append(t)
        self.children.append(child)
        log.info("started %s (pid %d)", name, proc.pid)
        return child

    def role_args(self, role: str, index: int | None = None) -> list[str]:
        args = [sys.executable, "-m", "horizonrl", role, "--config", str(self.config_path)]
        return args + (["--index", str(index)] if index is not None else [])

    def start_all(self) -> None:
        cfg = self.config
        self.spawn("coordinator", self.role_args("coordinator"), essential=True)
        self.spawn("buffer", self.role_args("buffer"), essential=False)
        world = cfg.learner.num_ranks
        for rank in range(world):
            env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                   "MASTER_ADDR": cfg.network.host, "MASTER_PORT": str(cfg.network.dist_port)}
            self.spawn(f"learner-{rank}", self.role_args("learner"), essential=True, env=env)
        for i in range(cfg.rollout.num_actors):
            self.spawn(f"actor-{i}", self.role_args("actor", i), essential=False)
        if self.tensorboard:
            self.start_tensorboard()

    def start_tensorboard(self) -> None:
        port = self.config.monitor.tensorboard_port
        tb = [sys.executable, "-m", "tensorboard.main", "--logdir", str(self.config.output_dir / "tensorboard"),
              "--host", "127.0.0.1", "--port", str(port)]
        self.spawn("tensorboard", tb, essential=False)
        print(f"TensorBoard: http://127.0.0.1:{port}/", flush=True)

    def watch(self, stop: StopFlag) -> int:
        """Wait until the essential processes finish (0), one fails, or we are stopped."""
        while True:
            if stop:
                log.warning("stopping the run (%s)", stop.signal_name or "stop requested")
                return 130
            for child in self.children:
                rc = child.proc.poll()
                if rc is None:
                    continue
                if rc != 0:
                    log.error("%s exited with code %d; stopping the run (see %s)", child.name, rc,
                              self.log_dir / f"{child.name}.log")
                    return 1
                learners_done = all(c.proc.poll() == 0 for c in self.children if c.name.startswith("learner"))
                if not child.essential and not learners_done and child.name != "tensorboard":
                    log.error("%s exited before the run finished; stopping the run", child.name)
                    return 1
            if all(c.proc.poll() == 0 for c in self.children if c.essential):
                return 0
            time.sleep(0.2)

    def stop_all(self, stop: StopFlag | None = None) -> None:
        """Stop in order, so nothing is lost and a checkpoint is written: first the actors (no new
        episodes; what they sent gets acknowledged) and the learner (finishes or abandons its step,
        saves), within ``monitor.stop_timeout_s``; then the buffer and the coordinator. A second
        stop signal (Ctrl-C again) kills everything at once. Whatever is left is killed, with the
        processes it spawned (each child leads its own process group)."""
        # (roles, how long each may take) per phase; the actors' part of the first is short: they
        # only let their last sends be acknowledged.
        phases = [{"actor": ACTOR_STOP_S, "learner": self.config.monitor.stop_timeout_s},
                  {"buffer": TERMINATE_GRACE_S, "coordinator": TERMINATE_GRACE_S, "tensorboard": TERMINATE_GRACE_S}]
        for grace in phases:
            members = [c for c in self.children if c.role in grace and c.proc.poll() is None]
            for child in members:
                _signal_group(child.proc.pid, signal.SIGTERM)
            start = time.monotonic()
            while time.monotonic() - start < max(grace.values(), default=0):
                if stop is not None and stop.count >= 2:
                    log.warning("second stop signal: killing every process now")
                    break
                for child in members:
                    if child.proc.poll() is None and time.monotonic() - start > grace[child.role]:
                        log.warning("%s did not stop within %.0f s: killing it", child.name, grace[child.role])
                        _signal_group(child.proc.pid, signal.SIGKILL)
                if all(c.proc.poll() is not None for c in members):
                    break
                time.sleep(0.1)
            if stop is not None and stop.count >= 2:
                break
        for child in self.children:
            # Kill the group even if the leader exited: engine processes may linger.
            _signal_group(child.proc.pid, signal.SIGKILL)
            child.proc.wait()
        for child in self.children:
            for t in child.threads:
                t.join(timeout=5)


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # the child leads its own group (start_new_session), so pgid == pid
    except ProcessLookupError:
        pass


def resolve_resume_setting(config: TrainConfig) -> TrainConfig:
    """``learner.resume=auto`` -> the newest complete checkpoint's directory (or no resume when there
    is none), fixed once here so that every process resumes from the same step."""
    from horizonrl.core.run_dirs import resolve_resume

    if config.learner.resume is None:
        return config
    path = resolve_resume(config.learner.resume, config.output_dir)
    if path is None:
        log.info("resume=auto: no checkpoint in %s yet; starting a fresh run", config.output_dir)
    else:
        print(f"resuming from {path}", flush=True)
    learner = config.learner.model_copy(update={"resume": None if path is None else str(path)})
    return config.model_copy(update={"learner": learner})


RUN_ID_FILE = "run_id"


def resolve_run_identity(config: TrainConfig, resuming: bool) -> TrainConfig:
    """The run's id: new for a new run, the one in ``<output_dir>/run_id`` when it resumes.

    A new run refuses a directory that holds another run's state (its log, checkpoints, actors'
    outboxes would be mixed with this one's); resuming needs ``resume=auto|PATH``."""
    id_file = config.output_dir / RUN_ID_FILE
    if resuming and id_file.is_file():
        run_id = id_file.read_text().strip()
    else:
        leftovers = [name for name in (RUN_ID_FILE, "checkpoints", "buffer_wal", "actors")
                     if (config.output_dir / name).exists()]
        if leftovers and not resuming:
            raise ConfigError(f"{config.output_dir} holds a previous run ({', '.join(leftovers)}): continue it with "
                              "resume=auto, or choose a new run.output_dir")
        run_id = uuid.uuid4().hex[:16]
        config.output_dir.mkdir(parents=True, exist_ok=True)
        id_file.write_text(run_id + "\n")
    return config.model_copy(update={"run": config.run.model_copy(update={"run_id": run_id})})


def resolve_vocab_size(config: TrainConfig) -> TrainConfig:
    """``model.vocab_size`` from the model's config.json (the buffer rejects token ids outside it)."""
    if config.model.vocab_size is not None:
        return config
    path = Path(config.model.path) / "config.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        log.warning("cannot read %s: token ids are not checked against the vocabulary", path)
        return config
    vocab = data.get("vocab_size") or data.get("text_config", {}).get("vocab_size")
    if not isinstance(vocab, int):
        return config
    return config.model_copy(update={"model": config.model.model_copy(update={"vocab_size": vocab})})


def prepare_run(config: TrainConfig) -> tuple[TrainConfig, Path]:
    """Resolve ports, resume, run id and vocabulary; write ``<output_dir>/config.yaml``, the file every
    process reads."""
    if config.network.curve_keys_dir is None and not is_loopback(config.network.host):
        raise ConfigError(f"network.host {config.network.host} is not loopback: CurveZMQ keys are required "
                          "(make them with `horizonrl keys DIR`, then network.curve_keys_dir=DIR)")
    resuming = config.learner.resume is not None
    config = resolve_ports(config)
    config = resolve_resume_setting(config)
    config = resolve_run_identity(config, resuming)
    config = resolve_vocab_size(config)
    path = config.output_dir / "config.yaml"
    path.write_text(dump_config(config))
    return config, path


def launch(config: TrainConfig, *, tensorboard: bool = False) -> int:
    """Run training to the end; returns the exit code (0 on success)."""
    config, path = prepare_run(config)
    launcher = Launcher(config, path, tensorboard=tensorboard)
    stop = StopFlag().install()
    print(f"run {config.run.name}: {config.rollout.num_actors} actors, {config.learner.num_ranks} learner rank(s), "
          f"{config.learner.total_steps} steps; logs in {launcher.log_dir}", flush=True)
    rc = 1
    try:
        launcher.start_all()
        rc = launcher.watch(stop)
        if rc == 130:
            print("stopping: actors start no new episodes, the learner saves a checkpoint (Ctrl-C again to force)",
                  flush=True)
    finally:
        launcher.stop_all(stop)
    return rc
