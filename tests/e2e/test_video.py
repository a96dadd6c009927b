"""Videos end to end through the gateway: greedy tokens equal transformers' monolithic
``generate`` given the same ``pixel_values_videos``, grid and seconds per frame group (Qwen2.5-VL)
or timestamps in the prompt (Qwen3-VL), computed independently (``hf_video_reference``).

Test videos are encoded here with PyAV. The encoder's video settings are set explicitly so the
reference samples the same frames at the same size.
"""

from __future__ import annotations

import dataclasses

import grpc
import pytest
import torch

from common.models.hf_reference import HFReference
from common.models.hf_video_reference import VideoSpec
from protos.epd.v1 import common_pb2, gateway_pb2
from tests.conftest import ARCHS
from tests.e2e.conftest import noise_image, png_bytes
from tests.media import make_video

MAX_TOKENS = 8


def factor(arch: str) -> int:
    return 32 if arch == "qwen3_vl" else 28


def video_env(arch: str) -> tuple[dict[str, str], VideoSpec]:
    """Small frames (64 to 256 merged patches) and their reference settings."""
    f = factor(arch)
    spec = VideoSpec(min_pixels=64 * f * f, max_pixels=256 * f * f, total_pixels=4096 * f * f)
    env = {
        "EPD_ENCODER_VIDEO_MIN_PIXELS": str(spec.min_pixels),
        "EPD_ENCODER_VIDEO_MAX_PIXELS": str(spec.max_pixels),
        "EPD_ENCODER_VIDEO_TOTAL_PIXELS": str(spec.total_pixels),
    }
    return env, spec


def request(
    video: bytes,
    images: list[bytes] = (),
    text: str = "What happens?",
    sampling: common_pb2.VideoSampling | None = None,
):
    """One user turn: the video, then the images, then the text (the reference's layout)."""
    source = common_pb2.ImageSource(data=video)
    part = common_pb2.VideoPart(source=source, sampling=sampling)
    parts = [common_pb2.ContentPart(video=part)]
    parts += [common_pb2.ContentPart(image=common_pb2.ImageSource(data=b)) for b in images]
    parts.append(common_pb2.ContentPart(text=text))
    return gateway_pb2.GenerateRequest(
        messages=[common_pb2.ChatMessage(role="user", content=parts)],
        sampling=common_pb2.SamplingParams(max_new_tokens=MAX_TOKENS),
    )


def reference_messages(num_images: int, text: str = "What happens?") -> list[dict]:
    content = [{"type": "video"}] + [{"type": "image"}] * num_images
    return [{"role": "user", "content": [*content, {"type": "text", "text": text}]}]


@pytest.mark.parametrize("arch", ARCHS)
def test_video_greedy_equals_monolithic(arch, tiny_model_dir, stack_factory):
    """One video, then the same video again (encoder cache and radix cache hit), then a video
    plus an image, then the video sampled at 1 fps (another prompt); nothing is left held."""
    model_dir = tiny_model_dir(arch)
    env, spec = video_env(arch)
    ref = HFReference(model_dir, wire_dtype=torch.bfloat16)
    stack = stack_factory(model_dir, env=env)
    video = make_video(num_frames=12, width=96, height=72, fps=4, seed=7)  # 3 s: 6 frames
    inputs = ref.build_video_inputs(reference_messages(0), [], video, spec)
    expected = ref.generate(inputs, MAX_TOKENS)
    image = noise_image(8, 112, 84)
    mixed_inputs = ref.build_video_inputs(reference_messages(1), [image], video, spec)
    mixed_expected = ref.generate(mixed_inputs, MAX_TOKENS)
    slow_spec = dataclasses.replace(spec, fps=1.0)  # 3 s at 1 fps: min_frames 4
    slow_inputs = ref.build_video_inputs(reference_messages(0), [], video, slow_spec)
    slow_expected = ref.generate(slow_inputs, MAX_TOKENS)
    with stack.client() as client:
        first = client.unary_request(request(video), timeout=120)
        assert list(first.token_ids) == expected
        assert first.usage.prompt_tokens == inputs.input_ids.shape[1]
        assert first.encoder and first.timing.encode_s > 0

        second = client.unary_request(request(video), timeout=120)
        assert list(second.token_ids) == expected
        assert second.usage.cached_tokens >= 0.9 * second.usage.prompt_tokens
        assert second.timing.encoder_cache_hits >= 1

        mixed = client.unary_request(request(video, [png_bytes(image)]), timeout=120)
        assert list(mixed.token_ids) == mixed_expected
        assert mixed.usage.prompt_tokens == mixed_inputs.input_ids.shape[1]

        slow_request = request(video, sampling=common_pb2.VideoSampling(fps=1.0))
        slow = client.unary_request(slow_request, timeout=120)
        assert list(slow.token_ids) == slow_expected
        assert slow.usage.prompt_tokens == slow_inputs.input_ids.shape[1]
        assert slow.timing.encoder_cache_hits == 0  # other frames: nothing to reuse
    load = stack.encoder_load()
    # the video's 3 frame groups once, the image, the 1 fps video's 2 groups
    assert load.num_images_encoded == 3 + 1 + 2
    stack.wait_no_leaks()


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_long_video_ships_in_frame_groups_and_continuations(arch, tiny_model_dir, stack_factory):
    """A 10 s clip (10 frame groups, ~700 video tokens) against a 256-token default buffer:
    each frame group is its own ViT forward and is shipped as it is encoded, the transfer takes
    continuations, and prefill chunks cut the video."""
    model_dir = tiny_model_dir(arch)
    env, spec = video_env(arch)
    env |= {
        "EPD_ENCODER_MAX_BATCH_PATCHES": "64",  # one frame group per forward
        "EPD_TRANSFER_DEFAULT_TOKENS": "256",
        "EPD_LANGUAGE_CHUNK_SIZE": "96",
    }
    ref = HFReference(model_dir, wire_dtype=torch.bfloat16)
    stack = stack_factory(model_dir, env=env)
    video = make_video(num_frames=40, width=96, height=72, fps=4, seed=9)
    inputs = ref.build_video_inputs(reference_messages(0), [], video, spec)
    assert inputs.input_ids.shape[1] > 512
    expected = ref.generate(inputs, MAX_TOKENS)
    with stack.client() as client:
        reply = client.unary_request(request(video), timeout=180)
    assert list(reply.token_ids) == expected
    assert reply.usage.prompt_tokens == inputs.input_ids.shape[1]
    assert reply.timing.num_transfers >= 2
    assert stack.encoder_load().num_forwards >= 10
    stack.wait_no_leaks()


def test_bad_video_is_invalid_argument_naming_it(tiny_model_dir, stack_factory):
    stack = stack_factory(tiny_model_dir("qwen2_5_vl"))
    truncated = make_video(num_frames=12)[:700]
    with stack.client() as client:
        with pytest.raises(grpc.RpcError) as info:
            client.unary_request(request(truncated), timeout=60)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "video 0: data is not a readable video" in info.value.details()
        good = client.unary_request(request(make_video(num_frames=8)), timeout=120)
        assert good.token_ids
    stack.wait_no_leaks()
