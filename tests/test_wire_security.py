"""The wire: CurveZMQ keys (made by `horizonrl keys`) on real sockets over loopback, and the refusal to
run off loopback without them."""

import os
import stat

import pytest
import zmq

from horizonrl.apps.cli import main
from horizonrl.core.config import ConfigError, load_config
from horizonrl.launcher import prepare_run
from horizonrl.protocol.transport import WireSecurity, generate_keys, make_socket, wire_security


def test_keys_are_private(tmp_path):
    assert main(["keys", str(tmp_path / "keys")]) == 0
    keys = tmp_path / "keys"
    assert stat.S_IMODE(os.stat(keys).st_mode) == 0o700
    for name in ("server.key_secret", "client.key_secret", "server.key", "client.key"):
        assert stat.S_IMODE(os.stat(keys / name).st_mode) == 0o600, name
    assert sorted(p.name for p in (keys / "allowed").iterdir()) == ["client.key"]  # only the client may connect


def _pair(ctx, server_security, client_security):
    server = make_socket(ctx, zmq.PULL, security=server_security, server=True)
    port = server.bind_to_random_port("tcp://127.0.0.1")
    client = make_socket(ctx, zmq.PUSH, security=client_security)
    client.connect(f"tcp://127.0.0.1:{port}")
    return server, client


def test_a_client_with_the_run_s_key_gets_through_and_others_do_not(tmp_path):
    generate_keys(tmp_path / "ours")
    generate_keys(tmp_path / "theirs")
    ctx = zmq.Context()
    ours = WireSecurity(ctx, tmp_path / "ours")
    other_ctx = zmq.Context()
    theirs = WireSecurity(other_ctx, tmp_path / "theirs")  # another run's client key, knowing our server key
    theirs.server_public = ours.server_public
    sockets = []
    try:
        server, client = _pair(ctx, ours, ours)
        sockets += [server, client]
        client.send(b"hello")
        assert server.poll(5000) and server.recv() == b"hello"
        intruder = make_socket(other_ctx, zmq.PUSH, security=theirs)
        sockets.append(intruder)
        intruder.connect(server.getsockopt(zmq.LAST_ENDPOINT).decode())
        intruder.send(b"let me in", zmq.NOBLOCK)
        plain = make_socket(other_ctx, zmq.PUSH)  # no encryption at all
        sockets.append(plain)
        plain.connect(server.getsockopt(zmq.LAST_ENDPOINT).decode())
        plain.send(b"plain text", zmq.NOBLOCK)
        assert not server.poll(2000)  # neither got through
    finally:
        for s in sockets:
            s.close(linger=0)
        ours.stop()
        theirs.stop()
        ctx.term()
        other_ctx.term()


def test_missing_or_loose_keys_are_errors(tmp_path):
    ctx = zmq.Context()
    try:
        with pytest.raises(FileNotFoundError, match="horizonrl keys"):
            WireSecurity(ctx, tmp_path / "nothing")
        keys = generate_keys(tmp_path / "keys")
        os.chmod(keys / "server.key_secret", 0o644)
        with pytest.raises(PermissionError, match="chmod 600"):
            WireSecurity(ctx, keys)
        assert wire_security(ctx, "127.0.0.1", None) is None  # loopback without keys: plain
        with pytest.raises(PermissionError, match="not loopback"):
            wire_security(ctx, "10.1.2.3", None)
    finally:
        ctx.term()


def test_a_run_off_loopback_without_keys_refuses_to_start(tmp_path):
    config = load_config(None, ["model.path=/unused", "envs=[{name: signpost}]", f"run.output_dir={tmp_path}",
                                "network.host=10.1.2.3", "network.control_port=1", "network.report_port=2",
                                "network.trajectory_port=3", "network.batch_port=4", "network.weight_port=5",
                                "network.dist_port=6"])
    with pytest.raises(ConfigError, match="CurveZMQ keys are required"):
        prepare_run(config)
