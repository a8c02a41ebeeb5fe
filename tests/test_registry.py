"""Addresses by registration: processes bind where they run and register with the coordinator, which
publishes every endpoint in Control; clients follow a server that restarts elsewhere.

Unit level (real ZMQ sockets on loopback, no engine): the coordinator's registry, a buffer bound at a
free port that registers itself, a client that follows it to a new port, the address helpers.
"""

from __future__ import annotations

import threading

import pytest
import zmq

from horizonrl.coordinator import Coordinator
from horizonrl.core.config import TrainConfig
from horizonrl.core.runtime import StopFlag
from horizonrl.protocol import (ENDPOINT_BATCHES, ENDPOINT_TRAJECTORIES, Control, Registration, decode_as, encode,
                                learner_rendezvous_name)
from horizonrl.protocol.registry import FollowedEndpoint, registration, wait_for_endpoints
from horizonrl.protocol.transport import (advertise_host, bind_endpoint, free_ports, make_socket, route_address,
                                          split_endpoint)

RUN = "registry-test"


def coordinator_config(tmp_path, **network) -> TrainConfig:
    control, report = free_ports(2)
    return TrainConfig.model_validate({
        "run": {"output_dir": str(tmp_path), "run_id": RUN}, "model": {"path": "unused"},
        "envs": [{"name": "signpost"}],
        "network": {"host": "127.0.0.1", "control_port": control, "report_port": report, **network}})


def test_picked_ports_are_free_distinct_and_outside_the_kernels_own_range(monkeypatch):
    """The kernel hands out ports of its ephemeral range to any outgoing connection: a port picked for a process
    that binds it later is picked below that range, where only a process naming that number can take it; with no
    room there, from the kernel as before."""
    import socket

    import horizonrl.protocol.transport as transport

    low, high = transport.ephemeral_ports()
    ports = free_ports(12)
    assert len(set(ports)) == 12 and all(transport.PICKED_PORTS_FROM <= p < low for p in ports), (ports, low)
    for port in ports:  # free: each binds
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
    monkeypatch.setattr(transport, "ephemeral_ports", lambda: (transport.PICKED_PORTS_FROM + 10, 60999))
    ports = free_ports(3)
    assert len(set(ports)) == 3 and all(low <= p <= high for p in ports), ports  # the kernel's picks


def test_address_helpers():
    assert split_endpoint("tcp://10.1.2.3:5555") == ("10.1.2.3", 5555)
    with pytest.raises(ValueError):
        split_endpoint("tcp://nohost")
    assert route_address("127.0.0.1") == "127.0.0.1" and route_address("localhost") == "127.0.0.1"
    assert advertise_host("127.0.0.1", {}) == "127.0.0.1"
    assert advertise_host("127.0.0.1", {"HORIZONRL_ADVERTISE_HOST": "10.0.0.7"}) == "10.0.0.7"
    ctx = zmq.Context()
    try:
        sock = make_socket(ctx, zmq.ROUTER, server=True)
        endpoint = bind_endpoint(sock, "127.0.0.1", 0, "127.0.0.1")
        host, port = split_endpoint(endpoint)
        assert host == "127.0.0.1" and port > 0
        sock.close(linger=0)
    finally:
        ctx.term()


def test_the_coordinator_publishes_registrations_and_the_newest_one_wins(tmp_path):
    coordinator = Coordinator(coordinator_config(tmp_path), StopFlag())
    try:
        assert coordinator.control().endpoints == {}
        coordinator.on_registration(Registration(run_id=RUN, name="buffer", pid=1, endpoints={
            ENDPOINT_TRAJECTORIES: "tcp://127.0.0.1:1001", ENDPOINT_BATCHES: "tcp://127.0.0.1:1002"}))
        coordinator.on_registration(Registration(run_id=RUN, name="learner-0", pid=2, endpoints={
            learner_rendezvous_name("g1"): "tcp://127.0.0.1:2001"}))
        # the buffer restarted on new ports
        coordinator.on_registration(Registration(run_id=RUN, name="buffer", pid=3, endpoints={
            ENDPOINT_TRAJECTORIES: "tcp://127.0.0.1:1101", ENDPOINT_BATCHES: "tcp://127.0.0.1:1102"}))
        assert coordinator.control().endpoints == {ENDPOINT_TRAJECTORIES: "tcp://127.0.0.1:1101",
                                                   ENDPOINT_BATCHES: "tcp://127.0.0.1:1102",
                                                   "learner_rendezvous/g1": "tcp://127.0.0.1:2001"}
    finally:
        coordinator.close()


def test_a_client_finds_a_registered_server_and_follows_it_to_its_new_port(tmp_path):
    """A server binds port 0 and registers over the report socket; a client waits for it in Control, talks to
    it, then the server "restarts" on another port and the client follows."""
    config = coordinator_config(tmp_path)
    net = config.network
    stop = StopFlag()
    coordinator = Coordinator(config, stop)
    thread = threading.Thread(target=coordinator.run, daemon=True)
    thread.start()
    ctx = zmq.Context()
    sockets = []
    try:
        reports = make_socket(ctx, zmq.PUSH)
        reports.connect(net.endpoint(net.report_port))
        sockets.append(reports)

        def serve() -> zmq.Socket:
            server = make_socket(ctx, zmq.ROUTER, server=True)
            sockets.append(server)
            endpoint = bind_endpoint(server, net.bind_address(), 0, net.advertised_host())
            reports.send(registration(RUN, "buffer", {ENDPOINT_BATCHES: endpoint}))
            return server

        first = serve()
        found = wait_for_endpoints(ctx, net.endpoint(net.control_port), RUN, lambda e: ENDPOINT_BATCHES in e, 10)
        client = make_socket(ctx, zmq.DEALER)
        sockets.append(client)
        follower = FollowedEndpoint(client, ENDPOINT_BATCHES)
        assert not follower.connected
        assert follower.update(found) and follower.current == found[ENDPOINT_BATCHES]
        client.send(b"hello")
        assert first.poll(5000) and first.recv_multipart()[1] == b"hello"

        first.close(linger=0)
        second = serve()
        moved = wait_for_endpoints(ctx, net.endpoint(net.control_port), RUN,
                                   lambda e: e.get(ENDPOINT_BATCHES) not in (None, found[ENDPOINT_BATCHES]), 10)
        assert follower.update(moved) and not follower.update(moved)  # once per move
        client.send(b"again")
        assert second.poll(5000) and second.recv_multipart()[1] == b"again"
    finally:
        stop.set()
        thread.join(timeout=10)
        for sock in sockets:
            sock.close(linger=0)
        ctx.term()
        coordinator.close()


def test_a_configured_endpoint_is_never_replaced_by_the_registry():
    ctx = zmq.Context()
    try:
        sock = make_socket(ctx, zmq.DEALER)
        follower = FollowedEndpoint(sock, ENDPOINT_TRAJECTORIES, "tcp://127.0.0.1:5999")
        assert follower.connected
        assert not follower.update({ENDPOINT_TRAJECTORIES: "tcp://127.0.0.1:6000"})
        assert follower.current == "tcp://127.0.0.1:5999"
        sock.close(linger=0)
    finally:
        ctx.term()


def test_control_carries_endpoints_through_the_codec():
    data = encode(Control(run_id=RUN, learner_step=1, max_turns=2, weight_version=1,
                          endpoints={ENDPOINT_BATCHES: "tcp://10.0.0.1:7"}))
    assert decode_as(data, Control).endpoints == {ENDPOINT_BATCHES: "tcp://10.0.0.1:7"}
    # a Control of a peer without the field still decodes (defaulted)
    old = encode(Control(run_id=RUN, learner_step=1, max_turns=2, weight_version=1))
    assert decode_as(old, Control).endpoints == {}
