"""Image by image, end to end: the encoder ships each image's rows as the ViT finishes it and
the language worker prefills them while the next images are encoded.

Each image runs in a ViT forward of its own (a small patch budget), the default buffer is
smaller than the prompts (continuations) and prefill chunks cut images; greedy tokens must equal
transformers' ``generate`` for 1, 2 and 4 images. An encoder killed between two images fails
the request alone, with nothing left held on either side.
"""

from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from common.models.hf_reference import HFReference
from tests.e2e.conftest import noise_image, png_bytes
from tests.e2e.test_faults import by_address, encoder_in_flight, stream_in_background, wait_for

ARCH = "qwen2_5_vl"
MAX_TOKENS = 8
PER_IMAGE_ENV = {
    "EPD_ENCODER_MAX_BATCH_PATCHES": "64",  # every image is a forward of its own
    "EPD_TRANSFER_DEFAULT_TOKENS": "256",
    "EPD_LANGUAGE_CHUNK_SIZE": "96",
}


@pytest.fixture(scope="module")
def ref(tiny_model_dir):
    return HFReference(tiny_model_dir(ARCH), wire_dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def per_image_stack(tiny_model_dir, tmp_path_factory):
    from tests.e2e.conftest import start_stack

    stack = start_stack(
        tiny_model_dir(ARCH), tmp_path_factory.mktemp("per_image"), env=PER_IMAGE_ENV
    )
    yield stack
    stack.stop()


@pytest.mark.parametrize("num_images", [1, 2, 4])
def test_greedy_equal_image_by_image(per_image_stack, ref, num_images):
    # distinct images per case (no cache hits), each larger than a transfer block
    images = [noise_image(300 + 10 * num_images + i, 448 + 56 * i) for i in range(num_images)]
    prompt = "Say what differs between these pictures."
    inputs = ref.build_inputs(prompt, images)
    expected = ref.generate(inputs, MAX_TOKENS)
    with per_image_stack.client() as client:
        reply = client.generate(
            prompt, [png_bytes(im) for im in images], max_tokens=MAX_TOKENS, timeout=120
        )
    assert list(reply.token_ids) == expected
    assert reply.usage.prompt_tokens == inputs.input_ids.shape[1]
    if num_images > 1:  # shipped in several chunks (image by image, and continuations)
        assert reply.timing.num_transfers >= 2
    per_image_stack.wait_no_leaks()


def test_prefill_starts_before_the_last_image_then_encoder_killed(
    tiny_model_dir, stack_factory
) -> None:
    """Four large images, one ViT forward each: the language worker prefills while the room
    is still arriving; the encoder is then killed between images. The request fails alone
    (UNAVAILABLE naming the dead sender) and nothing stays held; the stack keeps serving."""
    stack = stack_factory(tiny_model_dir(ARCH), num_encoders=2, env=PER_IMAGE_ENV)
    images = [png_bytes(noise_image(400 + i, 1344)) for i in range(4)]
    with stack.client() as client, ThreadPoolExecutor(2) as pool:
        outcome, done = stream_in_background(
            pool, client, "Describe the four pictures.", images, max_tokens=MAX_TOKENS, timeout=60
        )
        address = wait_for(lambda: encoder_in_flight(stack), 20, "the encoder to accept")
        victim = by_address(stack.encoders, address)

        def prefilling_while_receiving() -> bool:
            load = stack.language_load()  # K/V slots of its own: some prompt was computed
            return load.num_receiving == 1 and load.num_kv_slots_used > load.num_radix_tokens

        wait_for(prefilling_while_receiving, 30, "prefill while the room is still arriving")
        victim.kill(signal.SIGKILL)
        done.result(timeout=60)
    assert outcome.code == grpc.StatusCode.UNAVAILABLE, (outcome.code, outcome.details)
    assert "sender_dead" in outcome.details or "timeout" in outcome.details, outcome.details
    assert outcome.num_tokens == 0
    victim.proc.wait(10)
    with stack.client() as client:
        reply = client.generate("Hello there", [], max_tokens=MAX_TOKENS, timeout=60)
        assert reply.token_ids
    stack.wait_no_leaks()
