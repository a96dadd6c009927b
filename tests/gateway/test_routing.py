"""Routing policies and the worker registry (pure logic; channels are test doubles)."""

from __future__ import annotations

from services.gateway.registry import Role, WorkerRegistry
from services.gateway.routing import (
    CacheAwarePolicy,
    EncoderAffinityPolicy,
    LeastLoadPolicy,
    RoundRobinPolicy,
    RoutingKey,
)


class FakeChannel:
    def __init__(self, address: str) -> None:
        self.address = address
        self.closed = False

    def close(self) -> None:
        self.closed = True


def no_stubs(channel: FakeChannel, role: Role) -> None:
    return None


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_registry(n: int, role: Role = Role.ENCODER, clock: Clock | None = None):
    reg = WorkerRegistry(5.0, FakeChannel, clock or Clock(), stub_factory=no_stubs)
    for i in range(n):
        reg.heartbeat(f"w{i}:1", role, 8, {})
    return reg


def test_registry_expiry_drops_and_heartbeat_brings_back() -> None:
    clock = Clock()
    reg = make_registry(2, clock=clock)
    reg.add_static("s0:1", Role.ENCODER)
    first = {w.address: w for w in reg.all()}
    clock.now = 4.0
    reg.heartbeat("w1:1", Role.ENCODER, 8, {"queue": 2.0})
    clock.now = 6.0
    assert reg.expire() == ["w0:1"]
    assert first["w0:1"].channel.closed
    # the static worker stays, but unhealthy
    assert sorted(w.address for w in reg.healthy(Role.ENCODER)) == ["w1:1"]
    assert [w.address for w in reg.all() if w.static] == ["s0:1"]
    reg.heartbeat("w0:1", Role.ENCODER, 8, {})
    assert sorted(w.address for w in reg.healthy(Role.ENCODER)) == ["w0:1", "w1:1"]
    reg.mark("s0:1", True)
    assert len(reg.healthy(Role.ENCODER)) == 3
    assert reg.deregister("w1:1") and not reg.deregister("w1:1")


def test_round_robin_rotates() -> None:
    workers = make_registry(3).healthy(Role.ENCODER)
    policy = RoundRobinPolicy()
    firsts = [policy.order(workers, RoutingKey())[0].address for _ in range(6)]
    assert firsts == ["w0:1", "w1:1", "w2:1"] * 2


def test_least_load_prefers_idle() -> None:
    reg = make_registry(3)
    workers = reg.healthy(Role.ENCODER)
    reg.acquire(workers[0])
    reg.acquire(workers[1])
    assert LeastLoadPolicy().order(workers, RoutingKey())[0].address == "w2:1"


def test_encoder_affinity_is_sticky_until_overloaded() -> None:
    reg = make_registry(4)
    workers = reg.healthy(Role.ENCODER)
    policy = EncoderAffinityPolicy(slack=2)
    keys = [RoutingKey(image_hashes=(bytes([i]) * 16,)) for i in range(32)]
    chosen = [policy.order(workers, k)[0].address for k in keys]
    assert chosen == [policy.order(workers, k)[0].address for k in keys]  # deterministic
    assert len(set(chosen)) > 1  # spreads across the pool
    target = next(w for w in workers if w.address == chosen[0])
    for _ in range(3):
        reg.acquire(target)
    assert policy.order(workers, keys[0])[0] is not target  # 3 > 0 + slack 2
    reg.release(target)
    assert policy.order(workers, keys[0])[0] is target  # 2 <= 0 + 2


def test_cache_aware_follows_longest_prefix() -> None:
    reg = make_registry(3, role=Role.LANGUAGE)
    workers = reg.healthy(Role.LANGUAGE)
    policy = CacheAwarePolicy(slack=4)
    a = RoutingKey(prefix_hashes=(1, 2, 3))
    first = policy.order(workers, a)[0]
    policy.on_routed(first, a)
    b = RoutingKey(prefix_hashes=(1, 2, 99))  # shares two parts with a
    assert policy.order(workers, b)[0] is first
    assert policy.match_len(first, b) == 2
    other = RoutingKey(prefix_hashes=(7,))
    reg.acquire(first)
    assert policy.order(workers, other)[0] is not first  # no match: least load


def test_a_late_heartbeat_refreshes_a_registered_worker_but_registers_none() -> None:
    """A heartbeat its worker gave up on (``still_wanted`` False) cannot bring back a worker
    that deregistered meanwhile, but still refreshes one that is registered (a slow gateway
    must not let its workers expire)."""
    reg = WorkerRegistry(5.0, FakeChannel, Clock(), stub_factory=no_stubs)

    def gone() -> bool:
        return False

    assert not reg.heartbeat("w0:1", Role.ENCODER, 8, {}, still_wanted=gone)
    assert reg.all() == []
    reg.heartbeat("w0:1", Role.ENCODER, 8, {"queue": 1.0})
    assert reg.heartbeat("w0:1", Role.ENCODER, 8, {"queue": 3.0}, still_wanted=gone)
    assert [w.load for w in reg.all()] == [{"queue": 3.0}]
