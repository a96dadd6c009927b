"""The service's domain logic with a fake sender: shipping, retries, rejections, queue bound."""

from __future__ import annotations

import json
import threading

import pytest
from encoder_helpers import encode_bytes, noise_image

from common.transfer.types import RoomState
from services.encoder.config import EncoderConfig
from services.encoder.errors import InvalidInput, Overloaded, RoomInUse
from services.encoder.service import EncoderService
from services.encoder.types import (
    ChatMessage,
    ContentPart,
    EncodeRequest,
    ImageSource,
    RoomStatus,
)


class FakeSender:
    """Records submits; refuses the first ``num_refusals`` of them (blocks short)."""

    endpoint = "tcp://fake:1"

    def __init__(self, num_refusals: int = 0) -> None:
        self.num_refusals = num_refusals
        self.submitted: dict = {}
        self.failed: dict = {}
        self.lock = threading.Lock()

    def submit(self, room, fill_ids, positions, image_rows, aux, image_mask=None) -> bool:
        with self.lock:
            if self.num_refusals:
                self.num_refusals -= 1
                return False
            self.submitted[room] = (fill_ids, positions, image_rows, aux, image_mask)
            return True

    def fail(self, room, reason):
        self.failed[room] = reason

    def poll(self, room):
        return RoomState.SUCCESS if room in self.submitted else RoomState.FAILED

    def stats(self):
        return {"num_free_blocks": 7}

    def close(self):
        pass


def _request(room: int, *images: bytes, text: str = "What is it?") -> EncodeRequest:
    parts = [ContentPart(image=ImageSource("data", b)) for b in images]
    message = ChatMessage("user", (*parts, ContentPart(text=text)))
    return EncodeRequest(room=room, request_id=f"r{room}", messages=(message,))


def _service(qwen25_dir, sender, **overrides) -> EncoderService:
    config = EncoderConfig(device="cpu", submit_retry_s=0.01, **overrides)
    return EncoderService(qwen25_dir, config, sender)


def test_accept_encode_and_ship(qwen25_dir):
    sender = FakeSender(num_refusals=3)
    service = _service(qwen25_dir, sender)
    try:
        png = encode_bytes(noise_image(100, 80, 1))
        accepted = service.accept(_request(7, png, png))
        assert accepted.num_images == 2 and accepted.num_image_tokens == 2 * 12
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
        service.accept(_request(8, png, png))
        assert service.wait(8, RoomStatus.SHIPPED, timeout_s=10).num_cache_hits == 2
        with pytest.raises(RoomInUse):
            service.accept(_request(7, png))
    finally:
        service.close()


def test_rejections_fail_the_room_and_service_keeps_serving(qwen25_dir):
    sender = FakeSender()
    service = _service(qwen25_dir, sender)
    try:
        with pytest.raises(InvalidInput, match="image 1: data is not an image"):
            service.accept(_request(1, encode_bytes(noise_image(56, 56)), b"garbage"))
        assert "not an image" in sender.failed[1]
        service.accept(_request(2, encode_bytes(noise_image(56, 56))))
        assert service.wait(2, RoomStatus.SHIPPED, 10).status == RoomStatus.SHIPPED
    finally:
        service.close()


def test_queue_full_and_submit_timeout(qwen25_dir):
    sender = FakeSender(num_refusals=10**9)  # never has blocks
    service = _service(qwen25_dir, sender, max_queued_requests=1, submit_timeout_s=0.5)
    try:
        png = encode_bytes(noise_image(56, 56))
        service.accept(_request(1, png))
        assert service.wait(1, RoomStatus.ENCODED, 10).status == RoomStatus.ENCODED
        with pytest.raises(Overloaded, match="queue full"):
            service.accept(_request(2, png))
        assert sender.failed[2] == "encoder queue full"
        record = service.wait(1, RoomStatus.SHIPPED, 10)
        assert record.status == RoomStatus.FAILED and "no transfer blocks" in record.error
        assert "no transfer blocks" in sender.failed[1]
        service.accept(_request(3, png))  # room 1 no longer counts against the queue
    finally:
        service.close()
