"""A worker registers with every gateway: a comma list of registries, and names that stand for
every address they resolve to, re-resolved so that gateways that appear learn the worker and
gateways that disappear are forgotten; leaving deregisters from each.

Real in-process gateways (``services.gateway.server.serve``: their registry port over real gRPC).
Only the name resolution is a stand-in (``resolver``), since a test cannot edit DNS; the real
``resolve`` is checked on ``localhost``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from common.channels import ChannelSecurity
from common.internal import InternalConfig
from common.registration import Registrar, parse_gateways, resolve
from common.tls import ClientTLS
from common.worker import WorkerConfig
from protos.epd.v1 import common_pb2, language_pb2, registry_pb2, registry_pb2_grpc
from services.gateway.config import GatewayConfig
from services.gateway.server import GatewayServer, serve
from tests.common.pki import make_ca

HEARTBEAT_S = 0.1
WORKER = "127.0.0.1:9"  # nothing listens there


def report() -> language_pb2.LanguageLoad:
    layout = common_pb2.TransferLayout(hidden_size=64, dtype="bfloat16", block_size=128)
    return language_pb2.LanguageLoad(num_running=1, transfer_layout=layout, max_seq_len=4096)


def wait_until(predicate: Callable[[], object], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def known(gateway: GatewayServer) -> list[str]:
    return [w.address for w in gateway.registry.all()]


@pytest.fixture
def gateways() -> Iterator[Callable[..., GatewayServer]]:
    started: list[GatewayServer] = []

    def start(**kw) -> GatewayServer:
        config = GatewayConfig(
            port=0,
            registry_port=0,
            heartbeat_interval_s=HEARTBEAT_S,
            worker_expiry_s=1.0,
            health_poll_s=0.2,  # no worker listens at WORKER: only heartbeats keep it here
            **kw,
        )
        started.append(serve(config))
        return started[-1]

    yield start
    for gateway in started:
        gateway.stop(0)


def registrar(spec: str, **kw) -> Registrar:
    return Registrar(spec, WORKER, "language", 8, report, interval_s=HEARTBEAT_S, **kw)


def test_a_comma_list_registers_with_every_gateway_and_leaves_each(gateways) -> None:
    a, b = gateways(), gateways()
    spec = f"127.0.0.1:{a.registry_port}, 127.0.0.1:{b.registry_port}"
    worker = registrar(spec).start()
    try:
        wait_until(lambda: known(a) == known(b) == [WORKER])
        (listed,) = b.registry.all()
        assert listed.descriptor["max_seq_len"] == 4096 and listed.load["running"] == 1.0
        assert worker.targets == sorted(
            [f"127.0.0.1:{a.registry_port}", f"127.0.0.1:{b.registry_port}"]
        )
    finally:
        worker.stop()
    assert known(a) == known(b) == []  # deregistered at once, not expired
    worker.stop()  # idempotent


def test_a_gateway_that_is_down_delays_no_other(gateways) -> None:
    a = gateways()
    from common.procs import free_port

    dead = f"127.0.0.1:{free_port()}"
    worker = registrar(f"{dead},127.0.0.1:{a.registry_port}").start()
    try:
        wait_until(lambda: known(a) == [WORKER])
        beats = worker.num_heartbeats
        wait_until(lambda: worker.num_heartbeats >= beats + 5, timeout_s=5)
    finally:
        start = time.monotonic()
        worker.stop()
        assert time.monotonic() - start < 5  # the dead one's Deregister is bounded
    assert known(a) == []


def test_a_name_stands_for_every_gateway_it_resolves_to(gateways) -> None:
    a, b = gateways(), gateways()
    port = 50052
    # Both gateways answer on 127.0.0.1; the name "resolves" to their registry ports.
    table = {"gateways.test": [f"127.0.0.1:{a.registry_port}"]}

    def resolver(host: str, _port: int) -> list[str]:
        if host not in table:
            raise OSError("name not known")
        return list(table[host])

    worker = registrar(f"gateways.test:{port}", resolver=resolver, resolve_interval_s=0.1).start()
    try:
        wait_until(lambda: known(a) == [WORKER])
        assert known(b) == []
        table["gateways.test"].append(f"127.0.0.1:{b.registry_port}")  # scale-up: b appears
        wait_until(lambda: known(b) == [WORKER], timeout_s=3)
        table["gateways.test"] = [f"127.0.0.1:{b.registry_port}"]  # a is gone from the name
        wait_until(lambda: worker.targets == [f"127.0.0.1:{b.registry_port}"], timeout_s=3)
        wait_until(lambda: known(a) == [], timeout_s=5)  # a hears no more: it expires the worker
        del table["gateways.test"]  # a failed lookup keeps what the name stood for
        time.sleep(0.5)
        assert worker.targets == [f"127.0.0.1:{b.registry_port}"]
        assert known(b) == [WORKER]
    finally:
        worker.stop()
    assert known(b) == []


def test_a_resolved_address_is_checked_against_the_name_over_tls(gateways, tmp_path: Path) -> None:
    """Internal TLS with certificates that name the Service, not the pod IPs: the registrar
    checks each resolved address's certificate for the name it came from."""
    ca = make_ca(tmp_path / "pki")
    server = ca.issue("gateway", alt_names=("DNS:gateways.test",))
    client = ca.issue("worker")
    internal = InternalConfig(
        tls_cert_file=server.cert, tls_key_file=server.key, tls_ca_file=ca.cert
    )
    a = gateways(internal=internal)
    tls = ClientTLS(ca.cert, client.cert, client.key)
    address = f"127.0.0.1:{a.registry_port}"
    by_name = registrar(
        f"gateways.test:{a.registry_port}",
        security=ChannelSecurity(tls=tls),
        resolver=lambda _host, _port: [address],
    ).start()
    try:
        wait_until(lambda: known(a) == [WORKER])
    finally:
        by_name.stop()
    assert known(a) == []


def test_resolve_and_parse() -> None:
    assert resolve("localhost", 50052) == ["127.0.0.1:50052"]  # IPv4 first, once
    assert resolve("127.0.0.1", 1) == ["127.0.0.1:1"]
    with pytest.raises(OSError):
        resolve("no-such-gateway.invalid", 1)
    assert parse_gateways(" a:1, [::1]:2 ,") == [("a", 1), ("::1", 2)]
    for bad in ("a", "a:0", ":5", "a:b"):
        with pytest.raises(ValueError, match="is not host:port"):
            parse_gateways(f"x:1,{bad}")
    with pytest.raises(ValueError, match="'gw' is not host:port"):
        WorkerConfig(gateway="gw")
    with pytest.raises(ValueError, match="drain_timeout_s must be >= 0"):
        WorkerConfig(drain_timeout_s=-1)
    assert WorkerConfig(gateway="a:1,b:2").gateway == "a:1,b:2"


def test_a_heartbeat_its_worker_gave_up_on_does_not_register_it(gateways) -> None:
    """A busy gateway gets to a heartbeat only after the worker stopped waiting for it; a
    leaving worker deregisters right then, so that heartbeat must leave the registry as it is
    (else it would list the worker again until its expiry)."""
    gateway = gateways()
    request = registry_pb2.HeartbeatRequest(address=WORKER, role="language", capacity=8)
    with grpc.insecure_channel(f"127.0.0.1:{gateway.registry_port}") as channel:
        stub = registry_pb2_grpc.WorkerRegistryStub(channel)
        with gateway.registry._lock:  # the gateway is busy: the heartbeat waits for the lock
            with pytest.raises(grpc.RpcError) as late:
                stub.Heartbeat(request, timeout=0.3)
        assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        seen_until = time.monotonic() + 0.5  # the late heartbeat goes on within ms of the lock
        while time.monotonic() < seen_until:
            assert known(gateway) == []
            time.sleep(0.02)
        stub.Heartbeat(request, timeout=5)  # one in time registers it
        assert known(gateway) == [WORKER]
