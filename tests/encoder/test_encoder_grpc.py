"""The gRPC service in a real separate process: Encode, WaitEncoded, GetLoad, Cancel of a room
whose video decodes, health, reflection."""

from __future__ import annotations

import base64
import json
import time

import grpc
import pytest
from encoder_helpers import encode_bytes, encoder_process, noise_image
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from protos.epd.v1 import common_pb2, encoder_pb2, encoder_pb2_grpc
from tests.media import make_video


@pytest.fixture(scope="module")
def server(qwen25_dir):
    """(address, output lines) of an encoder process."""
    args = (
        "--sender", "transfer", "--transfer-num-blocks", "32", "--transfer-transport", "shm",
        "--transfer-bootstrap-timeout-s", "600",  # rooms nobody pulls stay for the whole module
    )  # fmt: skip
    with encoder_process(qwen25_dir, *args, env={"EPD_ENCODER_MAX_IMAGES": "2"}) as started:
        yield started


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(
        server[0], options=[("grpc.max_send_message_length", 64 << 20)]
    ) as ch:
        yield ch


def _request(room: int, *sources: common_pb2.ImageSource) -> encoder_pb2.EncodeRequest:
    parts = [common_pb2.ContentPart(image=s) for s in sources]
    parts.append(common_pb2.ContentPart(text="What is this?"))
    message = common_pb2.ChatMessage(role="user", content=parts)
    return encoder_pb2.EncodeRequest(room=room, request_id=f"req-{room}", messages=[message])


def test_encode_wait_and_load(channel):
    stub = encoder_pb2_grpc.EncoderStub(channel)
    png = encode_bytes(noise_image(100, 80, 1))
    b64 = base64.b64encode(png).decode()
    reply = stub.Encode(
        _request(11, common_pb2.ImageSource(data=png), common_pb2.ImageSource(base64=b64))
    )
    assert reply.room == 11 and reply.num_images == 2 and reply.num_image_tokens == 24
    assert reply.image_hashes[0] == reply.image_hashes[1]
    assert reply.sender_endpoint.startswith("tcp://")
    outcome = stub.WaitEncoded(
        encoder_pb2.WaitEncodedRequest(
            room=11, until=encoder_pb2.ENCODE_STATUS_SUBMITTED, timeout_s=30
        )
    )
    # no receiver ever asks for it: the sender holds the room
    assert outcome.status == encoder_pb2.ENCODE_STATUS_SUBMITTED
    assert outcome.num_tokens == reply.num_tokens
    load = stub.GetLoad(encoder_pb2.GetLoadRequest())
    assert load.num_images_encoded == 1 and load.cache.num_misses == 1
    assert load.free_blocks < 32 and load.sender_endpoint == reply.sender_endpoint
    # what heartbeats advertise: the rows it sends, the longest prompt (the buffer's 32 blocks)
    assert load.transfer_layout == common_pb2.TransferLayout(
        hidden_size=128, num_deepstack=0, dtype="bfloat16", block_size=128
    )
    assert load.max_prompt_tokens == 32 * 128

    # a large image needs a raised receive limit (5+ MB)
    big = encode_bytes(noise_image(1400, 1400, 2))
    assert len(big) > 4 << 20
    assert stub.Encode(_request(12, common_pb2.ImageSource(data=big))).num_images == 1


def _encode_failed(stub) -> int:
    stats = json.loads(stub.GetLoad(encoder_pb2.GetLoadRequest()).sender_stats_json)
    return stats["failed_by_reason"].get("encode_failed", 0)


def test_errors_map_to_status_codes(channel):
    stub = encoder_pb2_grpc.EncoderStub(channel)
    png = encode_bytes(noise_image(56, 56))
    no_time = _request(27, common_pb2.ImageSource(data=png))
    no_time.timeout_s = float("nan")
    failed_before = _encode_failed(stub)
    cases = [
        (_request(21, common_pb2.ImageSource(data=b"nope")), "INVALID_ARGUMENT", "not an image"),
        (_request(22, common_pb2.ImageSource(base64="@@@")), "INVALID_ARGUMENT", "base64"),
        (_request(23, *[common_pb2.ImageSource(data=png)] * 3), "INVALID_ARGUMENT", "limit is 2"),
        (_request(24, common_pb2.ImageSource(url="http://10.0.0.1/")), "INVALID_ARGUMENT", "URLs"),
        (_request(26, common_pb2.ImageSource()), "INVALID_ARGUMENT", "image part without a source"),
        (no_time, "INVALID_ARGUMENT", "timeout_s must be a finite number >= 0"),
        (_request(11, common_pb2.ImageSource(data=png)), "ALREADY_EXISTS", "room 11"),
    ]  # fmt: skip
    for request, code, needle in cases:
        with pytest.raises(grpc.RpcError) as info:
            stub.Encode(request)
        assert info.value.code().name == code and needle in info.value.details()
    # each refused room was failed at the sender (a waiting receiver learns at once), except
    # the one whose id is live here: that room is not the refused request's to fail
    assert _encode_failed(stub) - failed_before == len(cases) - 1
    live = stub.WaitEncoded(encoder_pb2.WaitEncodedRequest(room=11))
    assert live.status == encoder_pb2.ENCODE_STATUS_SUBMITTED
    with pytest.raises(grpc.RpcError) as info:
        stub.WaitEncoded(encoder_pb2.WaitEncodedRequest(room=999))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert stub.Encode(_request(25, common_pb2.ImageSource(data=png))).num_images == 1


def test_cancel_while_the_video_decodes_answers_cancelled(channel):
    """``Cancel`` of a room whose ``Encode`` still decodes its video (seconds of frames): the
    decode stops at the next frame, ``Encode`` answers CANCELLED, the room is FAILED, no frame
    is counted and the patch bytes come back."""
    stub = encoder_pb2_grpc.EncoderStub(channel)
    clip = make_video(num_frames=1200, width=320, height=240, fps=4, seed=23)
    # 600 frames sampled, each 56x56 (4 tokens a frame group): well within the prompt limit
    sampling = common_pb2.VideoSampling(max_pixels=56 * 56)
    source = common_pb2.ImageSource(data=clip)
    video = common_pb2.VideoPart(source=source, sampling=sampling)
    parts = [common_pb2.ContentPart(video=video), common_pb2.ContentPart(text="What happens?")]
    message = common_pb2.ChatMessage(role="user", content=parts)
    request = encoder_pb2.EncodeRequest(room=41, request_id="req-41", messages=[message])
    before = stub.GetLoad(encoder_pb2.GetLoadRequest())
    encoding = stub.Encode.future(request, timeout=120)

    def decoding() -> bool:  # the patch bytes reserved, no room queued yet: inside accept
        load = stub.GetLoad(encoder_pb2.GetLoadRequest())
        return load.queued_pixel_bytes > 0 and load.num_queued_requests == 0

    deadline = time.monotonic() + 30
    while not decoding():
        assert time.monotonic() < deadline, "the encoder never started decoding the video"
        time.sleep(0.01)
    cancel = encoder_pb2.CancelRequest(room=41, reason="client went away")
    assert stub.Cancel(cancel).found
    with pytest.raises(grpc.RpcError) as info:
        encoding.result()
    assert info.value.code() == grpc.StatusCode.CANCELLED, info.value.details()
    assert "cancelled: client went away while decoding the video" in info.value.details()
    outcome = stub.WaitEncoded(encoder_pb2.WaitEncodedRequest(room=41))
    assert outcome.status == encoder_pb2.ENCODE_STATUS_FAILED
    load = stub.GetLoad(encoder_pb2.GetLoadRequest())
    assert load.num_video_frames == before.num_video_frames
    assert load.queued_pixel_bytes == 0 and load.num_queued_requests == 0


def test_start_up_line_names_device_and_dtypes(server):
    lines = [line for line in server[1] if "compute dtype" in line]
    assert len(lines) == 1
    assert "device cpu, compute dtype float32, wire dtype bfloat16, max prompt 4096" in lines[0]


def test_health_and_reflection(channel):
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "epd.v1.Encoder"):
        status = health.Check(health_pb2.HealthCheckRequest(service=service)).status
        assert status == health_pb2.HealthCheckResponse.SERVING
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    responses = stub.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")])
    )
    names = {s.name for r in responses for s in r.list_services_response.service}
    assert {"epd.v1.Encoder", "grpc.health.v1.Health"} <= names
