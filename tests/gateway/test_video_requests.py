"""Video parts at the gateway: bounds (INVALID_ARGUMENT naming the field), routing keys (the
source and the sampling settings), and OpenAI's ``video_url`` part on the HTTP API."""

from __future__ import annotations

import grpc
import pytest

from protos.epd.v1 import common_pb2, gateway_pb2
from services.gateway.errors import GatewayError
from services.gateway.http import schemas
from services.gateway.http.convert import to_generate_request
from services.gateway.http.errors import HttpError
from services.gateway.keys import routing_key
from services.gateway.validation import RequestLimits, validate_request

LIMITS = RequestLimits(max_videos=2, max_video_bytes=1000)


def video_request(*videos: common_pb2.VideoPart) -> gateway_pb2.GenerateRequest:
    parts = [common_pb2.ContentPart(video=v) for v in videos]
    parts.append(common_pb2.ContentPart(text="What happens?"))
    return gateway_pb2.GenerateRequest(
        messages=[common_pb2.ChatMessage(role="user", content=parts)]
    )


def video(data: bytes = b"v" * 10, **sampling) -> common_pb2.VideoPart:
    return common_pb2.VideoPart(
        source=common_pb2.ImageSource(data=data), sampling=common_pb2.VideoSampling(**sampling)
    )


@pytest.mark.parametrize(
    ("request_", "needle"),
    [
        (video_request(video(), video(), video()), "content[2].video is video 3 of the request"),
        (video_request(video(b"x" * 1001)), "content[0].video.source.data is 1001 bytes"),
        (video_request(common_pb2.VideoPart()), "content[0].video.source has no source"),
        (video_request(video(fps=float("nan"))), "content[0].video.sampling.fps must be in"),
        (video_request(video(min_frames=9, max_frames=4)), "min_frames (9) > max_frames (4)"),
        (video_request(video(min_pixels=9, max_pixels=4)), "min_pixels (9) > max_pixels (4)"),
    ],
)
def test_bad_video_parts_are_named(request_, needle):
    with pytest.raises(GatewayError) as info:
        validate_request(request_, LIMITS)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in info.value.message


def test_good_video_parts_pass():
    validate_request(video_request(video(), video(fps=1.0, max_frames=8)), LIMITS)


def test_routing_key_covers_source_and_sampling():
    plain = routing_key(video_request(video()).messages)
    again = routing_key(video_request(video()).messages)
    slower = routing_key(video_request(video(fps=1.0)).messages)
    other = routing_key(video_request(video(b"w" * 10)).messages)
    assert len(plain.image_hashes) == 1  # a video needs an encoder, like an image
    assert plain == again
    assert plain.image_hashes != slower.image_hashes != other.image_hashes
    assert plain.prefix_hashes[0] != slower.prefix_hashes[0]


def chat(body: dict):
    return to_generate_request(schemas.ChatCompletionRequest.model_validate(body), "r", LIMITS)


def test_openai_video_url_part_becomes_a_video_part():
    url = "data:video/mp4;base64,AAAA"
    body = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "video_url", "video_url": {"url": url}},
                    {"type": "text", "text": "What happens?"},
                ],
            }
        ],
    }
    request, names = chat(body)
    part = request.messages[0].content[0]
    assert part.WhichOneof("part") == "video"
    assert part.video.source.base64 == url
    assert names.json_path("messages[0].content[0].video.source.base64") == (
        "messages[0].content[0].video_url.url"
    )


def test_openai_video_url_must_be_a_data_or_http_url():
    body = {
        "messages": [
            {"role": "user", "content": [{"type": "video_url", "video_url": {"url": "ftp://x"}}]}
        ],
    }
    with pytest.raises(HttpError) as info:
        chat(body)
    assert info.value.status == 400
    assert info.value.param == "messages[0].content[0].video_url.url"
    assert "must be a data: URL or an http(s) URL" in info.value.message


def test_client_request_places_videos_then_images_then_text():
    from services.gateway.client import build_request

    request = build_request("Why?", [b"png"], max_tokens=3, videos=[b"mp4"])
    kinds = [p.WhichOneof("part") for p in request.messages[0].content]
    assert kinds == ["video", "image", "text"]
    assert request.messages[0].content[0].video.source.data == b"mp4"
