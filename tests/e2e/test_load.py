"""32 concurrent mixed requests through one stack: text only, small and large images, and
prompts over the language worker's default transfer buffer (256 tokens), all at once."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import pytest
from PIL import Image

from common.models.hf_reference import HFReference
from protos.epd.v1 import common_pb2, gateway_pb2
from tests.e2e.conftest import noise_image, png_bytes

ARCH = "qwen2_5_vl"
MAX_TOKENS = 12
NUM_REQUESTS = 32
DEFAULT_TOKENS = 256


@dataclass
class Case:
    prompt: str
    images: list[Image.Image]

    @property
    def kind(self) -> str:
        return "text" if not self.images else f"{len(self.images)}x{self.images[0].width}px"


def workload() -> list[Case]:
    """A quarter each: text only, one small image, one large image, two images (>256 tokens)."""
    cases = []
    for i in range(NUM_REQUESTS):
        kind = i % 4
        if kind == 0:
            cases.append(Case(f"Question {i}: what is {i} plus {i}?", []))
        elif kind == 1:
            cases.append(Case(f"Describe picture {i}.", [noise_image(i, 112)]))
        elif kind == 2:
            cases.append(Case(f"What is in image {i}?", [noise_image(i, 448, 336)]))
        else:
            images = [noise_image(i, 336), noise_image(1000 + i, 224, 448)]
            cases.append(Case(f"Compare these, number {i}.", images))
    return cases


@pytest.mark.parametrize("pools", [(1, 1), (2, 2)], ids=["1enc-1lang", "2enc-2lang"])
def test_32_concurrent_mixed_requests(tiny_model_dir, stack_factory, pools) -> None:
    model_dir = tiny_model_dir(ARCH)
    stack = stack_factory(
        model_dir,
        num_encoders=pools[0],
        num_languages=pools[1],
        env={"EPD_TRANSFER_DEFAULT_TOKENS": str(DEFAULT_TOKENS)},
    )
    initial_blocks = [stack.language_load(i).num_free_transfer_blocks for i in range(pools[1])]
    cases = workload()
    payloads = [[png_bytes(im) for im in case.images] for case in cases]

    def send(i: int) -> gateway_pb2.GenerateResponse:
        with stack.client() as client:
            return client.generate(cases[i].prompt, payloads[i], max_tokens=MAX_TOKENS, timeout=120)

    start = time.monotonic()
    with ThreadPoolExecutor(NUM_REQUESTS) as pool:
        futures = [pool.submit(send, i) for i in range(NUM_REQUESTS)]
        errors: list[str] = []
        replies: list[gateway_pb2.GenerateResponse] = []
        for i, future in enumerate(futures):
            try:
                replies.append(future.result(timeout=180))
            except grpc.RpcError as exc:
                errors.append(f"{i} ({cases[i].kind}): {exc.code().name} {exc.details()}")
    elapsed = time.monotonic() - start
    assert errors == [], errors
    assert elapsed < 120

    done = (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH)
    for case, reply in zip(cases, replies, strict=True):
        assert reply.finish_reason in done and reply.token_ids, case.kind
        assert len(reply.token_ids) <= MAX_TOKENS
        assert bool(reply.encoder) == bool(case.images), case.kind
        assert reply.timing.total_s >= reply.timing.first_token_s > 0
        if case.images:
            assert reply.timing.num_transfers >= 1
    over_buffer = [r for c, r in zip(cases, replies, strict=True) if len(c.images) == 2]
    assert all(r.usage.prompt_tokens > DEFAULT_TOKENS for r in over_buffer)
    assert all(r.timing.num_transfers >= 2 for r in over_buffer), "no continuation"

    # greedy equality with transformers' monolithic generate on one request of each kind
    ref = HFReference(model_dir)
    for i in (0, 1, 2, 3):
        case, reply = cases[i], replies[i]
        inputs = ref.build_inputs(case.prompt, case.images)
        assert reply.usage.prompt_tokens == inputs.input_ids.shape[1], case.kind
        assert list(reply.token_ids) == ref.generate(inputs, MAX_TOKENS), case.kind

    # both pools were used when there are two of each
    assert len({r.language for r in replies}) == pools[1]
    assert len({r.encoder for r in replies if r.encoder}) == pools[0]

    stack.wait_no_leaks()
    blocks = [stack.language_load(i).num_free_transfer_blocks for i in range(pools[1])]
    assert blocks == initial_blocks
    encoded = sum(stack.encoder_load(i).num_images_encoded for i in range(pools[0]))
    assert encoded == sum(len(c.images) for c in cases)
