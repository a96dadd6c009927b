"""The sender trusts no destination an init names.

Unit checks of ``destinations.check_init`` for every rule, then forged inits sent to a live
sender process from a ``Forger`` socket: one pointing Mooncake at memory the receiver never
registered (Mooncake refuses it: the room fails with a clear error and not a byte lands), and
shared-memory ones naming files that are not receive regions or do not have the advertised size.
"""

from __future__ import annotations

import os
import uuid

import pytest
import torch

from bench.peer import Peer
from common.transfer.chunks import layout_fields
from common.transfer.control import MAX_INIT_BLOCKS
from common.transfer.destinations import check_init, region_sizes
from common.transfer.layout import BufferLayout
from common.transfer.regions import SHM_DIR, allocate_region, map_peer_region, valid_shm_name
from common.transfer.transport import host_id
from common.transfer.types import FailureKind, RoomState
from protos.epd.v1 import transfer_pb2

from .conftest import layout_of, make_config, new_room
from .forge import Forger
from .helpers import sender_state, spec

LAYOUT = BufferLayout(16, 4, 8, 0, torch.float32)


def _init(layout: BufferLayout = LAYOUT, base: int = 1 << 20) -> transfer_pb2.TransferInit:
    """A valid init for ``layout``'s geometry, regions back to back from ``base``."""
    init = transfer_pb2.TransferInit(
        **layout_fields(layout), block_ids=[3, 4], num_tokens_allocated=8, room=1
    )
    for name, nbytes in region_sizes(init).items():
        region = getattr(init, name)
        region.base, region.nbytes = base, nbytes
        base += nbytes
    return init


def _shm(init: transfer_pb2.TransferInit, names: dict[str, str]) -> None:
    for name, value in names.items():
        getattr(init, name).shm_name = value


def _region_name(field: str, pid: int = 4242) -> str:
    return f"epd-transfer-{pid}-{uuid.uuid4().hex[:12]}-{field}"


MUTATIONS = {
    "dtype": (lambda i: setattr(i, "dtype", "float16"), FailureKind.LAYOUT_MISMATCH, "dtype"),
    "region size": (lambda i: setattr(i.rows, "nbytes", i.rows.nbytes + 1), None, "rows region"),
    "overlap": (lambda i: setattr(i.aux, "base", i.rows.base + 8), None, "overlap"),
    "null base": (lambda i: setattr(i.fill_ids, "base", 0), None, "address space"),
    "wraps": (lambda i: setattr(i.aux, "base", 2**64 - 16), None, "address space"),
    "block id": (lambda i: i.block_ids.append(16), None, "block id 16 outside"),
    "huge block id": (lambda i: i.block_ids.append(2**32 - 1), None, "outside"),
    "block twice": (lambda i: i.block_ids.append(3), None, "twice"),
    "no blocks": (lambda i: i.ClearField("block_ids"), None, "0 destination blocks"),
    "too many": (
        lambda i: i.block_ids.extend(range(5, MAX_INIT_BLOCKS + 5)),
        None,
        "destination blocks",
    ),
    "geometry": (lambda i: setattr(i, "block_size", 0), None, "geometry"),
    "aux records": (lambda i: setattr(i, "aux_record_bytes", 64), None, "too small"),
    "past blocks": (lambda i: setattr(i, "num_tokens_allocated", 9), None, "exceed"),
    "nothing": (lambda i: setattr(i, "num_tokens_allocated", 0), None, "no tokens"),
    "in place": (
        lambda i: (setattr(i, "dest_token_offset", 1), setattr(i, "num_tokens_allocated", 4)),
        None,
        "more tokens in place",
    ),
    "shm partly": (lambda i: _shm(i, {"rows": _region_name("rows")}), None, "some regions"),
    "shm path": (
        lambda i: _shm(
            i, {f: "../../etc/passwd" for f in ("rows", "fill_ids", "positions", "aux")}
        ),
        None,
        "not a region",
    ),
    "shm other field": (
        lambda i: _shm(
            i, {f: _region_name("aux") for f in ("rows", "fill_ids", "positions", "aux")}
        ),
        None,
        "rows region names",
    ),
}


def test_a_valid_init_passes() -> None:
    assert check_init(_init(), LAYOUT) is None
    init = _init()
    _shm(init, {f: _region_name(f) for f in ("rows", "fill_ids", "positions", "aux")})
    assert check_init(init, LAYOUT) is None


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_every_rule(mutation: str) -> None:
    change, kind, text = MUTATIONS[mutation]
    init = _init()
    change(init)
    problem = check_init(init, LAYOUT)
    assert problem is not None
    assert problem[0] == (kind or FailureKind.BAD_INIT) and text in problem[1], problem


def test_shm_names_and_files() -> None:
    assert valid_shm_name(_region_name("positions"), "positions")
    assert not valid_shm_name(_region_name("positions"), "rows")
    assert not valid_shm_name("epd-transfer-12-xyz-rows")
    name = _region_name("rows", os.getpid())
    path = os.path.join(SHM_DIR, name)
    link = os.path.join(SHM_DIR, _region_name("aux", os.getpid()))
    with open(path, "wb") as f:
        f.write(b"\x01" * 100)
    os.symlink(path, link)
    try:
        with pytest.raises(ValueError, match="100 bytes, the init advertises 4096"):
            map_peer_region(name, 4096)
        with pytest.raises(OSError):
            map_peer_region(os.path.basename(link), 100)  # never through a symbolic link
        mapped, _ = map_peer_region(name, 100)
        mapped.close()
    finally:
        os.unlink(link)
        os.unlink(path)


def _forged_init(receiver, room: int, forger: Forger, to: str, base: int) -> bytes:
    """A signed-as-needed init shaped exactly like ``receiver``'s (its Mooncake engine, its
    geometry) but with every region placed from ``base`` on."""
    env = forger.envelope(to)
    env.init.CopyFrom(receiver._make_init_template())
    env.init.room, env.init.receiver_endpoint = room, forger.endpoint
    env.init.host_id = "another-host"  # Mooncake, not shared memory
    env.init.block_ids.extend(range(8))
    env.init.num_tokens_allocated = 1024
    for name, nbytes in region_sizes(env.init).items():
        region = getattr(env.init, name)
        region.base, region.nbytes = base, nbytes
        base += nbytes
    return forger.seal(env)


@pytest.fixture(scope="module")
def patient_sender():
    """Slow to give up on a write or a silent peer: only the write's own error can end it."""
    config = make_config(num_blocks=64, transfer_timeout_s=30.0, heartbeat_timeout_s=30.0)
    peer = Peer("sender", config, layout_of(config))
    yield peer
    peer.close()


def test_mooncake_refuses_memory_the_receiver_did_not_register(
    patient_sender, make_receiver
) -> None:
    sender = patient_sender
    receiver = make_receiver()  # registered its buffers with Mooncake; nothing else
    s = spec(new_room(), 700)
    assert sender.ask("submit", s)
    forger = Forger()
    sizes = region_sizes(receiver._make_init_template())
    victim = allocate_region(sum(sizes.values()), "victim", shared=False)  # never registered
    victim.data.fill_(0x5A)
    try:
        forger.push(
            sender.endpoint, _forged_init(receiver, s.seed, forger, sender.endpoint, victim.base)
        )
        replies = [r.status for r in forger.replies(3.0) if r.WhichOneof("body") == "status"]
        failed = [r for r in replies if r.state == transfer_pb2.TRANSFER_STATE_FAILED]
        assert len(failed) == 1, replies
        assert failed[0].error_kind == FailureKind.WRITE_FAILED
        assert failed[0].error.startswith("write_failed: Mooncake")
        assert not failed[0].write_in_flight
        assert sender_state(sender, s.seed) == RoomState.FAILED
        assert bool((victim.data == 0x5A).all())  # not a byte landed
        for region in receiver.buffers.regions.values():
            assert int(region.data.count_nonzero()) == 0  # nor in the registered buffers
        assert sender.ask("wait_idle", 10.0)["num_used_blocks"] == 0
    finally:
        forger.close()
        victim.close()


@pytest.fixture(scope="module")
def shm_sender():
    config = make_config(num_blocks=64, transport="shm")
    peer = Peer("sender", config, layout_of(config))
    yield peer
    peer.close()


@pytest.mark.parametrize("which", ["not a region", "wrong size"])
def test_shm_init_naming_foreign_files_fails_and_writes_nothing(
    shm_sender, make_receiver, which: str
) -> None:
    receiver = make_receiver(transport="shm")
    s = spec(new_room(), 300)
    assert shm_sender.ask("submit", s)
    forger = Forger()
    files = []
    try:
        env = forger.envelope(shm_sender.endpoint)
        env.init.CopyFrom(receiver._make_init_template())
        env.init.room, env.init.receiver_endpoint = s.seed, forger.endpoint
        env.init.host_id = host_id()
        env.init.block_ids.extend(range(8))
        env.init.num_tokens_allocated = 1024
        for field in ("rows", "fill_ids", "positions", "aux"):
            name = f"epd-victim-{os.getpid()}-{field}"
            if which == "wrong size":
                name = _region_name(field, os.getpid())
            path = os.path.join(SHM_DIR, name)
            with open(path, "wb") as f:
                f.write(b"\x5a" * 4096)
            files.append(path)
            getattr(env.init, field).shm_name = name
        forger.push(shm_sender.endpoint, forger.seal(env))
        failed = [r.status for r in forger.replies(2.0) if r.status.state == 4]
        assert len(failed) == 1 and failed[0].error_kind == FailureKind.BAD_INIT, failed
        expected = "not a region" if which == "not a region" else "the init advertises"
        assert expected in failed[0].error
        for path in files:
            with open(path, "rb") as f:
                assert f.read() == b"\x5a" * 4096
        assert shm_sender.ask("wait_idle", 10.0)["num_used_blocks"] == 0
    finally:
        forger.close()
        for path in files:
            os.unlink(path)
