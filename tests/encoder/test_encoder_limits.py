"""Limits from the headers before any pixel work, and the byte budget of queued patches."""

from __future__ import annotations

import threading

import pytest
from encoder_helpers import encode_bytes, noise_image, user_turn
from PIL import Image

from services.encoder.config import EncoderConfig
from services.encoder.errors import InvalidInput, Overloaded
from services.encoder.pipeline import EncoderPipeline
from services.encoder.types import RequestLimits

# Qwen2.5-VL test checkpoint: patch 14, merge 2 -> one token per 28x28 pixels after smart_resize
BYTES_PER_TOKEN = 4 * 3 * 2 * 14 * 14 * 4  # 4 patches x (3 channels x 2 frames x 14 x 14) fp32


def _header_only_png(width: int, height: int) -> bytes:
    """A PNG whose header says ``width`` x ``height`` and whose pixel data is cut off: any
    attempt to decode it fails, so a check that answers first did not decode."""
    return encode_bytes(noise_image(width, height))[:200]


class _Spy:
    """Counts pixel work: decodes and image-processor calls."""

    def __init__(self, pipe: EncoderPipeline, monkeypatch) -> None:
        self.decodes = self.processed = 0
        decode, processor = pipe.intake.decode, pipe.preprocessor._processor

        def counted_decode(*args, **kwargs):
            self.decodes += 1
            return decode(*args, **kwargs)

        def counted_processor(*args, **kwargs):
            self.processed += 1
            return processor(*args, **kwargs)

        monkeypatch.setattr(pipe.intake, "decode", counted_decode)
        monkeypatch.setattr(pipe.preprocessor, "_processor", counted_processor)


def test_prompt_length_is_checked_from_the_headers(pipeline, monkeypatch):
    small = pipeline.prepare(user_turn(2), [noise_image(56, 56, 1), noise_image(56, 56, 2)])
    num_text = small.num_tokens - 2 * 4  # 56x56 -> 2x2 tokens
    pipeline.discard(small)
    spy = _Spy(pipeline, monkeypatch)
    # 560x560 -> 400 tokens, 280x280 -> 100: 500 image tokens + the text, over the limit of 400
    images = [_header_only_png(560, 560), _header_only_png(280, 280)]
    with pytest.raises(InvalidInput) as info:
        pipeline.prepare(user_turn(2), images)
    assert str(info.value) == (
        f"prompt is {num_text + 500} tokens ({num_text} text + 500 image in 2 images), "
        "more than the limit of 400"
    )
    # the gateway's limit (the language worker's room) tightens the encoder's own
    with pytest.raises(InvalidInput, match=r"\(\d+ text \+ 100 image in 1 image\), more .* 90$"):
        pipeline.prepare(user_turn(1), images[1:], RequestLimits(max_prompt_tokens=90))
    assert (spy.decodes, spy.processed) == (0, 0)
    assert pipeline.budget.used_bytes == 0
    # within the limit, the same cut-off file fails where decoding starts
    with pytest.raises(InvalidInput, match="image 0: corrupt or truncated"):
        pipeline.prepare(user_turn(1), [_header_only_png(56, 56)])
    assert spy.decodes == 1 and spy.processed == 0 and pipeline.budget.used_bytes == 0


def test_size_limits_are_checked_from_the_header(pipeline, monkeypatch):
    spy = _Spy(pipeline, monkeypatch)
    bomb = encode_bytes(Image.new("1", (12000, 12000)))[:100]  # 144 Mpx, header only
    cases = [(bomb, "decompression bomb"), (_header_only_png(4000, 10), "aspect ratio 400")]
    for data, needle in cases:
        with pytest.raises(InvalidInput, match=needle):
            pipeline.prepare(user_turn(1), [data])
    assert (spy.decodes, spy.processed) == (0, 0)


def _gated(pipe: EncoderPipeline):
    """Holds the ViT loop inside its next forward until the returned event is set."""
    gate, entered = threading.Event(), threading.Event()
    forward = pipe.batcher._forward

    def held(pixels, grids):
        entered.set()
        assert gate.wait(30)
        return forward(pixels, grids)

    pipe.batcher._forward = held
    return gate, entered


def _wait(prompt_submit):
    done = threading.Event()
    result = []

    def on_done(encoded, error):
        result.append(error or encoded)
        done.set()

    prompt_submit(on_done)
    return done, result


def test_pixel_budget_bounds_queued_patches(qwen25_dir):
    # 1 MiB budget; a 224x168 image is 8x6 = 48 tokens = 903,168 bytes (0.86 MiB) of patches
    pipe = EncoderPipeline(
        qwen25_dir, EncoderConfig(device="cpu", dtype="float32", max_queued_pixel_mb=1)
    )
    try:
        gate, entered = _gated(pipe)
        first = pipe.prepare(user_turn(1), [noise_image(224, 168, 1)])
        held = first.images[0].pixel_values.numel() * 4
        assert held == 48 * BYTES_PER_TOKEN == first.images[0].held_bytes
        assert pipe.budget.used_bytes == held
        done, result = _wait(lambda cb: pipe.submit(first, cb))
        assert entered.wait(30)  # the ViT is reading the first request's patches
        with pytest.raises(Overloaded, match=r"need 0\.9 MiB of patches, 0\.9 of 1 MiB"):
            pipe.prepare(user_turn(1), [noise_image(224, 168, 2)])
        assert pipe.budget.used_bytes == held  # the refused request took nothing
        gate.set()
        assert done.wait(30) and result[0].image_rows.shape[0] == 48
        assert pipe.budget.used_bytes == 0 and first.images[0].pixel_values is None
        # alone, a request larger than the whole budget still runs (11 MiB of patches)
        big = pipe.prepare(user_turn(1), [noise_image(700, 700, 3)])
        assert pipe.budget.used_bytes == 625 * BYTES_PER_TOKEN > 1 << 20
        with pytest.raises(Overloaded):
            pipe.prepare(user_turn(1), [noise_image(56, 56, 4)])
        pipe.discard(big)
        assert pipe.budget.used_bytes == 0
    finally:
        gate.set()
        pipe.close()


def test_hits_and_duplicates_hold_no_patches(qwen25_dir):
    pipe = EncoderPipeline(qwen25_dir, EncoderConfig(device="cpu", dtype="float32"))
    try:
        img = noise_image(112, 112, 5)
        prompt = pipe.prepare(user_turn(2), [img, img])  # one image twice: one set of patches
        assert prompt.images[0] is prompt.images[1]
        assert pipe.budget.used_bytes == 16 * BYTES_PER_TOKEN
        encoded = pipe.encode(user_turn(1), [img])  # the cache has it now
        assert encoded.num_cache_hits == 0
        pipe.discard(prompt)
        cached = pipe.prepare(user_turn(1), [img])
        assert cached.images[0].rows is not None and cached.images[0].pixel_values is None
        assert pipe.budget.used_bytes == 0
        again = pipe.encode(user_turn(1), [img])
        assert again.num_cache_hits == 1 and pipe.budget.used_bytes == 0
        # a request rejected while decoding gives its reservation back
        with pytest.raises(InvalidInput, match="image 1: corrupt"):
            pipe.prepare(user_turn(2), [noise_image(112, 112, 6), _header_only_png(112, 112)])
        assert pipe.budget.used_bytes == 0
    finally:
        pipe.close()
