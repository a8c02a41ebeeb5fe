"""ZeroMQ sockets with the project's conventions, for every process boundary.

Semantics (the same everywhere):
- PUSH/PULL for reports. A PUSH socket queues at most ``hwm`` messages per peer; beyond
  that ``send`` blocks (or, with a send timeout, raises ``zmq.Again``), which is how
  backpressure reaches the producer.
- DEALER/ROUTER with acknowledgements for trajectories: the buffer acknowledges each one
  once it is durable, and the actor keeps it until then (resending on a timeout), so a
  trajectory lost in a dead connection or a crashed buffer is sent again.
- PUB/SUB for control. SUB is lossy by design (a slow or late subscriber misses
  messages), so the publisher republishes the whole current state periodically and
  every control message is self-contained.
- ROUTER/DEALER for request/reply (learner <-> buffer), so a timed-out request never
  wedges a REQ state machine.
Sockets close with ``linger=0``: shutting down never waits for unsent messages. A receiving
socket gets ``max_message_bytes`` as ZMQ's MAXMSGSIZE: a peer sending a bigger message is
disconnected before the message is ever read whole.

Addresses: the coordinator's (``network.host``, its two ports) is the one every process is given.
Every other process binds its own (:func:`bind_endpoint`: a configured port, or any free one) on
its own host, advertises it as :func:`advertise_host` says, and registers it with the coordinator
(``protocol/registry.py``). On one machine all of it is loopback.

Security: endpoints are ``tcp://127.0.0.1:PORT`` unless configured otherwise. Off loopback
every socket uses CurveZMQ (encryption, and the servers accept only clients holding the run's
client key): :class:`WireSecurity`, keys made by ``horizonrl keys DIR``.
"""

from __future__ import annotations

import ipaddress
import os
import random
import socket
from pathlib import Path

import zmq

DEFAULT_HWM = 64


def make_socket(context: zmq.Context, kind: int, *, hwm: int = DEFAULT_HWM, max_message_bytes: int | None = None,
                security: "WireSecurity | None" = None, server: bool = False) -> zmq.Socket:
    """A socket with the conventions above. ``server``: this side binds (it holds the server key)."""
    sock = context.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    if max_message_bytes is not None:
        sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    if security is not None:
        security.apply(sock, server)
    if kind == zmq.SUB:
        sock.setsockopt(zmq.SUBSCRIBE, b"")
    return sock


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: not known to stay on this machine


KEY_NAMES = ("server", "client")


def generate_keys(directory: str | Path) -> Path:
    """Write a CurveZMQ server and client key pair into ``directory`` (created 0700; secret files 0600)."""
    import zmq.auth

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    for name in KEY_NAMES:
        public, secret = zmq.auth.create_certificates(str(directory), name)
        os.chmod(secret, 0o600)
        os.chmod(public, 0o600)
    # What the servers' authenticator admits: the client's public key alone.
    allowed = directory / "allowed"
    allowed.mkdir(exist_ok=True)
    (allowed / "client.key").write_bytes((directory / "client.key").read_bytes())
    return directory


class WireSecurity:
    """CurveZMQ for every socket of a process: servers encrypt and admit only the run's client key
    (a ZAP authenticator on the context); clients encrypt and check the server's key."""

    def __init__(self, context: zmq.Context, keys_dir: str | Path) -> None:
        import zmq.auth
        from zmq.auth.thread import ThreadAuthenticator

        keys_dir = Path(keys_dir)
        missing = [f"{n}{suffix}" for n in KEY_NAMES for suffix in (".key", ".key_secret")
                   if not (keys_dir / f"{n}{suffix}").is_file()]
        missing += [] if (keys_dir / "allowed" / "client.key").is_file() else ["allowed/client.key"]
        if missing:
            raise FileNotFoundError(f"CurveZMQ keys missing in {keys_dir}: {missing} (make them with "
                                    f"`horizonrl keys {keys_dir}`)")
        loose = [p.name for p in keys_dir.glob("*.key_secret") if p.stat().st_mode & 0o077]
        if loose:
            raise PermissionError(f"secret keys readable by others in {keys_dir}: {loose} (chmod 600)")
        self.server_public, self.server_secret = zmq.auth.load_certificate(str(keys_dir / "server.key_secret"))
        self.client_public, self.client_secret = zmq.auth.load_certificate(str(keys_dir / "client.key_secret"))
        self.authenticator = ThreadAuthenticator(context)
        self.authenticator.start()
        self.authenticator.configure_curve(domain="*", location=str(keys_dir / "allowed"))

    def apply(self, sock: zmq.Socket, server: bool) -> None:
        if server:
            sock.curve_server = True
            sock.curve_publickey, sock.curve_secretkey = self.server_public, self.server_secret
        else:
            sock.curve_serverkey = self.server_public
            sock.curve_publickey, sock.curve_secretkey = self.client_public, self.client_secret

    def stop(self) -> None:
        self.authenticator.stop()


def wire_security(context: zmq.Context, host: str, keys_dir: str | None) -> WireSecurity | None:
    """None on loopback without keys; CurveZMQ with keys; an error off loopback without them."""
    if keys_dir is None:
        if not is_loopback(host):
            raise PermissionError(f"network.host {host} is not loopback: CurveZMQ keys are required "
                                  "(network.curve_keys_dir; make them with `horizonrl keys DIR`)")
        return None
    return WireSecurity(context, keys_dir)



def tcp_endpoint(host: str, port: int) -> str:
    return f"tcp://{host}:{port}"


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """``tcp://HOST:PORT`` -> (HOST, PORT)."""
    host, sep, port = endpoint.removeprefix("tcp://").rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"not a tcp://HOST:PORT endpoint: {endpoint!r}")
    return host.strip("[]"), int(port)


ADVERTISE_HOST_ENV = "HORIZONRL_ADVERTISE_HOST"


def route_address(host: str) -> str:
    """This machine's address on the route to ``host``: loopback for a loopback ``host``; otherwise the
    source address the kernel picks to reach it (a UDP socket's connect sends no packet)."""
    if is_loopback(host):
        return "127.0.0.1" if host == "localhost" else host
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((host, 9))
        return probe.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())
    finally:
        probe.close()


def advertise_host(coordinator_host: str, environ=None) -> str:
    """The address this process gives the others for the endpoints it binds: ``$HORIZONRL_ADVERTISE_HOST``
    when its launcher set it (Ray: the node's address; Slurm: the node's), else this machine's address on
    the route to the coordinator — which is loopback when the coordinator is (a single-machine run)."""
    explicit = (os.environ if environ is None else environ).get(ADVERTISE_HOST_ENV)
    return explicit or route_address(coordinator_host)


def bind_endpoint(sock: zmq.Socket, bind_host: str, port: int, advertised: str) -> str:
    """Bind ``sock`` on ``bind_host`` at ``port`` (0: a free port the OS picks, with no race) and return
    the endpoint the others connect to: ``tcp://advertised:PORT``."""
    if port:
        sock.bind(tcp_endpoint(bind_host, port))
    else:
        port = sock.bind_to_random_port(f"tcp://{bind_host}")
    return tcp_endpoint(advertised, port)


HELD_PORTS_ENV = "HORIZONRL_HELD_PORTS"  # "PORT=FD,...": listening sockets a launcher holds for its child


def hold_port(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` that a launcher keeps for the whole run and hands to each
    incarnation of the process that serves it (:func:`bind_held`): while the launcher holds it no other process
    can bind the port, so a restarted coordinator always gets its ports back, and clients that connect while
    none runs wait in the socket's backlog instead of reaching whoever bound the port first."""
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host.strip("[]"), port))
        listener.listen(256)
    except OSError:
        listener.close()
        raise
    listener.set_inheritable(True)
    return listener


def held_ports_env(held: dict[int, socket.socket]) -> dict[str, str]:
    """The environment that tells a child which of its ports it finds already bound (``pass_fds`` the sockets)."""
    if not held:
        return {}
    return {HELD_PORTS_ENV: ",".join(f"{port}={sock.fileno()}" for port, sock in held.items())}


def bind_held(sock: zmq.Socket, endpoint: str, port: int, environ=None) -> bool:
    """Bind ``sock`` at ``endpoint``, on the listening socket the launcher holds for ``port`` when it handed one
    down (ZeroMQ's ZMQ_USE_FD); True then. Otherwise a plain bind (False)."""
    environ = os.environ if environ is None else environ
    held = dict(item.split("=", 1) for item in environ.get(HELD_PORTS_ENV, "").split(",") if "=" in item)
    if str(port) in held:
        sock.setsockopt(zmq.USE_FD, int(held[str(port)]))
    sock.bind(endpoint)
    return str(port) in held


def keep_collectives_on(host: str, environ=None) -> str | None:
    """gloo and NCCL listen on sockets of their own, on the address the machine's hostname resolves to unless
    told an interface (``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME``): name the interface that holds ``host``
    (the run's bind address, loopback unless configured otherwise) for this process and its children, where the
    user has not named one. Returns the interface, or None when no interface holds ``host`` (a name, say)."""
    import psutil

    environ = os.environ if environ is None else environ
    wanted = host.strip("[]")
    name = next((interface for interface, addresses in psutil.net_if_addrs().items()
                 if any(a.address.split("%")[0] == wanted for a in addresses)), None)
    if name is not None:
        environ.setdefault("GLOO_SOCKET_IFNAME", name)
        environ.setdefault("NCCL_SOCKET_IFNAME", name)
    return name


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now (see :func:`free_ports`)."""
    return free_ports(1, host)[0]


PICKED_PORTS_FROM = 20000  # picked ports lie between this and the kernel's ephemeral range (Ray's workers: below)
EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for ports it picks itself (outgoing connections, binds to port 0)."""
    try:
        low, high = map(int, EPHEMERAL_RANGE_FILE.read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct TCP ports that are free right now, all held open until all are picked.

    Picked below the kernel's ephemeral range when there is room. A port picked here is bound by its user
    later (another process, once it has read the config), and meanwhile anything may take it; inside the
    ephemeral range the kernel itself hands it out, to any outgoing connection of any process on a busy
    machine (a resumed run's buffer found its port taken so, once). Below it, only a process that binds that
    very number can. Binding port 0 and registering the port is the race-free way, where a process can."""
    low, _ = ephemeral_ports()
    pool = range(PICKED_PORTS_FROM, low)
    tries = 50 * count if len(pool) >= 1000 else 0  # then from the kernel's range, as before
    rng = random.SystemRandom()
    sockets: list[socket.socket] = []
    try:
        while len(sockets) < count:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            port = rng.choice(pool) if tries > 0 else 0
            tries -= 1
            try:
                s.bind((host, port))
            except OSError:  # taken
                s.close()
                if port == 0:
                    raise
                continue
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()
