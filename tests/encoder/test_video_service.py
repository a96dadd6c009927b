"""A video through the encoder service: one item in the aux record (the video's hash and its
tokens), frame groups shipped as they are encoded, the embedding cache keeping them, metrics
counting frames and decode time, and a cancelled video giving its patch bytes back (a cancel
while it still decodes stopping the decode)."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from prometheus_client import generate_latest
from test_encoder_service import FakeSender, _hold_vit, _idle, _service, until

from services.encoder import video_prep
from services.encoder.convert import load_to_proto
from services.encoder.errors import DeadlineExpired, RequestCancelled, RoomInUse
from services.encoder.metrics import create_registry
from services.encoder.types import (
    ChatMessage,
    ContentPart,
    EncodeRequest,
    ImageSource,
    RoomStatus,
    VideoInput,
)
from services.encoder.video_decode import FrameHandoff
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


def test_cancel_while_the_video_decodes_stops_the_decode(qwen25_dir, monkeypatch):
    """``Cancel`` arrives (from another thread) while ``accept`` decodes the video, held after
    its first frame: the room fails at once (here and at the sender), the decode stops at the
    next frame (those already handed to other workers still run), ``accept`` raises
    ``RequestCancelled``, the patch bytes come back, no frame is counted, the room id stays
    refused, and the next request is served."""
    decoding, cancelled = threading.Event(), threading.Event()
    frames: list[int] = []
    decode_frames = video_prep.decode_frames

    workers: list[int] = []

    def held_after_the_first_frame(data, header, wanted, on_frame, stop=None, num_workers=1):
        workers.append(num_workers)

        def on_frame_held(index, rgb):
            on_frame(index, rgb)
            frames.append(index)
            if len(frames) == 1:
                decoding.set()
                assert cancelled.wait(30)

        return decode_frames(data, header, wanted, on_frame_held, stop, num_workers)

    monkeypatch.setattr(video_prep, "decode_frames", held_after_the_first_frame)
    sender = FakeSender()
    service = _service(qwen25_dir, sender)
    try:
        with ThreadPoolExecutor(1) as pool:
            accepting = pool.submit(service.accept, video_request(1))
            assert decoding.wait(30)
            load = service.load()
            assert load.queued_pixel_bytes > 0 and load.num_queued_requests == 0
            with pytest.raises(RoomInUse, match="room 1 is already in use .being accepted"):
                service.accept(video_request(1))
            assert service.cancel(1, "client went away")  # found: it is being accepted
            assert sender.failed[1] == "cancelled: client went away"
            record = service.wait(1, RoomStatus.SHIPPED, 0)
            assert record.status == RoomStatus.FAILED
            assert record.error == "cancelled: client went away"
            cancelled.set()
            with pytest.raises(RequestCancelled, match="client went away while decoding the video"):
                accepting.result(timeout=30)
        # stopped at the next frame it decoded; the frames already handed to the other
        # workers (at most the hand-off's limit) still ran
        assert workers == [torch.get_num_threads()]
        assert 1 <= len(frames) <= 1 + FrameHandoff.IN_FLIGHT_PER_WORKER * workers[0] < 8
        assert service.pipeline.video_totals()[0] == 0
        _idle(service)
        with pytest.raises(RoomInUse, match="room 1 is already in use .FAILED: cancelled"):
            service.accept(video_request(1))
        cancelled.set()  # later decodes run through
        service.accept(video_request(2))
        assert service.wait(2, RoomStatus.SHIPPED, 30).status == RoomStatus.SHIPPED
        _idle(service)
    finally:
        cancelled.set()
        service.close()


def test_cancel_after_the_decode_before_the_room_is_queued(qwen25_dir):
    """``Cancel`` lands between the end of the decode and the queueing: the room is not queued,
    ``accept`` raises ``RequestCancelled`` and the patch bytes come back."""
    sender = FakeSender()
    service = _service(qwen25_dir, sender)
    service.pipeline.on_prepare = lambda seconds: service.cancel(3, "language worker failed")
    try:
        with pytest.raises(RequestCancelled, match="language worker failed while it was accepted"):
            service.accept(video_request(3))
        assert sender.failed[3] == "cancelled: language worker failed"
        assert 3 not in sender.expected
        assert service.wait(3, RoomStatus.SHIPPED, 0).status == RoomStatus.FAILED
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
