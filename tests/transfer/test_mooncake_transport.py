"""The Mooncake transport on its own: submitted segments, polled to the end, errors typed."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time

import pytest
import torch

from common.transfer.mooncake_transport import MooncakeTransport
from common.transfer.regions import allocate_region
from common.transfer.types import TransferWriteError


@pytest.fixture(scope="module")
def engine():
    """One real engine (tcp on 127.0.0.1) writing into its own registered regions."""
    transport = MooncakeTransport("127.0.0.1")
    src, dst = allocate_region(1 << 20, "src", False), allocate_region(1 << 20, "dst", False)
    transport.register([src, dst])
    yield transport, src, dst
    transport.close()
    src.close()
    dst.close()


def test_every_segment_lands(engine) -> None:
    transport, src, dst = engine
    src.data.copy_(torch.randint(0, 256, (1 << 20,), dtype=torch.uint8))
    dst.data.zero_()
    segments = [(0, 4096, 300_000), (500_000, 0, 1), (700_000, 600_000, 128)]  # src, dst, len
    transport.write(
        transport.session_id,
        [src.base + s for s, _, _ in segments],
        [dst.base + d for _, d, _ in segments],
        [n for _, _, n in segments],
    )
    for s, d, n in segments:
        assert torch.equal(dst.data[d : d + n], src.data[s : s + n])
    assert int(dst.data[300_000 + 4096 : 500_000].count_nonzero()) == 0  # nothing else


def test_unregistered_destination_is_a_typed_error_and_the_engine_keeps_serving(engine) -> None:
    transport, src, dst = engine
    with pytest.raises(TransferWriteError, match="status"):
        transport.write(transport.session_id, [src.base, src.base], [dst.base, 4096], [64, 64])
    src.data[:64] = 7
    transport.write(transport.session_id, [src.base], [dst.base + 64], [64])
    assert bool((dst.data[64:128] == 7).all())


def test_unreachable_peer_is_a_typed_error(engine) -> None:
    transport, src, _ = engine
    with pytest.raises(TransferWriteError, match="127.0.0.1:1"):
        transport.write("127.0.0.1:1", [src.base], [0], [64])


def _peer(conn, nbytes: int) -> None:
    """A receiving engine in its own process: reports (session, address), then waits."""
    transport = MooncakeTransport("127.0.0.1")
    region = allocate_region(nbytes, "peer", False)
    transport.register([region])
    conn.send((transport.session_id, region.base))
    conn.recv()


def test_peer_killed_mid_write_ends_the_write_with_an_error(engine) -> None:
    transport, _, _ = engine
    nbytes = 256 << 20  # long enough on tcp to be killed in the middle
    source = allocate_region(nbytes, "big", False)
    transport.register([source])
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    peer = ctx.Process(target=_peer, args=(child, nbytes), daemon=True)
    peer.start()
    try:
        session, base = parent.recv()
        transport.write(session, [source.base], [base], [1 << 20])  # connected and working
        threading.Timer(0.01, peer.kill).start()
        start = time.monotonic()
        with pytest.raises(TransferWriteError, match=session):
            transport.write(session, [source.base], [base], [nbytes])
        assert time.monotonic() - start < 10.0  # noticed, not waited out until the timeout
    finally:
        peer.kill()
        peer.join(10)
