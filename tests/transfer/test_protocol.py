"""Scenarios where every room succeeds: real Mooncake over tcp, sender in another process."""

from __future__ import annotations

import random

import pytest

from common.transfer.types import RoomState

from .conftest import assert_no_leaks, new_room, wait_for
from .helpers import collect, run_rooms, sender_state, spec


@pytest.mark.parametrize("total", [1, 127, 128, 129, 1023, 1024, 1025, 4097])
def test_lengths(sender, make_receiver, total: int) -> None:
    receiver = make_receiver()
    room = new_room()
    result = run_rooms(sender, receiver, [spec(room, total)])[room]
    assert result.num_transfers == (1 if total <= 1024 else 2)
    assert receiver.poll(room) == RoomState.SUCCESS
    assert sender.ask("call", "poll", room) == int(RoomState.SUCCESS)
    assert_no_leaks(sender, receiver)


def test_all_image_tokens_and_text_only(sender, make_receiver) -> None:
    receiver = make_receiver()
    specs = [spec(new_room(), 900, 900), spec(new_room(), 1500, 0), spec(new_room(), 300, 1)]
    run_rooms(sender, receiver, specs)
    assert_no_leaks(sender, receiver)


def test_init_before_data(sender, make_receiver) -> None:
    receiver = make_receiver()
    s = spec(new_room(), 2000)
    receiver.add_room(s.seed, sender.endpoint)
    assert wait_for(lambda: sender_state(sender, s.seed) == RoomState.WAITING_FOR_INPUT)
    assert receiver.poll(s.seed) == RoomState.WAITING_FOR_INPUT
    assert sender.ask("submit", s)
    result = collect(receiver, {s.seed})[s.seed]
    assert result.num_transfers == 2
    receiver.release(s.seed)
    assert_no_leaks(sender, receiver)


def test_data_before_init_and_mixed_order(sender, make_receiver) -> None:
    receiver = make_receiver()
    run_rooms(sender, receiver, [spec(new_room(), 700), spec(new_room(), 3000)], data_first=True)
    run_rooms(sender, receiver, [spec(new_room(), 700), spec(new_room(), 3000)], data_first=False)
    assert_no_leaks(sender, receiver)


def test_several_continuations(sender, make_receiver) -> None:
    receiver = make_receiver(num_blocks=4, default_tokens=256)
    s = spec(new_room(), 3000)
    result = run_rooms(sender, receiver, [s])[s.seed]
    # 256 first, then up to 4 blocks (512 tokens) per continuation: 1 + ceil(2744 / 512)
    assert result.num_transfers == 1 + 6
    assert receiver.stats()["peak_used_blocks"] <= 4
    assert_no_leaks(sender, receiver)


def test_buffers_short_so_continuations_wait(sender, make_receiver) -> None:
    receiver = make_receiver(num_blocks=10, default_tokens=1024)
    specs = [spec(new_room(), 3000) for _ in range(3)]
    results = run_rooms(sender, receiver, specs)
    assert all(r.num_transfers >= 2 for r in results.values())
    assert receiver.stats()["peak_used_blocks"] == 10
    assert_no_leaks(sender, receiver)


def test_non_contiguous_destination_blocks(sender, make_receiver) -> None:
    receiver = make_receiver(num_blocks=16)
    singles = [receiver.allocator.alloc(1) for _ in range(16)]
    for allocation in singles[::2]:
        receiver.allocator.free(allocation)  # free blocks are 0, 2, 4, ... 14
    s = spec(new_room(), 1000)
    run_rooms(sender, receiver, [s])
    for allocation in singles[1::2]:
        receiver.allocator.free(allocation)
    assert_no_leaks(sender, receiver)


def test_many_concurrent_rooms_mixing_sizes(sender, make_receiver) -> None:
    receiver = make_receiver(num_blocks=24, default_tokens=1024)
    rng = random.Random(7)
    specs = []
    for _ in range(30):
        total = rng.choice([1, 64, 500, 1024, 1025, 2000, 3500])
        specs.append(spec(new_room(), total, rng.randint(0, total)))
    results = run_rooms(sender, receiver, specs)
    assert {r.num_transfers for r in results.values()} >= {1, 2}
    stats = receiver.stats()
    assert stats["rooms_finished"] == {"SUCCESS": 30}
    assert_no_leaks(sender, receiver)


def test_deepstack_rows(make_receiver) -> None:
    from bench.peer import Peer

    from .conftest import layout_of, make_config

    config = make_config(num_blocks=32)
    sender = Peer("sender", config, layout_of(config, 32, num_deepstack=3))
    try:
        receiver = make_receiver()
        receiver_ds = type(receiver)(config, layout_of(config, 32, num_deepstack=3))
        try:
            run_rooms(sender, receiver_ds, [spec(new_room(), 1500)])
            assert_no_leaks(sender, receiver_ds)
        finally:
            receiver_ds.close()
    finally:
        sender.close()


@pytest.mark.slow
def test_soak_many_rooms_tight_buffer(sender, make_receiver) -> None:
    receiver = make_receiver(num_blocks=12, default_tokens=512)
    rng = random.Random(11)
    for _ in range(10):
        specs = []
        for _ in range(16):  # at most 16 x 2000 tokens: fits the sender's 256 blocks
            total = rng.randint(1, 2000)
            specs.append(spec(new_room(), total, rng.randint(0, total)))
        run_rooms(sender, receiver, specs, data_first=rng.random() < 0.5)
        assert_no_leaks(sender, receiver)
    assert receiver.stats()["peak_used_blocks"] <= 12
