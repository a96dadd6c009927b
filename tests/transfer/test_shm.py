"""The same-host shared-memory transport: same protocol, memcpy into the peer's /dev/shm files."""

from __future__ import annotations

import errno
import os

import pytest

from bench.peer import Peer
from common.transfer.receiver import EmbeddingReceiver
from common.transfer.regions import SHM_DIR, SHM_PREFIX, allocate_region
from common.transfer.types import TransferError

from .conftest import assert_no_leaks, layout_of, make_config, new_room
from .helpers import collect, run_rooms, spec


@pytest.mark.parametrize("transport", ["shm", "auto"])
def test_shm_transport_moves_every_byte_and_unlinks(transport: str) -> None:
    config = make_config(num_blocks=128, transport=transport)
    sender = Peer("sender", config, layout_of(config))
    receiver_config = make_config(num_blocks=16, transport=transport)
    receiver = EmbeddingReceiver(receiver_config, layout_of(receiver_config))
    names = [r.shm_name for r in receiver.buffers.regions.values()]
    try:
        assert all(os.path.exists(os.path.join(SHM_DIR, n)) for n in names)
        specs = [spec(new_room(), n) for n in (1, 128, 1025, 4097)]
        results = run_rooms(sender, receiver, specs)
        assert results[specs[-1].seed].num_transfers >= 2
        stats = sender.ask("call", "stats")
        assert set(stats["writes_by_transport"]) == {"shm"}  # same host: auto picks shm
        assert_no_leaks(sender, receiver)
    finally:
        receiver.close()
        sender.close()
    assert not any(os.path.exists(os.path.join(SHM_DIR, n)) for n in names)


def test_mooncake_only_receiver_has_no_shm_files() -> None:
    config = make_config(num_blocks=4, default_tokens=256)
    receiver = EmbeddingReceiver(config, layout_of(config))
    try:
        assert all(not r.shm_name for r in receiver.buffers.regions.values())
    finally:
        receiver.close()


def test_no_common_transport_fails_the_room(sender, make_receiver) -> None:
    receiver = make_receiver(transport="shm")  # the session sender speaks Mooncake only
    s = spec(new_room(), 300)
    assert sender.ask("submit", s)
    receiver.add_room(s.seed, sender.endpoint)
    result = collect(receiver, {s.seed})[s.seed]
    assert isinstance(result, TransferError) and result.reason.startswith("no_transport")
    assert_no_leaks(sender, receiver)


def test_sweep_removes_regions_of_dead_processes() -> None:
    import subprocess

    from common.transfer.regions import SHM_PREFIX, sweep_stale_regions

    child = subprocess.Popen(["true"])
    child.wait()
    dead_pid = child.pid
    stale = os.path.join(SHM_DIR, f"{SHM_PREFIX}{dead_pid}-abc-rows")
    alive = os.path.join(SHM_DIR, f"{SHM_PREFIX}{os.getpid()}-abc-rows")
    for path in (stale, alive):
        open(path, "wb").close()
    try:
        removed = sweep_stale_regions()
        assert os.path.basename(stale) in removed
        assert not os.path.exists(stale) and os.path.exists(alive)
    finally:
        for path in (stale, alive):
            if os.path.exists(path):
                os.unlink(path)


def test_shm_region_larger_than_dev_shm_is_a_clear_start_up_error() -> None:
    stats = os.statvfs(SHM_DIR)
    too_big = stats.f_bavail * stats.f_frsize + (1 << 30)
    before = {n for n in os.listdir(SHM_DIR) if n.startswith(SHM_PREFIX)}
    with pytest.raises(OSError, match="cannot hold the rows transfer region") as info:
        allocate_region(too_big, "rows", shared=True)
    assert info.value.errno == errno.ENOSPC and "EPD_TRANSFER_TRANSPORT=mooncake" in str(info.value)
    assert {n for n in os.listdir(SHM_DIR) if n.startswith(SHM_PREFIX)} == before  # no file left
