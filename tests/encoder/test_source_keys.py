"""Bytes seen before: a repeated image or video whose rows are cached is not decoded again, and
it is the same item (key, grid, rows) as when it was decoded."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from encoder_helpers import encode_bytes, noise_image, user_turn
from PIL import Image

from services.encoder.config import EncoderConfig
from services.encoder.pipeline import EncoderPipeline
from services.encoder.source_keys import Decoded, SourceKeys, source_digest
from services.encoder.types import ChatMessage, ContentPart, VideoInput, VideoSampling
from tests.media import make_video


def test_table_is_lru_and_bounded():
    table = SourceKeys(2)
    table.put(b"a", Decoded(b"ka", 1, 2))
    table.put(b"b", Decoded(b"kb"))
    assert table.get(b"a") == Decoded(b"ka", 1, 2)  # a most recent: b goes first
    table.put(b"c", Decoded(b"kc"))
    assert (table.get(b"b"), len(table)) == (None, 2)
    assert table.get(b"a") is not None and table.get(b"c") is not None
    with pytest.raises(ValueError):
        SourceKeys(0)


def test_digest_covers_kind_context_and_bytes():
    base = source_digest(b"video", b"data", b"plan")
    assert base == source_digest(b"video", b"data", b"plan") and len(base) == 16
    others = {
        source_digest(b"image", b"data", b"plan"),
        source_digest(b"video", b"datb", b"plan"),
        source_digest(b"video", b"data", b"plan2"),
        source_digest(b"video", b"plandata", b""),  # the context is length-prefixed
    }
    assert base not in others and len(others) == 4


class DecodeCounter:
    """Counts calls of ``obj.name`` while passing them through."""

    def __init__(self, monkeypatch, obj, name: str) -> None:
        self.calls = 0
        real = getattr(obj, name)

        def counted(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(obj, name, counted)


@pytest.fixture
def fresh_pipeline(qwen25_dir):
    pipe = EncoderPipeline(qwen25_dir, EncoderConfig(device="cpu", dtype="float32", sender="none"))
    yield pipe
    pipe.close()


def test_repeated_image_bytes_skip_decoding(fresh_pipeline, monkeypatch):
    pipe = fresh_pipeline
    decodes = DecodeCounter(monkeypatch, pipe.intake, "decode")
    # an EXIF-rotated JPEG: its decoded size (and grid) is its header's, transposed
    img = noise_image(160, 96, 7)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees on display
    data = encode_bytes(img, "JPEG", exif=exif.tobytes(), quality=95)
    first = pipe.encode(user_turn(1), [data])
    second = pipe.encode(user_turn(1, "Again?"), [data])
    assert decodes.calls == 1
    assert (first.num_cache_hits, second.num_cache_hits) == (0, 1)
    assert first.image_hashes == second.image_hashes
    assert torch.equal(first.image_rows, second.image_rows)
    image_positions = [p.positions[:, p.image_mask] for p in (first, second)]
    assert np.array_equal(*image_positions)  # the same grid
    # the same pixels from other bytes: decoded once more, then the same item
    png = pipe.encode(user_turn(1), [encode_bytes(img.rotate(-90, expand=True), "PNG")])
    assert decodes.calls == 2 and png.num_cache_hits == 0  # JPEG and PNG pixels differ


def test_evicted_rows_are_decoded_again(fresh_pipeline, monkeypatch):
    pipe = fresh_pipeline
    decodes = DecodeCounter(monkeypatch, pipe.intake, "decode")
    data = encode_bytes(noise_image(120, 90, 3))
    first = pipe.encode(user_turn(1), [data])
    for key in pipe.cache.keys():  # as if evicted
        pipe.cache._entries.pop(key)
    misses = pipe.cache.stats().num_misses
    again = pipe.encode(user_turn(1), [data])
    assert decodes.calls == 2 and again.num_cache_hits == 0
    assert pipe.cache.stats().num_misses == misses + 1  # one miss, not two
    assert torch.equal(first.image_rows, again.image_rows)


def test_twice_in_one_request_is_decoded_once(fresh_pipeline, monkeypatch):
    pipe = fresh_pipeline
    decodes = DecodeCounter(monkeypatch, pipe.intake, "decode")
    data = encode_bytes(noise_image(100, 100, 5))
    prompt = pipe.prepare(user_turn(2), [data, data])
    assert decodes.calls == 1 and prompt.items[0] is prompt.items[1]
    pipe.discard(prompt)


def test_without_a_cache_nothing_is_remembered(qwen25_dir):
    config = EncoderConfig(device="cpu", dtype="float32", sender="none", cache_mb=0)
    pipe = EncoderPipeline(qwen25_dir, config)
    try:
        assert pipe.source_keys is None
        data = encode_bytes(noise_image(100, 80, 1))
        a, b = (pipe.encode(user_turn(1), [data]) for _ in range(2))
        assert a.image_hashes == b.image_hashes and (a.num_cache_hits, b.num_cache_hits) == (0, 0)
    finally:
        pipe.close()


def video_turn(data: bytes, sampling: VideoSampling | None = None) -> list[ChatMessage]:
    video = ContentPart(video=VideoInput(data, sampling or VideoSampling()))
    return [ChatMessage("user", (video, ContentPart(text="What happens?")))]


def test_repeated_video_skips_decoding(fresh_pipeline, monkeypatch):
    pipe = fresh_pipeline
    decodes = DecodeCounter(monkeypatch, pipe.videos, "prepare")
    data = make_video(num_frames=16, width=64, height=64, fps=4, seed=9)
    first = pipe.encode(video_turn(data))
    second = pipe.encode(video_turn(data))
    assert decodes.calls == 1 and pipe.video_totals()[0] == 8  # frames decoded: the first time
    assert second.num_cache_hits == 4 and first.image_hashes == second.image_hashes
    assert torch.equal(first.image_rows, second.image_rows)
    assert np.array_equal(first.positions, second.positions)
    # sampled differently: another video, decoded
    other = pipe.encode(video_turn(data, VideoSampling(fps=1.0)))
    assert decodes.calls == 2 and other.image_hashes != first.image_hashes
