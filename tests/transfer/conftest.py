"""Fixtures for the transfer-plane tests: a long-lived sender process and in-process receivers.

Sender and receiver always live in different processes (the sender is spawned); scenarios that
need the opposite (a receiver that dies) spawn their own peers.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Iterator

import pytest

os.environ.setdefault("GLOG_minloglevel", "2")

from bench.peer import Peer  # noqa: E402
from common.transfer.config import TransferConfig  # noqa: E402
from common.transfer.layout import BufferLayout, layout_for  # noqa: E402
from common.transfer.receiver import EmbeddingReceiver  # noqa: E402

HIDDEN = 64
FAST = dict(
    bootstrap_timeout_s=3.0,
    waiting_timeout_s=3.0,
    transfer_timeout_s=2.0,
    heartbeat_interval_s=0.2,
    heartbeat_timeout_s=1.0,
)
_room_ids = itertools.count(1000)


def make_config(**overrides) -> TransferConfig:
    values = dict(FAST, transport="mooncake")
    values.update(overrides)
    return TransferConfig(**values)


def layout_of(config: TransferConfig, hidden: int = HIDDEN, num_deepstack: int = 0) -> BufferLayout:
    return layout_for(config, hidden, num_deepstack)


def new_room() -> int:
    return next(_room_ids)


def wait_for(predicate: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


@pytest.fixture(scope="session")
def sender() -> Iterator[Peer]:
    config = make_config(num_blocks=256)
    peer = Peer("sender", config, layout_of(config))
    yield peer
    peer.close()


@pytest.fixture(scope="session")
def _open_receivers() -> Iterator[list[EmbeddingReceiver]]:
    """Receivers stay open until the session ends. NOTE: Mooncake picks each engine's RPC port
    at random in 15000..17000 and a sender caches what it learnt about a session for good; a
    new receiver on the port of a closed one would get writes aimed at the closed one's data
    port. Holding the ports (an idle receiver costs two threads and never wakes) avoids that."""
    made: list[EmbeddingReceiver] = []
    yield made
    for receiver in made:
        receiver.close()


@pytest.fixture
def make_receiver(_open_receivers) -> Iterator[Callable[..., EmbeddingReceiver]]:
    def build(hidden: int = HIDDEN, report_progress: bool = False, **overrides):
        config = make_config(**{"num_blocks": 32, **overrides})
        receiver = EmbeddingReceiver(config, layout_of(config, hidden), report_progress)
        _open_receivers.append(receiver)
        return receiver

    yield build


def assert_no_leaks(sender: Peer, *receivers: EmbeddingReceiver, timeout_s: float = 10.0) -> None:
    stats = sender.ask("wait_idle", timeout_s)
    assert stats["num_used_blocks"] == 0, stats
    assert not stats["rooms_active"], stats
    for receiver in receivers:
        assert wait_for(lambda r=receiver: r.stats()["num_used_blocks"] == 0, timeout_s), (
            receiver.stats()
        )
        assert not receiver.stats()["rooms_active"]
