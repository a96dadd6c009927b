"""The service's room state machine with a fake sender (a test double of the transfer plane):
shipping, retries, rejections, deadlines, the queue and pixel bounds, cancellation."""

from __future__ import annotations

import json
import re
import threading
import time

import pytest
import torch
from encoder_helpers import encode_bytes, noise_image
from prometheus_client import generate_latest

from common.transfer.types import RoomState
from services.encoder.config import EncoderConfig
from services.encoder.errors import InvalidInput, Overloaded, RoomInUse
from services.encoder.metrics import create_registry
from services.encoder.service import EncoderService
from services.encoder.types import (
    ChatMessage,
    ContentPart,
    EncodeRequest,
    ImageSource,
    RoomStatus,
)


class FakeSender:
    """Records submits, expects and fails; refuses the first ``num_refusals`` submits (blocks
    short); a submitted room's state is ``states[room]`` (SUCCESS unless a test sets it)."""

    endpoint = "tcp://fake:1"

    def __init__(self, num_refusals: int = 0) -> None:
        self.num_refusals = num_refusals
        self.submitted: dict = {}
        self.failed: dict = {}
        self.expected: dict = {}
        self.states: dict = {}
        self.pieces: dict = {}  # room -> rows handed over image by image (begin, add_rows)
        self.lock = threading.Lock()

    def submit(self, room, fill_ids, positions, image_rows, aux, image_mask=None) -> bool:
        with self.lock:
            if self.num_refusals:
                self.num_refusals -= 1
                return False
            self.submitted[room] = (fill_ids, positions, image_rows, aux, image_mask)
            return True

    def begin(self, room, fill_ids, positions, aux, image_mask=None, image_rows=None) -> bool:
        with self.lock:
            self.submitted[room] = (fill_ids, positions, image_rows, aux, image_mask)
            self.pieces.setdefault(room, []).append(image_rows)
            return True

    def add_rows(self, room, image_rows, aux=None):
        with self.lock:
            self.pieces[room].append(image_rows)
            if aux is not None:
                fill_ids, positions, _, _, mask = self.submitted[room]
                rows = torch.cat(self.pieces[room])
                self.submitted[room] = (fill_ids, positions, rows, aux, mask)

    def expect(self, room, deadline):
        self.expected[room] = deadline

    def fail(self, room, reason):
        self.failed[room] = reason

    def poll(self, room):
        if room in self.failed:
            return RoomState.FAILED
        return self.states.get(room, RoomState.SUCCESS)

    def stats(self):
        return {"num_free_blocks": 7}

    def close(self):
        pass


def _request(room: int, *images: bytes, text: str = "What is it?", timeout_s: float = 0.0):
    parts = [ContentPart(image=ImageSource("data", b)) for b in images]
    message = ChatMessage("user", (*parts, ContentPart(text=text)))
    return EncodeRequest(room, f"r{room}", (message,), timeout_s=timeout_s)


def _service(qwen25_dir, sender, **overrides) -> EncoderService:
    config = EncoderConfig(device="cpu", dtype="float32", submit_retry_s=0.01, **overrides)
    return EncoderService(qwen25_dir, config, sender)


def _hold_vit(service: EncoderService) -> tuple[threading.Event, threading.Event]:
    """(gate, entered): the ViT loop's next forward waits for ``gate``."""
    gate, entered = threading.Event(), threading.Event()
    forward = service.pipeline.batcher._forward

    def held(pixels, grids):
        entered.set()
        assert gate.wait(30)
        return forward(pixels, grids)

    service.pipeline.batcher._forward = held
    return gate, entered


def until(predicate, timeout_s: float = 10.0) -> bool:
    """Whether ``predicate`` became true within ``timeout_s`` (checked every 10 ms)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _idle(service: EncoderService) -> None:
    load = service.load()
    assert (load.num_queued_requests, load.num_queued_images, load.queued_pixel_bytes) == (0, 0, 0)
    assert load.num_waiting_for_blocks == 0


PNG = encode_bytes(noise_image(100, 80, 1))


def test_accept_encode_and_ship(qwen25_dir):
    sender = FakeSender(num_refusals=3)
    service = _service(qwen25_dir, sender)
    try:
        before = time.monotonic()
        accepted = service.accept(_request(7, PNG, PNG))
        assert accepted.num_images == 2 and accepted.num_image_tokens == 2 * 12
        # announced to the sender with the default deadline (no timeout_s in the request)
        assert before + 120 <= sender.expected[7] <= time.monotonic() + 120
        record = service.wait(7, RoomStatus.SHIPPED, timeout_s=10)
        assert record.status == RoomStatus.SHIPPED and record.error == ""
        fill_ids, positions, rows, aux, mask = sender.submitted[7]
        assert aux.total_tokens == len(fill_ids) == accepted.num_tokens
        assert aux.num_image_rows == rows.shape[0] == mask.sum() == 24 and aux.num_items == 2
        assert positions.shape == (3, len(fill_ids)) and aux.mrope_delta < 0
        extra = json.loads(aux.extra)
        assert extra["tokens"] == [12, 12] and extra["hits"] == 0  # deduplicated, not cached
        assert extra["hashes"] == accepted.image_hashes
        assert service.shipper.num_submit_retries >= 3
        load = service.load()
        assert load.num_queued_requests == 0 and load.sender["num_free_blocks"] == 7
        assert load.cache["num_misses"] == 1 and load.num_images_encoded == 1
        service.accept(_request(8, PNG, PNG, timeout_s=5.0))
        assert 0 < sender.expected[8] - time.monotonic() <= 5.0
        assert service.wait(8, RoomStatus.SHIPPED, timeout_s=10).num_cache_hits == 2
        with pytest.raises(RoomInUse, match=r"room 7 is already in use \(SHIPPED\)"):
            service.accept(_request(7, PNG))
        _idle(service)
        # nothing pending: the shipper sleeps instead of polling
        passes = service.shipper.num_passes
        time.sleep(0.3)
        assert service.shipper.num_passes == passes
    finally:
        service.close()


def test_rejections_fail_the_room_and_service_keeps_serving(qwen25_dir):
    sender = FakeSender()
    service = _service(qwen25_dir, sender)
    try:
        with pytest.raises(InvalidInput, match="image 1: data is not an image"):
            service.accept(_request(1, encode_bytes(noise_image(56, 56)), b"garbage"))
        assert "not an image" in sender.failed[1]
        for room, bad in ((3, float("nan")), (4, -1.0), (5, float("inf"))):
            with pytest.raises(InvalidInput, match="timeout_s must be a finite number >= 0"):
                service.accept(_request(room, PNG, timeout_s=bad))
            assert "timeout_s" in sender.failed[room]
        service.accept(_request(2, encode_bytes(noise_image(56, 56))))
        assert service.wait(2, RoomStatus.SHIPPED, 10).status == RoomStatus.SHIPPED
        _idle(service)
    finally:
        service.close()


def test_queue_bound_and_the_deadline_bounds_the_wait_for_blocks(qwen25_dir):
    sender = FakeSender(num_refusals=10**9)  # never has blocks
    service = _service(qwen25_dir, sender, max_queued_requests=1)
    try:
        start = time.monotonic()
        service.accept(_request(1, PNG, timeout_s=1.0))
        assert service.wait(1, RoomStatus.ENCODED, 10).status == RoomStatus.ENCODED
        with pytest.raises(Overloaded, match="queue full"):
            service.accept(_request(2, PNG))
        assert "encoder queue full" in sender.failed[2]
        record = service.wait(1, RoomStatus.SHIPPED, 10)
        assert record.status == RoomStatus.FAILED and "no transfer blocks" in record.error
        assert time.monotonic() - start >= 1.0  # not before the request's deadline
        assert "no transfer blocks" in sender.failed[1]
        service.accept(_request(3, PNG))  # room 1 no longer counts against the queue
        assert service.wait(3, RoomStatus.ENCODED, 10).status == RoomStatus.ENCODED
        assert service.cancel(3, "test over")
        _idle(service)
    finally:
        service.close()


def test_a_room_past_its_deadline_is_never_encoded(qwen25_dir):
    sender = FakeSender()
    service = _service(qwen25_dir, sender)
    gate, entered = _hold_vit(service)
    try:
        service.accept(_request(1, PNG))
        assert entered.wait(30)  # the ViT is busy with room 1
        service.accept(_request(2, encode_bytes(noise_image(90, 90, 2)), timeout_s=0.2))
        assert service.load().queued_pixel_bytes > 0
        time.sleep(0.3)
        gate.set()
        record = service.wait(2, RoomStatus.SHIPPED, 10)
        assert record.status == RoomStatus.FAILED
        assert re.fullmatch(r"deadline: passed after \d+\.\ds in the ViT queue", record.error)
        assert sender.failed[2].startswith("deadline:") and 2 not in sender.submitted
        assert service.wait(1, RoomStatus.SHIPPED, 10).status == RoomStatus.SHIPPED
        load = service.load()
        assert load.num_images_encoded == 1 and service.pipeline.batcher.num_expired == 1
        _idle(service)
    finally:
        gate.set()
        service.close()


def test_pixel_budget_refusal_is_overloaded_and_fails_the_room(qwen25_dir):
    sender = FakeSender()
    service = _service(qwen25_dir, sender, max_queued_pixel_mb=1)
    gate, entered = _hold_vit(service)
    try:
        service.accept(_request(1, encode_bytes(noise_image(700, 700, 1))))  # 11 MiB, alone
        assert entered.wait(30)
        assert service.load().queued_pixel_bytes == 625 * 18816
        metrics = generate_latest(create_registry(service)).decode()
        assert "epd_encoder_queued_pixel_bytes 1.176e+07" in metrics  # 625 * 18816
        with pytest.raises(Overloaded, match="pixel budget full"):
            service.accept(_request(2, PNG))
        assert "pixel budget full" in sender.failed[2]
        gate.set()
        assert service.wait(1, RoomStatus.SHIPPED, 10).status == RoomStatus.SHIPPED
        service.accept(_request(3, PNG))
        assert service.wait(3, RoomStatus.SHIPPED, 10).status == RoomStatus.SHIPPED
        _idle(service)
    finally:
        gate.set()
        service.close()


def test_cancel_in_every_state(qwen25_dir):
    sender = FakeSender()
    service = _service(qwen25_dir, sender)
    gate, entered = _hold_vit(service)
    try:
        # QUEUED (room 2 waits behind room 1, whose forward is held): never encoded
        service.accept(_request(1, PNG))
        assert entered.wait(30)
        service.accept(_request(2, encode_bytes(noise_image(90, 90, 2))))
        assert service.load().num_queued_images == 2
        assert service.cancel(2, "client went away")
        record = service.wait(2, RoomStatus.SHIPPED, 0)
        assert record.status == RoomStatus.FAILED
        assert record.error == "cancelled: client went away"
        assert sender.failed[2] == "cancelled: client went away"
        assert service.load().num_queued_images == 1
        # QUEUED inside the running forward: marked, dropped when the forward ends
        assert service.cancel(1, "")
        assert sender.failed[1] == "cancelled: by the caller"
        gate.set()
        assert service.wait(1, RoomStatus.SHIPPED, 10).status == RoomStatus.FAILED
        assert until(lambda: service.load().queued_pixel_bytes == 0)  # the forward ended
        assert not sender.submitted and service.load().num_images_encoded == 1
        # ENCODED, waiting for blocks
        sender.num_refusals = 10**9
        service.accept(_request(3, PNG))
        assert service.wait(3, RoomStatus.ENCODED, 10).status == RoomStatus.ENCODED
        assert service.cancel(3, "x" * 1000)
        assert len(sender.failed[3]) == len("cancelled: ") + 200
        assert service.load().num_waiting_for_blocks == 0
        # SUBMITTED, held by the sender: failed there (our fake then reports FAILED)
        sender.num_refusals = 0
        sender.states[4] = RoomState.TRANSFERRING
        service.accept(_request(4, PNG))
        assert service.wait(4, RoomStatus.SUBMITTED, 10).status == RoomStatus.SUBMITTED
        assert service.cancel(4, "deadline at the gateway")
        assert service.wait(4, RoomStatus.SHIPPED, 10).status == RoomStatus.FAILED
        # final rooms are found and stay as they were
        assert service.cancel(4, "again") and service.rooms.get(4).error.startswith("cancelled")
        # unknown: not found, failed at the sender all the same, and a late Encode is refused
        assert not service.cancel(99, "gateway gave up")
        assert sender.failed[99] == "cancelled: gateway gave up"
        with pytest.raises(RoomInUse, match="room 99 is already in use .*before its Encode"):
            service.accept(_request(99, PNG))
        _idle(service)
        service.accept(_request(5, PNG))  # and it keeps serving
        assert service.wait(5, RoomStatus.SHIPPED, 10).status == RoomStatus.SHIPPED
    finally:
        gate.set()
        service.close()


def test_an_expect_that_fails_does_not_strand_the_room(qwen25_dir):
    class BrokenExpect(FakeSender):
        def expect(self, room, deadline):
            raise RuntimeError("transfer plane refused the announcement")

    sender = BrokenExpect()
    service = _service(qwen25_dir, sender)
    try:
        service.accept(_request(1, PNG))
        assert service.wait(1, RoomStatus.SHIPPED, 10).status == RoomStatus.SHIPPED
        _idle(service)
    finally:
        service.close()


def _three_images() -> list[bytes]:
    return [encode_bytes(noise_image(100 + 20 * i, 80, 10 + i)) for i in range(3)]


def test_a_request_ships_image_by_image(qwen25_dir):
    """One ViT forward per image: the room is begun with the first image's rows and each next
    image's rows follow (the last with the final metadata); together they are the rows a
    whole-prompt submit ships."""
    sender = FakeSender()
    service = _service(qwen25_dir, sender, max_batch_patches=4)
    try:
        service.accept(_request(40, *_three_images()))
        assert service.wait(40, RoomStatus.SHIPPED, timeout_s=20).status == RoomStatus.SHIPPED
        pieces = sender.pieces[40]
        assert len(pieces) >= 2 and pieces[0] is not None and len(pieces[0]) > 0
        _, _, rows, aux, mask = sender.submitted[40]
        assert rows.shape[0] == aux.num_image_rows == int(mask.sum())
        assert json.loads(aux.extra)["encode_s"] > 0  # the final metadata came last
        whole = FakeSender()
        other = _service(qwen25_dir, whole, ship_per_image=False, cache_mb=0)
        try:
            other.accept(_request(41, *_three_images()))
            assert other.wait(41, RoomStatus.SHIPPED, timeout_s=20).status == RoomStatus.SHIPPED
            assert 41 not in whole.pieces
            assert torch.equal(whole.submitted[41][2], rows)
        finally:
            other.close()
        _idle(service)
    finally:
        service.close()


def test_a_transfer_failed_between_images_cancels_the_room(qwen25_dir):
    """The receiver gave the room up after its first image: the encoder cancels the rest."""
    sender = FakeSender()
    service = _service(qwen25_dir, sender, max_batch_patches=4)
    gate = threading.Event()
    forward, calls = service.pipeline.batcher._forward, []

    def first_then_held(pixels, grids):  # the first image's forward, then wait for the gate
        calls.append(len(grids))
        if len(calls) > 1:
            assert gate.wait(30)
        return forward(pixels, grids)

    service.pipeline.batcher._forward = first_then_held
    try:
        service.accept(_request(42, *_three_images()))
        assert until(lambda: 42 in sender.pieces)  # begun with its first image
        sender.states[42] = RoomState.FAILED
        record = service.wait(42, RoomStatus.SHIPPED, timeout_s=20)
        gate.set()
        assert record.status == RoomStatus.FAILED
        assert "the transfer failed before its last image" in record.error
        # a forward running when it was cancelled gives its patches back as it ends
        assert until(lambda: service.load().queued_pixel_bytes == 0)
        _idle(service)
    finally:
        service.close()
