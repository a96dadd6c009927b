"""Embedding cache (LRU in bytes) and the ViT loop's batching."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from encoder_helpers import noise_image, user_turn

from services.encoder.batcher import EncodeTask, VisionBatcher
from services.encoder.cache import EmbeddingCache
from services.encoder.config import EncoderConfig
from services.encoder.pipeline import EncoderPipeline
from services.encoder.types import PreparedImage


def _rows(num_rows: int, value: float = 0.0) -> torch.Tensor:
    return torch.full((num_rows, 4), value)  # 16 bytes per row


def test_cache_lru_eviction_order_and_counters():
    cache = EmbeddingCache(capacity_bytes=100)
    assert cache.put(b"a", _rows(2)) and cache.put(b"b", _rows(2)) and cache.put(b"c", _rows(2))
    assert cache.get(b"a") is not None  # a becomes most recent: order b, c, a
    assert cache.get(b"zz") is None
    assert cache.put(b"d", _rows(2))  # 128 > 100: evicts b
    assert cache.keys() == [b"c", b"a", b"d"]
    assert cache.put(b"e", _rows(4))  # needs 64: evicts c and a
    assert cache.keys() == [b"d", b"e"]
    assert not cache.put(b"huge", _rows(7))  # 112 > capacity: not stored
    stats = cache.stats()
    assert (stats.num_hits, stats.num_misses, stats.num_evictions) == (1, 1, 3)
    assert stats.num_bytes == 96 <= stats.capacity_bytes and stats.num_entries == 2
    assert cache.peek(b"d") is not None and cache.stats().num_hits == 1  # peek counts nothing


def test_pipeline_cache_hit_skips_the_vit(pipeline):
    img = noise_image(120, 90, 11)
    first = pipeline.encode(user_turn(1), [img])
    forwards = pipeline.batcher.num_forwards
    second = pipeline.encode(user_turn(1, "Another question"), [img])
    assert pipeline.batcher.num_forwards == forwards
    assert (first.num_cache_hits, second.num_cache_hits) == (0, 1)
    assert torch.equal(first.image_rows, second.image_rows)
    assert first.image_hashes == second.image_hashes


def test_cache_eviction_in_pipeline(qwen25_dir):
    # the cache keeps rows in the wire dtype (bf16): a 700x700 image is 625 rows x 128 x 2 bytes
    # = 160 KB, so a 1 MiB cache holds six
    pipe = EncoderPipeline(qwen25_dir, EncoderConfig(device="cpu", dtype="float32", cache_mb=1))
    try:
        big = [noise_image(700, 700, s) for s in range(7)]
        results = [pipe.encode(user_turn(1), [img]) for img in big + big[:1]]
        assert [r.num_cache_hits for r in results] == [0] * 8  # big[0] evicted by big[6]
        assert all(r.image_rows.dtype == torch.bfloat16 for r in results)
        stats = pipe.cache.stats()
        assert (stats.num_evictions, stats.num_entries, stats.num_misses) == (2, 6, 8)
        assert stats.num_bytes == 6 * 160_000 <= stats.capacity_bytes
        assert pipe.encode(user_turn(1), [big[1]]).num_cache_hits == 0
        assert pipe.encode(user_turn(1), [big[6]]).num_cache_hits == 1
    finally:
        pipe.close()


def test_preprocessing_parameters_change_the_key(qwen25_dir):
    img = noise_image(300, 300, 5)
    keys = []
    for max_pixels in (0, 200 * 200):
        pipe = EncoderPipeline(
            qwen25_dir, EncoderConfig(device="cpu", dtype="float32", max_pixels=max_pixels)
        )
        keys.append(pipe.prepare(user_turn(1), [img]).images[0].key)
        pipe.close()
    assert keys[0] != keys[1]


def _submit_all(pipe, prompts, after_submit=None):
    results = [None] * len(prompts)
    done = [threading.Event() for _ in prompts]

    def callback(i):
        def on_done(encoded, error):
            results[i] = encoded if error is None else error
            done[i].set()

        return on_done

    for i, prompt in enumerate(prompts):
        pipe.submit(prompt, callback(i))
    if after_submit is not None:
        after_submit()
    for event in done:
        assert event.wait(30)
    return results


def test_batched_requests_match_one_by_one(qwen25_dir):
    images = [noise_image(w, h, i) for i, (w, h) in enumerate([(100, 80), (60, 130), (200, 140)])]
    solo = EncoderPipeline(qwen25_dir, EncoderConfig(device="cpu", dtype="float32", cache_mb=0))
    expected = [solo.encode(user_turn(1), [img]) for img in images]
    solo.close()

    # no time target: the held forward's wait would count as the tower's pace
    config = EncoderConfig(device="cpu", dtype="float32", cache_mb=0, max_batch_ms=0)
    pipe = EncoderPipeline(qwen25_dir, config)
    try:
        # hold the loop inside the blocker's forward until all requests are queued
        gate = threading.Lock()
        gate.acquire()
        entered = threading.Event()
        forward = pipe.batcher._forward

        def held_forward(pixels, grids):
            entered.set()
            with gate:
                return forward(pixels, grids)

        pipe.batcher._forward = held_forward
        prompts = [pipe.prepare(user_turn(1), [img]) for img in images]
        prompts.append(pipe.prepare(user_turn(1), [images[0]]))  # a duplicate in the batch
        blocker = pipe.prepare(user_turn(1), [noise_image(56, 56, 99)])
        pipe.submit(blocker, lambda e, err: None)
        assert entered.wait(30)  # the loop is now busy with the blocker alone
        results = _submit_all(pipe, prompts, after_submit=gate.release)
        assert pipe.batcher.num_forwards == 2  # the blocker, then all the others at once
        assert pipe.batcher.num_images_encoded == 4  # the duplicate ran once
        for got, want in zip(results, expected + expected[:1], strict=True):
            torch.testing.assert_close(got.image_rows, want.image_rows, rtol=1e-5, atol=1e-5)
            assert (got.fill_ids == want.fill_ids).all()
    finally:
        pipe.close()


def test_patch_budget_splits_batches(qwen25_dir):
    # each 112x112 image has 64 patches; a budget of 128 fits two per forward
    config = EncoderConfig(
        device="cpu", dtype="float32", cache_mb=0, max_batch_patches=128, max_batch_ms=0
    )
    pipe = EncoderPipeline(qwen25_dir, config)
    try:
        gate = threading.Event()
        forward = pipe.batcher._forward
        sizes = []

        def gated(pixels, grids):
            gate.wait(10)
            sizes.append(len(grids))
            return forward(pixels, grids)

        pipe.batcher._forward = gated
        prompts = [pipe.prepare(user_turn(1), [noise_image(112, 112, i)]) for i in range(5)]
        threading.Timer(0.3, gate.set).start()
        results = _submit_all(pipe, prompts)
        assert all(r.image_rows.shape == (16, 128) for r in results)
        assert sum(sizes) == 5 and max(sizes) == 2
    finally:
        pipe.close()


def _batch_sizes_under_time_target(max_batch_s: float, num_images: int = 6) -> list[int]:
    """Images per forward when ``num_images`` one-image tasks are queued at once, after one
    forward taught the loop its pace (a fake forward: 10 ms per image of 64 patches)."""
    sizes: list[int] = []

    def forward(pixels, grids):
        time.sleep(0.01 * len(grids))
        sizes.append(len(grids))
        return [torch.zeros(16, 4) for _ in grids]

    def task(i: int, done: threading.Semaphore) -> EncodeTask:
        image = PreparedImage(bytes([i]) * 16, (1, 8, 8), 16, pixel_values=torch.zeros(64, 8))
        return EncodeTask([image], on_done=lambda t, err: done.release())

    batcher = VisionBatcher(
        forward, None, 1 << 20, torch.float32, lambda image: None, max_batch_s=max_batch_s
    )
    try:
        done = threading.Semaphore(0)
        batcher.submit(task(0, done))
        assert done.acquire(timeout=30)
        sizes.clear()
        # NOTE: the loop's condition is reentrant: holding it queues every task before the
        # loop can take the first
        with batcher._cond:
            for i in range(1, num_images + 1):
                batcher.submit(task(i, done))
        for _ in range(num_images):
            assert done.acquire(timeout=30)
    finally:
        batcher.close()
    assert sum(sizes) == num_images
    return sizes


def test_time_target_caps_the_batch():
    # 10 ms per image: a 25 ms target fits two at most (fewer when the sleeps overshoot)
    sizes = _batch_sizes_under_time_target(0.025)
    assert max(sizes) <= 2 and len(sizes) >= 3
    # no target, or one far above the batch's time: the patch budget alone, one forward
    assert _batch_sizes_under_time_target(0.0) == [6]
    assert _batch_sizes_under_time_target(30.0) == [6]


def test_time_target_setting_is_checked():
    with pytest.raises(ValueError, match="max_batch_ms"):
        EncoderConfig(max_batch_ms=-1)
