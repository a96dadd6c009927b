"""A slow, lossy link between hosts (``tc netem``), where the kernel has netem: image requests
across it still give the same greedy tokens as over a clean link. Skipped, with the reason,
where ``tc`` or the kernel's netem qdisc is missing (this project's CI machine lacks netem)."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import noise_image, png_bytes


def test_slow_lossy_link_to_the_language_host(tiny_model_dir, network, host_stack_factory):
    why = network.netem(network.add_host("probe"), "delay", "1ms")  # before starting anything
    if why:
        pytest.skip(why)
    stack = host_stack_factory(tiny_model_dir("qwen2_5_vl"))
    image = png_bytes(noise_image(9, 224))
    with stack.client() as client:
        clean = client.generate("Describe.", [image], max_tokens=8, timeout=60)
        shaped = network.netem(stack.host(stack.languages[0]), "delay", "20ms", "loss", "2%")
        assert shaped == "", shaped
        for i in range(3):
            reply = client.generate("Describe.", [image], max_tokens=8, timeout=120)
            assert list(reply.token_ids) == list(clean.token_ids), i
    stack.wait_no_leaks(60)
