"""The encoder in production shape through a real stack: bf16 compute on CPU, bf16 rows on the
wire, its layout and prompt limit advertised by heartbeat, over-long prompts refused from the
image headers alone, and nothing left behind."""

from __future__ import annotations

import grpc
import pytest

from protos.epd.v1 import common_pb2
from tests.e2e.conftest import noise_image, png_bytes

ARCH = "qwen2_5_vl"
MAX_PROMPT_TOKENS = 600


@pytest.fixture
def stack(tiny_model_dir, stack_factory):
    env = {
        "EPD_ENCODER_DTYPE": "bfloat16",  # the encoder only: EPD_ENCODER_*
        "EPD_ENCODER_MAX_PROMPT_TOKENS": str(MAX_PROMPT_TOKENS),
        "EPD_TRANSFER_DTYPE": "bfloat16",
    }
    return stack_factory(tiny_model_dir(ARCH), env=env)


def test_bf16_encoder_serves_and_advertises_itself(stack):
    encoders = [w for w in stack.workers() if w.role == "encoder"]
    assert len(encoders) == 1 and encoders[0].healthy
    assert encoders[0].transfer_layout == common_pb2.TransferLayout(
        hidden_size=128, num_deepstack=0, dtype="bfloat16", block_size=128
    )
    assert encoders[0].max_prompt_tokens == MAX_PROMPT_TOKENS
    log = stack.encoders[0].log_path.read_text()
    assert "device cpu, compute dtype bfloat16, wire dtype bfloat16" in log

    image = png_bytes(noise_image(3, 112, 84))
    with stack.client() as client:
        first = client.generate("Describe the image.", [image], max_tokens=8, timeout=120)
        assert len(first.token_ids) == 8 and first.timing.encode_s > 0
        assert first.finish_reason == common_pb2.FINISH_REASON_LENGTH
        again = client.generate("Describe the image.", [image], max_tokens=8, timeout=120)
        assert list(again.token_ids) == list(first.token_ids)  # cached bf16 rows, same answer
        assert again.timing.encoder_cache_hits == 1

        # over the limit, judged from the PNG header: the pixel data after it is cut off, so
        # decoding would have failed with a different error
        header_only = png_bytes(noise_image(4, 700, 700))[:200]
        with pytest.raises(grpc.RpcError) as info:
            client.generate("Describe the image.", [header_only], max_tokens=8, timeout=60)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "image in 1 image), more than the limit of 600" in info.value.details()
        assert "prompt is" in info.value.details()
    load = stack.encoder_load()
    assert load.num_images_encoded == 1 and load.queued_pixel_bytes == 0
    stack.wait_no_leaks()
