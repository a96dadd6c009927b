"""The gateway's poll of a worker asks for its readiness, not its liveness: a worker that is alive
but starting or draining (after SIGTERM) reads as unhealthy and gets no traffic, even one from
the static list, which never deregisters. A poll the worker does not answer in time (it may be
busy) takes a self-registered worker out of routing only when its heartbeats stopped too; a
static one goes after ``MAX_UNANSWERED_POLLS`` in a row.

A real gRPC server built the way the workers build theirs (``common.grpc_server``: liveness,
readiness, drain); only its ``GetLoad`` is a stand-in, answering a fixed load (late while
``SLOW`` is set).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.grpc_server import Server, create_server, start_server
from common.stream_capacity import StreamCapacity
from protos.epd.v1 import language_pb2
from services.gateway.registry import MAX_UNANSWERED_POLLS, Role, WorkerRegistry
from services.gateway.routing import worker_problems
from services.gateway.workers import create_channel, poll

SERVICE = "epd.v1.LanguageService"
SLOW = threading.Event()
POLL_S = 0.2


def get_load(request: language_pb2.LanguageLoadRequest, context) -> language_pb2.LanguageLoad:
    if SLOW.is_set():
        time.sleep(2 * POLL_S)  # answered only after the poll gave up
    return language_pb2.LanguageLoad(num_running=2)


@pytest.fixture
def worker_server() -> Iterator[tuple[Server, str]]:
    server = create_server("language", 4, StreamCapacity(4, who="test worker"))
    handler = grpc.unary_unary_rpc_method_handler(
        get_load,
        request_deserializer=language_pb2.LanguageLoadRequest.FromString,
        response_serializer=language_pb2.LanguageLoad.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE, {"GetLoad": handler}),)
    )
    port, _ = start_server(server, "127.0.0.1", 0, (SERVICE,), ready=False)
    yield server, f"127.0.0.1:{port}"
    server.stop(None)


def test_a_worker_starting_or_draining_is_polled_unhealthy(worker_server) -> None:
    server, address = worker_server
    registry = WorkerRegistry(expiry_s=5.0, channel_factory=create_channel)
    registry.add_static(address, Role.LANGUAGE)
    (worker,) = registry.all()
    try:
        assert poll(worker, timeout_s=5.0)[0] is False  # alive, not ready yet
        server.readiness.set(True)
        healthy, load, _info, _descriptor = poll(worker, timeout_s=5.0)
        assert healthy and load["running"] == 2.0
        server.readiness.drain()
        assert poll(worker, timeout_s=5.0)[0] is False
        live = health_pb2_grpc.HealthStub(worker.channel).Check(
            health_pb2.HealthCheckRequest(), timeout=5
        )
        assert live.status == health_pb2.HealthCheckResponse.SERVING  # still alive, draining
    finally:
        registry.close()


def test_a_busy_worker_that_answers_late_stays_in_routing_while_it_heartbeats(
    worker_server,
) -> None:
    server, address = worker_server
    server.readiness.set(True)
    now = [0.0]
    registry = WorkerRegistry(expiry_s=4.0, channel_factory=create_channel, clock=lambda: now[0])
    registry.add_static(address, Role.LANGUAGE)
    registry.heartbeat("127.0.0.1:9", Role.LANGUAGE, 8, {})  # a self-registered one
    static, registered = sorted(registry.all(), key=lambda w: not w.static)
    SLOW.set()
    try:
        assert poll(static, timeout_s=POLL_S)[0] is None  # late: not known to be gone
    finally:
        SLOW.clear()
    for n in range(1, MAX_UNANSWERED_POLLS + 1):
        now[0] += 0.5
        registry.heartbeat(registered.address, Role.LANGUAGE, 8, {})  # busy, not hung
        registry.mark(static.address, None)
        registry.mark(registered.address, None)
        assert static.healthy is (n < MAX_UNANSWERED_POLLS)
        assert registered.healthy
    now[0] += 2.5  # no heartbeat for more than half its expiry: hung, not busy
    registry.mark(registered.address, None)
    assert not registered.healthy
    registry.mark(static.address, poll(static, timeout_s=5.0)[0])
    assert static.healthy and static.num_unanswered_polls == 0
    registry.close()


def test_heartbeats_do_not_bring_back_a_worker_the_gateway_cannot_reach(worker_server) -> None:
    """A worker whose heartbeats arrive but whose advertised address the gateway cannot reach
    (a wrong --advertise-host) stays out of routing until a poll passes, and says why."""
    server, address = worker_server
    server.readiness.set(True)
    registry = WorkerRegistry(expiry_s=5.0, channel_factory=create_channel)
    unreachable = "127.0.0.1:9"  # nothing listens there: the poll fails at once
    for worker_address in (unreachable, address):
        registry.heartbeat(worker_address, Role.LANGUAGE, 8, {})
    try:
        for worker in registry.all():
            registry.mark(worker.address, poll(worker, timeout_s=5.0)[0])
        for _ in range(3):  # the worker keeps heartbeating: it stays out
            registry.heartbeat(unreachable, Role.LANGUAGE, 8, {})
            assert [w.address for w in registry.healthy(Role.LANGUAGE)] == [address]
        problems = worker_problems(registry.all())
        assert "cannot reach its advertised address" in problems[unreachable]
        assert "unhealthy" not in problems.get(address, "")
        registry.mark(unreachable, True)  # a poll that passes brings it back
        registry.heartbeat(unreachable, Role.LANGUAGE, 8, {})
        assert len(registry.healthy(Role.LANGUAGE)) == 2
    finally:
        registry.close()
