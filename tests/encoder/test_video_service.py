"""A video through the encoder service: one item in the aux record (the video's hash and its
tokens), frame groups shipped as they are encoded, the embedding cache keeping them, metrics
counting frames and decode time, and a cancelled video giving its patch bytes back."""

from __future__ import annotations

import json

import pytest
from prometheus_client import generate_latest
from test_encoder_service import FakeSender, _hold_vit, _idle, _service, until

from services.encoder.convert import load_to_proto
from services.encoder.errors import DeadlineExpired
from services.encoder.metrics import create_registry
from services.encoder.types import (
    ChatMessage,
    ContentPart,
    EncodeRequest,
    ImageSource,
    RoomStatus,
    VideoInput,
)
from tests.media import make_video

CLIP = make_video(num_frames=16, width=64, height=48, fps=4, seed=11)  # 4 s: 8 frames


def video_request(room: int, data: bytes = CLIP, image: bytes | None = None) -> EncodeRequest:
    parts = [ContentPart(video=VideoInput(ImageSource("data", data)))]
    if image is not None:
        parts.append(ContentPart(image=ImageSource("data", image)))
    message = ChatMessage("user", (*parts, ContentPart(text="What happens?")))
    return EncodeRequest(room, f"r{room}", (message,))


def test_video_ships_as_one_item_in_frame_groups(qwen25_dir):
    sender = FakeSender()
    service = _service(qwen25_dir, sender, max_batch_patches=64, video_min_pixels=64 * 784)
    registry = create_registry(service)
    try:
        accepted = service.accept(video_request(1))
        assert accepted.num_images == 1 and len(accepted.image_hashes) == 1
        assert service.wait(1, RoomStatus.SHIPPED, 30).status == RoomStatus.SHIPPED
        fill_ids, _, rows, aux, mask = sender.submitted[1]
        extra = json.loads(aux.extra)
        assert extra["hashes"] == accepted.image_hashes
        assert extra["tokens"] == [int(mask.sum())] == [rows.shape[0]]
        assert len(sender.pieces[1]) == 4  # 4 frame groups, each handed over as encoded
        assert len(set(fill_ids[mask].tolist())) == 1  # one pad id for the whole video
        assert service.pipeline.batcher.num_forwards == 4
        # again: every frame group from the embedding cache, no forward
        service.accept(video_request(2))
        assert service.wait(2, RoomStatus.SHIPPED, 30).status == RoomStatus.SHIPPED
        assert service.rooms.get(2).num_cache_hits == 4
        assert service.pipeline.batcher.num_forwards == 4
        assert sender.submitted[2][0].tolist() == fill_ids.tolist()
        text = generate_latest(registry).decode()
        assert "epd_encoder_video_frames_total 8.0" in text  # the repeat decodes none
        assert "epd_encoder_video_decode_seconds_count 1.0" in text
        report = load_to_proto(service.load())  # what GetLoad and the status page show
        assert report.num_video_frames == 8 and report.video_decode_s > 0
        _idle(service)
    finally:
        service.close()


def test_cancelled_video_gives_its_patch_bytes_back(qwen25_dir):
    sender = FakeSender()
    service = _service(qwen25_dir, sender, max_batch_patches=64)
    gate, entered = _hold_vit(service)
    try:
        service.accept(video_request(1, make_video(num_frames=16, seed=12)))
        assert entered.wait(30)
        assert service.load().queued_pixel_bytes > 0
        assert service.cancel(1, "client went away")
        assert "cancelled: client went away" in sender.failed[1]
        gate.set()
        assert service.wait(1, RoomStatus.FAILED, 10).status == RoomStatus.FAILED
        # the ViT loop drops the cancelled task (and its frame groups' patches) after its step
        assert until(lambda: service.load().queued_pixel_bytes == 0)
        _idle(service)
    finally:
        gate.set()
        service.close()


def test_deadline_passing_during_intake_fails_the_room_and_frees_it(qwen25_dir):
    """The deadline passes while the video is decoded (the request left no time at all): the
    decode stops there, ``accept`` raises, the sender fails the room, its patch bytes come
    back and no room is left behind."""
    sender = FakeSender()
    service = _service(qwen25_dir, sender)
    try:
        request = video_request(1)
        request = EncodeRequest(request.room, request.request_id, request.messages, timeout_s=1e-9)
        with pytest.raises(DeadlineExpired, match="while decoding the video"):
            service.accept(request)
        assert "deadline passed while decoding the video" in sender.failed[1]
        assert service.load().num_queued_requests == 0
        assert until(lambda: service.load().queued_pixel_bytes == 0)
        _idle(service)
    finally:
        service.close()


def test_the_same_video_twice_in_a_request_is_encoded_once(qwen25_dir):
    sender = FakeSender()
    service = _service(qwen25_dir, sender)
    try:
        parts = [ContentPart(video=VideoInput(ImageSource("data", CLIP))) for _ in range(2)]
        message = ChatMessage("user", (*parts, ContentPart(text="Same?")))
        accepted = service.accept(EncodeRequest(1, "r1", (message,)))
        assert accepted.image_hashes[0] == accepted.image_hashes[1]
        assert service.wait(1, RoomStatus.SHIPPED, 30).status == RoomStatus.SHIPPED
        assert service.pipeline.batcher.num_images_encoded == 4  # its 4 frame groups, once
        _, _, rows, aux, mask = sender.submitted[1]
        assert rows.shape[0] == int(mask.sum()) == 2 * json.loads(aux.extra)["tokens"][0]
        _idle(service)
    finally:
        service.close()
