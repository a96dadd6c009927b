"""Each role on a host of its own (``tests/hosts/conftest.py``): the served tokens equal
transformers' greedy ``generate``, with embeddings crossing hosts over Mooncake tcp, and every
worker advertises the address of its own host, found from the route to its gateway."""

from __future__ import annotations

import pytest
import torch

from common.models.hf_reference import HFReference
from tests.conftest import ARCHS
from tests.e2e.conftest import noise_image, png_bytes

MAX_TOKENS = 12


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_monolithic_across_hosts(arch, tiny_model_dir, host_stack_factory):
    model_dir = tiny_model_dir(arch)
    ref = HFReference(model_dir, wire_dtype=torch.bfloat16)
    stack = host_stack_factory(model_dir)
    workers = {w.address: w for w in stack.workers()}
    for proc in (*stack.encoders, *stack.languages):
        host = stack.host(proc).address
        assert proc.address in workers and proc.address.startswith(f"{host}:")
    encoder = workers[stack.encoders[0].address]
    assert encoder.info["transfer_endpoint"].startswith(
        f"tcp://{stack.host(stack.encoders[0]).address}:"
    )

    image = noise_image(7, 112, 84)
    prompt = "Describe the image."
    expected = ref.generate(ref.build_inputs(prompt, [image]), MAX_TOKENS)
    with stack.client() as client:
        reply = client.generate(prompt, [png_bytes(image)], max_tokens=MAX_TOKENS, timeout=60)
        assert list(reply.token_ids) == expected
        assert reply.timing.num_transfers == 1 and reply.timing.transfer_s > 0
        text_expected = ref.generate(ref.build_inputs("Hello there", []), MAX_TOKENS)
        text = client.generate("Hello there", max_tokens=MAX_TOKENS, timeout=60)
        assert list(text.token_ids) == text_expected
    stack.wait_no_leaks()
