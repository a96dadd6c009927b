"""End to end through the gateway: greedy tokens equal transformers' monolithic generate.

Rows travel in the wire dtype (``EPD_TRANSFER_DTYPE``). With an fp32 wire the disaggregated
path does the same arithmetic as transformers; with the default bf16 wire the reference's vision
output is rounded to bf16 the same way (``HFReference(wire_dtype=...)``), so equality stays
token for token in both cases.
"""

from __future__ import annotations

import pytest
import torch

from common.models.hf_reference import HFReference
from tests.conftest import ARCHS
from tests.e2e.conftest import noise_image, png_bytes

MAX_TOKENS = 12
WIRES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@pytest.mark.parametrize(
    "arch,wire,sessions",
    [(arch, "bfloat16", True) for arch in ARCHS] + [("qwen2_5_vl", "float32", False)],
)
def test_disaggregated_greedy_equals_monolithic(
    arch, wire, sessions, tiny_model_dir, stack_factory
):
    """``sessions``: the gateway's requests share a session stream per language worker (the
    default), or each has a ``Generate`` stream of its own (``--no-language-sessions``)."""
    model_dir = tiny_model_dir(arch)
    ref = HFReference(model_dir, wire_dtype=WIRES[wire])
    gateway_args = () if sessions else ("--no-language-sessions",)
    stack = stack_factory(model_dir, env={"EPD_TRANSFER_DTYPE": wire}, gateway_args=gateway_args)
    image = noise_image(7, 112, 84)
    prompt = "Describe the image."
    expected = ref.generate(ref.build_inputs(prompt, [image]), MAX_TOKENS)
    with stack.client() as client:
        first = client.generate(prompt, [png_bytes(image)], max_tokens=MAX_TOKENS, timeout=60)
        assert list(first.token_ids) == expected
        assert first.text == ref.tokenizer.decode(expected, skip_special_tokens=True) or (
            first.text  # stop strings/special tokens are cut by the detokenizer
        )
        assert first.encoder and first.language
        assert first.usage.prompt_tokens == ref.build_inputs(prompt, [image]).input_ids.shape[1]
        assert first.timing.num_transfers == 1 and first.timing.encode_s > 0
        assert first.timing.transfer_s > 0
        lent = [stack.language_load(i).num_rooms_lent for i in range(len(stack.languages))]
        assert sum(lent) == 1  # the language engine used the rows in place, no copy
        assert first.timing.total_s >= first.timing.first_token_s > 0

        # the same request again: the language worker's radix cache and the encoder's cache hit
        second = client.generate(prompt, [png_bytes(image)], max_tokens=MAX_TOKENS, timeout=60)
        assert list(second.token_ids) == expected
        assert second.usage.cached_tokens >= 0.9 * second.usage.prompt_tokens
        assert second.timing.encoder_cache_hits == 1

        # text only never touches the encoder
        text_expected = ref.generate(ref.build_inputs("Hello there", []), MAX_TOKENS)
        text = client.generate("Hello there", max_tokens=MAX_TOKENS, timeout=60)
        assert list(text.token_ids) == text_expected
        assert text.encoder == "" and text.timing.encode_s == 0
    assert stack.encoder_load().num_images_encoded == 1
    stack.wait_no_leaks()


def test_prompt_over_the_default_buffer_uses_continuations(tiny_model_dir, stack_factory):
    """A 1,100-token prompt against a 256-token default buffer: several continuations."""
    model_dir = tiny_model_dir("qwen2_5_vl")
    ref = HFReference(model_dir, wire_dtype=torch.bfloat16)
    stack = stack_factory(model_dir, env={"EPD_TRANSFER_DEFAULT_TOKENS": "256"})
    images = [noise_image(11, 896, 728), noise_image(12, 448, 448)]
    prompt = "Compare the two pictures."
    inputs = ref.build_inputs(prompt, images)
    assert inputs.input_ids.shape[1] > 1024
    expected = ref.generate(inputs, MAX_TOKENS)
    with stack.client() as client:
        reply = client.generate(
            prompt, [png_bytes(im) for im in images], max_tokens=MAX_TOKENS, timeout=120
        )
    assert list(reply.token_ids) == expected
    assert reply.timing.num_transfers >= 2
    assert reply.usage.prompt_tokens == inputs.input_ids.shape[1]
    stack.wait_no_leaks()
