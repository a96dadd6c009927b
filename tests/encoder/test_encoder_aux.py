"""Image identity travels whole: every image's full hash and token count reach the language
side in the aux record, for as many images as the config allows."""

from __future__ import annotations

import json

import pytest
from encoder_helpers import encode_bytes, noise_image

from common.transfer.config import TransferConfig
from common.transfer.receiver import EmbeddingReceiver
from common.transfer.types import MAX_EXTRA_BYTES
from services.encoder.aux_extra import (
    MAX_ENCODE_S,
    encode_extra,
    extra_size_bound,
    max_images_that_fit,
)
from services.encoder.config import EncoderConfig
from services.encoder.service import EncoderService
from services.encoder.types import ChatMessage, ContentPart, EncodeRequest, ImageSource


def test_the_bound_is_exact():
    limit = EncoderConfig().max_prompt_tokens
    fit = max_images_that_fit(limit)
    assert fit == 23  # 32-hex hashes and 5-digit token counts in 1 KiB
    worst = [f"{i:032x}" for i in range(fit)], [limit] * fit
    data = encode_extra(*worst, hits=fit, encode_s=MAX_ENCODE_S * 10)
    assert len(data) == extra_size_bound(fit, limit) <= MAX_EXTRA_BYTES
    assert json.loads(data)["encode_s"] == MAX_ENCODE_S
    over = [f"{i:032x}" for i in range(fit + 1)], [limit] * (fit + 1)
    assert extra_size_bound(fit + 1, limit) > MAX_EXTRA_BYTES
    with pytest.raises(ValueError, match="more than 1024"):
        encode_extra(*over, hits=fit + 1, encode_s=MAX_ENCODE_S)


def test_config_refuses_more_images_than_a_record_describes():
    assert EncoderConfig(max_images=23).max_images == 23
    with pytest.raises(ValueError) as info:
        EncoderConfig(max_images=24)
    assert str(info.value) == (
        "max_images (24) is more than a transfer aux record can describe: the hashes and token "
        "counts of 24 images need up to 1042 bytes, it holds 1024; at most 23 images fit (with "
        "max_prompt_tokens 32768)"
    )
    assert EncoderConfig(max_images=24, max_prompt_tokens=4096).max_images == 24


def test_the_largest_allowed_image_count_arrives_whole(qwen25_dir):
    """23 distinct images through a real sender and receiver (shared memory): the receiver's
    aux record carries all 23 full hashes and token counts, in prompt order."""
    transfer = TransferConfig(transport="shm", num_blocks=8)
    config = EncoderConfig(device="cpu", dtype="float32", max_images=23, transfer=transfer)
    service = EncoderService(qwen25_dir, config)
    receiver = EmbeddingReceiver(transfer, service.layout)
    try:
        sizes = [(56 + 28 * (i % 3), 56) for i in range(23)]  # 4, 6 or 8 tokens each
        parts = [
            ContentPart(image=ImageSource("data", encode_bytes(noise_image(w, h, seed))))
            for seed, (w, h) in enumerate(sizes)
        ]
        message = ChatMessage("user", (*parts, ContentPart(text="Which differ?")))
        receiver.add_room(42, service.sender.endpoint)
        accepted = service.accept(EncodeRequest(42, "r42", (message,)))
        done = []
        for _ in range(60):
            done = receiver.pop_done(timeout_s=1.0)
            if done:
                break
        assert [d[0] for d in done] == [42]
        extra = json.loads(done[0][1].aux.extra)
        assert extra["hashes"] == accepted.image_hashes
        assert len(set(extra["hashes"])) == 23
        assert all(len(h) == 32 and int(h, 16) >= 0 for h in extra["hashes"])
        assert extra["tokens"] == [w // 28 * h // 28 for w, h in sizes]
        assert extra["hits"] == 0 and extra["encode_s"] > 0
        receiver.release(42)
    finally:
        receiver.close()
        service.close()
