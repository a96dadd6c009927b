"""Addressing, aux records, states, config and message decoding (no processes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common.transfer import aux_record, messages
from common.transfer.addressing import pair_runs, slot_runs
from common.transfer.aux_record import AUX_RECORD_BYTES
from common.transfer.buffers import DataBuffers
from common.transfer.chunks import build_segments, dest_row_offset, layout_fields, plan_chunk
from common.transfer.config import TransferConfig
from common.transfer.destinations import check_init, region_sizes
from common.transfer.layout import BufferLayout
from common.transfer.liveness import PeerTracker
from common.transfer.sender_room import image_row_prefix
from common.transfer.types import AuxInfo, FailureKind, RoomState, advance
from protos.epd.v1 import transfer_pb2


def test_slot_runs_merge_adjacent_blocks_and_split_gaps() -> None:
    assert slot_runs((7, 8, 2), 4, 2, 8) == [(30, 6), (8, 2)]
    assert slot_runs((0, 1, 2), 4, 0, 12) == [(0, 12)]
    assert slot_runs((5,), 4, 0, 1) == [(20, 1)]
    with pytest.raises(ValueError):
        slot_runs((0,), 4, 2, 3)


def test_pair_runs_splits_where_either_side_breaks() -> None:
    src = [(0, 5), (10, 3)]
    dst = [(100, 2), (200, 6)]
    assert pair_runs(src, dst) == [(0, 100, 2), (2, 200, 3), (10, 203, 3)]
    with pytest.raises(ValueError):
        pair_runs([(0, 3)], [(0, 2)])


def test_plan_chunk_counts_image_rows_in_token_range() -> None:
    mask = np.array([0, 1, 1, 0, 1, 1, 1, 0], dtype=bool)
    prefix = image_row_prefix(mask)
    first = plan_chunk(prefix, 0, 3)
    assert (first.chunk_start, first.num_tokens, first.first_image_row, first.num_image_rows) == (
        0,
        3,
        0,
        2,
    )
    rest = plan_chunk(prefix, 3, 100)
    assert (rest.num_tokens, rest.first_image_row, rest.num_image_rows) == (5, 2, 3)


def test_aux_record_round_trip_and_limits() -> None:
    aux = AuxInfo(4097, 2048, mrope_delta=-7, num_items=2, extra=b"x" * 1024)
    chunk = aux_record.ChunkInfo(1024, 512, 300, 200)
    room, got, got_chunk = aux_record.unpack(aux_record.pack(2**62 + 5, aux, chunk))
    assert (room, got, got_chunk) == (2**62 + 5, aux, chunk)
    assert len(aux_record.pack(1, aux, chunk)) <= aux_record.AUX_RECORD_BYTES
    with pytest.raises(ValueError):
        AuxInfo(10, 1, extra=b"x" * 1025)
    with pytest.raises(ValueError):
        aux_record.unpack(bytes(aux_record.AUX_RECORD_BYTES))


def test_states_move_forward_only_and_failed_wins() -> None:
    s = RoomState
    assert advance(s.BOOTSTRAPPING, s.TRANSFERRING) == s.TRANSFERRING
    assert advance(s.TRANSFERRING, s.WAITING_FOR_INPUT) == s.TRANSFERRING
    assert advance(s.TRANSFERRING, s.FAILED) == s.FAILED
    assert advance(s.SUCCESS, s.FAILED) == s.SUCCESS
    assert advance(s.FAILED, s.SUCCESS) == s.FAILED
    for state in s:
        assert advance(state, state) == state


def test_config_validation() -> None:
    TransferConfig()
    with pytest.raises(ValueError):
        TransferConfig(default_tokens=1000)
    with pytest.raises(ValueError):
        TransferConfig(num_blocks=4, default_tokens=1024)
    with pytest.raises(ValueError):
        TransferConfig(transport="carrier-pigeon")
    with pytest.raises(ValueError):
        TransferConfig(heartbeat_interval_s=5.0, heartbeat_timeout_s=1.0)


def test_config_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from common.cli_config import add_cli_args, from_cli_args
    from common.transfer.config import ENV_PREFIX

    parser = argparse.ArgumentParser()
    add_cli_args(parser, TransferConfig, ENV_PREFIX)
    monkeypatch.setenv("EPD_TRANSFER_DEFAULT_TOKENS", "2048")
    config = from_cli_args(TransferConfig, parser.parse_args(["--transport", "shm"]), ENV_PREFIX)
    assert (config.default_tokens, config.transport) == (2048, "shm")


def test_decode_rejects_garbage_and_foreign_versions() -> None:
    ok = messages.envelope("tcp://x:1")
    ok.heartbeat.sent_at = 1.0
    assert messages.decode(ok.SerializeToString()).error == ""
    assert messages.decode(b"\xff\xff\xff\xff").error == "garbage"
    assert messages.decode(ok.SerializeToString()[:-3]).envelope is None
    future = transfer_pb2.TransferEnvelope(version=2, from_endpoint="x")
    future.heartbeat.sent_at = 1.0
    assert messages.decode(future.SerializeToString()).error == "unknown_version"
    assert messages.decode(transfer_pb2.TransferEnvelope(version=1).SerializeToString()).error


def test_decode_accepts_added_fields() -> None:
    msg = messages.envelope("tcp://x:1")
    msg.status.room = 7
    unknown = bytes([0xF8, 0x06, 0x2A])  # field 111 (varint) = 42, from a newer peer
    decoded = messages.decode(msg.SerializeToString() + unknown)
    assert decoded.envelope is not None and decoded.envelope.status.room == 7


def _init_for(layout, block_ids, sent_tokens, in_place, allocated) -> transfer_pb2.TransferInit:
    init = transfer_pb2.TransferInit(
        **layout_fields(layout),
        block_ids=block_ids,
        num_tokens_allocated=allocated,
        sent_tokens=sent_tokens,
        dest_token_offset=in_place,
    )
    base = 1 << 20
    for name, nbytes in region_sizes(init).items():  # rows at 1 MiB, the others behind
        region = getattr(init, name)
        region.base, region.nbytes = base, nbytes
        base += nbytes
    return init


def test_continuation_lands_behind_the_tokens_in_place() -> None:
    layout = BufferLayout(8, 4, 2, 0, torch.float32)  # 4-token blocks, 8-byte rows
    buffers = DataBuffers(layout, shared=False)
    try:
        mask = np.array([0, 1, 1, 1, 1, 0, 1, 1, 1, 1], dtype=bool)  # 10 tokens, 8 rows
        prefix = image_row_prefix(mask)
        # tokens 0..3 (3 rows) sit in blocks 5 and 6's front; the rest goes behind them
        init = _init_for(layout, [5, 6, 2], sent_tokens=4, in_place=4, allocated=6)
        assert check_init(init, layout) is None
        assert dest_row_offset(prefix, init) == 3
        chunk = plan_chunk(prefix, 4, init.num_tokens_allocated)
        assert (chunk.num_tokens, chunk.first_image_row, chunk.num_image_rows) == (6, 3, 5)
        segments = build_segments(buffers, (0, 1, 3), init, chunk, 3, 100)
        row_bytes = layout.row_bytes
        # rows 3..7 of the sender (slots 3, 4..7 of blocks 0, 1) -> row slots 3..7 of (5, 6)
        assert segments.dst_addrs[0] == (1 << 20) + (5 * 4 + 3) * row_bytes
        # the aux record goes to the block holding the chunk's first token: block 6, not 5
        assert segments.dst_addrs[-1] == init.aux.base + 6 * AUX_RECORD_BYTES
        assert sum(segments.lengths[:-1]) == 5 * row_bytes + 6 * 16
        too_far = _init_for(layout, [5, 6, 2], sent_tokens=4, in_place=5, allocated=6)
        assert check_init(too_far, layout)[0] == FailureKind.BAD_INIT  # more in place than sent
        too_big = _init_for(layout, [5, 6, 2], sent_tokens=4, in_place=4, allocated=9)
        assert check_init(too_big, layout)[0] == FailureKind.BAD_INIT  # past the last block
    finally:
        buffers.close()


def test_any_message_sent_counts_as_a_heartbeat() -> None:
    peers = PeerTracker(interval_s=1.0, timeout_s=5.0)
    peers.watch("a", now=10.0)  # a new peer: its first heartbeat is due a full interval later
    assert peers.due_heartbeats({"a"}, now=10.5) == []
    peers.sent("a", now=10.9)  # an init or status went out: no heartbeat needed until 11.9
    assert peers.due_heartbeats({"a"}, now=11.5) == []
    assert peers.due_heartbeats({"a"}, now=12.0) == ["a"]
    assert peers.due_heartbeats({"a"}, now=12.5) == []  # the heartbeat itself counts
    assert peers.silent({"a"}, now=15.5) == ["a"]  # nothing heard from it since 10.0
    peers.touch("a", now=15.6)
    assert peers.silent({"a"}, now=15.7) == []


def test_time_this_side_could_not_listen_is_not_a_peers_silence() -> None:
    peers = PeerTracker(interval_s=1.0, timeout_s=5.0)
    peers.watch("a", now=10.0)
    peers.overslept(4.0)  # the loop woke 4 s late: whatever "a" sent is still unread
    assert peers.silent({"a"}, now=14.5) == [] and peers.silence("a", 14.5) == 0.5
    assert peers.silent({"a"}, now=19.0) == ["a"]  # 5 s of listening heard nothing
    assert peers.silence("stranger", 19.0) == 0.0


def test_token_fields_round_trip_through_scattered_blocks() -> None:
    buffers = DataBuffers(BufferLayout(8, 4, 8, 0, torch.bfloat16), shared=False)
    try:
        blocks = (5, 1, 2)  # two runs: slots 20..23 and 4..11
        fill = np.arange(10, dtype=np.int32) + 100
        positions = np.arange(30, dtype=np.int64).reshape(3, 10)  # cast to int32 on the way
        rows = torch.randn(7, 8).to(torch.bfloat16)
        buffers.write_tokens(blocks, fill, positions, rows)
        got_fill, got_pos = buffers.read_tokens(blocks, 10)
        assert np.array_equal(got_fill, fill) and got_pos.dtype == np.int32
        assert got_pos.shape == (3, 10) and np.array_equal(got_pos, positions)
        assert np.array_equal(buffers.fill_ids[20:24], fill[:4])  # where the first run landed
        out = torch.empty(7, 8, dtype=torch.bfloat16)
        buffers.read_rows(blocks, 7, out)
        assert torch.equal(out, rows)
        empty_fill, empty_pos = buffers.read_tokens(blocks, 0)
        assert empty_fill.shape == (0,) and empty_pos.shape == (3, 0)
    finally:
        buffers.close()


def test_peer_restarts_strangers_and_the_next_due_time() -> None:
    peers = PeerTracker(interval_s=1.0, timeout_s=5.0)
    peers.touch("stranger", now=1.0, incarnation=7)  # not watched: nothing is recorded
    assert len(peers) == 0 and peers.next_due({"stranger"}) is None
    peers.watch("a", now=10.0, incarnation=7)
    assert peers.next_due({"a"}) == 11.0  # the first heartbeat, before the silence check
    assert peers.touch("a", now=10.5, incarnation=7) == 0
    assert peers.touch("a", now=10.6, incarnation=0) == 0  # an older peer does not say
    assert peers.touch("a", now=10.7, incarnation=9) == 7  # restarted: its old life is 7
    assert peers.touch("a", now=10.8, incarnation=9) == 0
    peers.due_heartbeats({"a"}, now=11.0)
    assert peers.next_due({"a"}) == 12.0
    peers.forget_idle(set())
    assert len(peers) == 0
