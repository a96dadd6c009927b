"""Encoder.Cancel against a real encoder process with its real transfer sender: a room in each
state is dropped, nothing stays queued or held, and the encoder keeps serving."""

from __future__ import annotations

import json
import time

import grpc
import numpy as np
import pytest
from encoder_helpers import encode_bytes, encoder_process, noise_image
from PIL import Image

from protos.epd.v1 import common_pb2, encoder_pb2, encoder_pb2_grpc

NUM_BLOCKS = 24  # 3072 tokens of transfer buffer
QUEUED, ENCODED = encoder_pb2.ENCODE_STATUS_QUEUED, encoder_pb2.ENCODE_STATUS_ENCODED
SUBMITTED, FAILED = encoder_pb2.ENCODE_STATUS_SUBMITTED, encoder_pb2.ENCODE_STATUS_FAILED


def _gradient(side: int, shade: int) -> bytes:
    """A large image that compresses well (a few KB) but costs a real forward."""
    y, x = np.mgrid[0:side, 0:side]
    pixels = np.stack([x * 255 // side, y * 255 // side, np.full_like(x, shade)], -1)
    return encode_bytes(Image.fromarray(pixels.astype(np.uint8)))


@pytest.fixture(scope="module")
def stub(qwen25_dir):
    args = (
        "--transfer-num-blocks", str(NUM_BLOCKS), "--transfer-transport", "mooncake",
        "--max-batch-patches", "9216",  # a 1344x1344 image fills a forward alone
        "--transfer-bootstrap-timeout-s", "600",  # rooms nobody pulls stay until cancelled
    )  # fmt: skip
    with encoder_process(qwen25_dir, *args) as (address, _lines):
        with grpc.insecure_channel(address) as channel:
            yield encoder_pb2_grpc.EncoderStub(channel)


def _encode(stub, room: int, image: bytes) -> encoder_pb2.EncodeReply:
    parts = [
        common_pb2.ContentPart(image=common_pb2.ImageSource(data=image)),
        common_pb2.ContentPart(text="What is this?"),
    ]
    message = common_pb2.ChatMessage(role="user", content=parts)
    request = encoder_pb2.EncodeRequest(room=room, request_id=f"r{room}", messages=[message])
    return stub.Encode(request, timeout=30)


def _status(stub, room: int, until: int = QUEUED, timeout_s: float = 0.0):
    request = encoder_pb2.WaitEncodedRequest(room=room, until=until, timeout_s=timeout_s)
    return stub.WaitEncoded(request, timeout=timeout_s + 30)


def _cancel(stub, room: int, reason: str) -> bool:
    return stub.Cancel(encoder_pb2.CancelRequest(room=room, reason=reason), timeout=10).found


def _used_blocks(load: encoder_pb2.LoadReport) -> int:
    return json.loads(load.sender_stats_json)["num_used_blocks"]


def _settled(stub, timeout_s: float = 30.0) -> encoder_pb2.LoadReport:
    """GetLoad once nothing is queued, encoding, held in patches or in transfer blocks."""
    deadline = time.monotonic() + timeout_s
    while True:
        load = stub.GetLoad(encoder_pb2.GetLoadRequest(), timeout=10)
        idle = (load.num_queued_requests, load.num_queued_images, load.queued_pixel_bytes)
        if (idle == (0, 0, 0) and _used_blocks(load) == 0) or time.monotonic() > deadline:
            return load
        time.sleep(0.05)


def test_cancel_a_room_in_each_state(stub):
    # QUEUED: room 2 waits while room 1's 1344x1344 image is in the ViT (seconds here)
    _encode(stub, 1, _gradient(1344, 1))
    _encode(stub, 2, encode_bytes(noise_image(56, 56, 2)))
    assert _status(stub, 2).status == QUEUED
    assert _cancel(stub, 2, "client went away")
    outcome = _status(stub, 2)
    assert outcome.status == FAILED and outcome.error == "cancelled: client went away"
    # room 1, inside its forward: dropped when the forward returns
    assert _cancel(stub, 1, "deadline at the gateway")
    load = _settled(stub)
    assert (load.num_queued_requests, load.num_queued_images, load.queued_pixel_bytes) == (0, 0, 0)
    # room 1's forward ran to its end (it had started before three more calls came in); room
    # 2's image never ran
    assert load.num_images_encoded == 1 and load.num_forwards == 1

    # SUBMITTED: room 3 (2049 tokens: room 1's image, now cached) holds 17 of the sender's 24
    # blocks; no receiver pulls it
    _encode(stub, 3, _gradient(1344, 1))
    assert _status(stub, 3, SUBMITTED, 30).status == SUBMITTED
    assert _used_blocks(stub.GetLoad(encoder_pb2.GetLoadRequest())) == 17
    # ENCODED: room 4 (1320 tokens, 11 blocks) waits for blocks behind it
    _encode(stub, 4, _gradient(1008, 4))
    assert _status(stub, 4, ENCODED, 30).status == ENCODED
    assert stub.GetLoad(encoder_pb2.GetLoadRequest()).num_waiting_for_blocks == 1
    assert _cancel(stub, 4, "language worker refused")
    assert _status(stub, 4).status == FAILED
    assert _cancel(stub, 3, "language worker failed")
    assert _status(stub, 3).status == FAILED
    load = _settled(stub)
    assert load.num_queued_requests == 0 and load.num_waiting_for_blocks == 0
    assert _used_blocks(load) == 0  # the sender freed room 3's blocks
    stats = json.loads(load.sender_stats_json)
    assert stats["failed_by_reason"].get("encode_failed", 0) >= 2

    # unknown room: not found; its late Encode is refused
    assert not _cancel(stub, 99, "gateway gave up")
    with pytest.raises(grpc.RpcError) as info:
        _encode(stub, 99, encode_bytes(noise_image(56, 56, 9)))
    assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "before its Encode arrived" in info.value.details()

    # and it keeps serving
    _encode(stub, 5, encode_bytes(noise_image(56, 56, 5)))
    assert _status(stub, 5, SUBMITTED, 30).status == SUBMITTED
    assert _cancel(stub, 5, "done")
    assert _used_blocks(_settled(stub)) == 0
