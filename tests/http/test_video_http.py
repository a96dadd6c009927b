"""OpenAI's ``video_url`` part through the HTTP API (the official client, the shared stack):
the same greedy tokens as the same video sent over gRPC, video sampling asked for with
``mm_processor_kwargs`` and per part, and a broken video is a 400 whose message names the
video."""

from __future__ import annotations

import base64

import openai
import pytest

from protos.epd.v1 import common_pb2, gateway_pb2
from tests.media import make_video

CLIP = make_video(num_frames=8, width=64, height=48, fps=4, seed=31)


def video_url(data: bytes) -> str:
    return "data:video/mp4;base64," + base64.b64encode(data).decode()


def messages(url: str, **sampling: object) -> list[dict]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "video_url", "video_url": {"url": url, **sampling}},
                {"type": "text", "text": "What happens?"},
            ],
        }
    ]


def test_video_url_equals_the_grpc_video(http_stack, client, model):
    reply = client.chat.completions.create(
        model=model, messages=messages(video_url(CLIP)), max_tokens=6, temperature=0
    )
    source = common_pb2.ImageSource(data=CLIP)
    request = gateway_pb2.GenerateRequest(
        messages=[
            common_pb2.ChatMessage(
                role="user",
                content=[
                    common_pb2.ContentPart(video=common_pb2.VideoPart(source=source)),
                    common_pb2.ContentPart(text="What happens?"),
                ],
            )
        ],
        sampling=common_pb2.SamplingParams(max_new_tokens=6),
    )
    with http_stack.client() as grpc_client:
        expected = grpc_client.unary_request(request, timeout=120)
    assert reply.choices[0].message.content == expected.text
    assert reply.usage.prompt_tokens == expected.usage.prompt_tokens


def test_mm_processor_kwargs_sample_fewer_frames(http_stack, client, model):
    """8 frames at 4 fps: 4 frames by default (2 groups), 2 with ``max_frames: 2`` (1 group);
    the part's own ``max_frames`` wins over the request's; gRPC's ``VideoSampling`` agrees."""
    url = video_url(CLIP)

    def prompt_tokens(sampling: dict, **extra: object) -> int:
        reply = client.chat.completions.create(
            model=model,
            messages=messages(url, **sampling),
            max_tokens=2,
            temperature=0,
            extra_body=extra,
        )
        return reply.usage.prompt_tokens

    default = prompt_tokens({})
    fewer = prompt_tokens({}, mm_processor_kwargs={"fps": 1.0, "max_frames": 2})
    assert fewer < default
    assert prompt_tokens({"max_frames": 4}, mm_processor_kwargs={"max_frames": 2}) == default
    source = common_pb2.ImageSource(data=CLIP)
    sampling = common_pb2.VideoSampling(fps=1.0, max_frames=2)
    part = common_pb2.VideoPart(source=source, sampling=sampling)
    request = gateway_pb2.GenerateRequest(
        messages=[
            common_pb2.ChatMessage(
                role="user",
                content=[
                    common_pb2.ContentPart(video=part),
                    common_pb2.ContentPart(text="What happens?"),
                ],
            )
        ],
        sampling=common_pb2.SamplingParams(max_new_tokens=2),
    )
    with http_stack.client() as grpc_client:
        assert grpc_client.unary_request(request, timeout=120).usage.prompt_tokens == fewer


def test_broken_video_is_a_400_naming_it(client, model):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=model, messages=messages(video_url(CLIP[:500])), max_tokens=4
        )
    assert "video 0: data is not a readable video" in info.value.message
