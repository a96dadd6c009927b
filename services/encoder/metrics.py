"""The encoder's Prometheus series (namespace ``epd``)."""

from __future__ import annotations

import dataclasses

from prometheus_client import CollectorRegistry, Counter

from common.metrics import NAMESPACE, StatsCollector, histogram
from common.transfer_metrics import register_transfer_metrics

from .service import EncoderService

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def _stats(service: EncoderService) -> dict:
    load = service.load()
    stats = dataclasses.asdict(load)
    stats.update({f"cache_{k}": v for k, v in load.cache.items()})
    return stats


def create_registry(service: EncoderService) -> CollectorRegistry:
    """Series for ``service``; hooks its pipeline's observers for the histograms."""
    registry = CollectorRegistry()
    batch_size = histogram(
        registry, "encoder_batch_size", "images per ViT forward", buckets=BATCH_BUCKETS
    )
    vit_s = histogram(registry, "encoder_vit_seconds", "seconds per ViT forward")
    prep_s = histogram(
        registry, "encoder_preprocess_seconds", "decode + resize + tokenize seconds per request"
    )

    video_s = histogram(
        registry,
        "encoder_video_decode_seconds",
        "seconds per video: probe + decode of the sampled frames + resize + patches",
    )
    video_frames = Counter(
        "encoder_video_frames",
        "video frames decoded (a repeated clip whose rows are cached decodes none)",
        namespace=NAMESPACE,
        registry=registry,
    )

    def on_forward(num_images: int, seconds: float) -> None:
        batch_size.observe(num_images)
        vit_s.observe(seconds)

    def on_video(num_frames: int, seconds: float) -> None:
        video_frames.inc(num_frames)
        video_s.observe(seconds)

    service.pipeline.batcher.on_forward = on_forward
    service.pipeline.on_prepare = prep_s.observe
    service.pipeline.on_video = on_video
    registry.register(
        StatsCollector(
            lambda: _stats(service),
            [
                (
                    "gauge",
                    "encoder_queue_depth",
                    "requests accepted and not yet shipped",
                    "num_queued_requests",
                    {},
                ),
                (
                    "gauge",
                    "encoder_images_in_flight",
                    "images waiting for the ViT",
                    "num_queued_images",
                    {},
                ),
                (
                    "gauge",
                    "encoder_waiting_for_blocks",
                    "encoded requests waiting for transfer blocks",
                    "num_waiting_for_blocks",
                    {},
                ),
                (
                    "gauge",
                    "encoder_queued_pixel_bytes",
                    "bytes of image patches held by queued requests",
                    "queued_pixel_bytes",
                    {},
                ),
                (
                    "counter",
                    "encoder_images_encoded",
                    "images and video frame groups run through the ViT",
                    "num_images_encoded",
                    {},
                ),
                ("counter", "encoder_cache_hits", "embedding cache hits", "cache_num_hits", {}),
                (
                    "counter",
                    "encoder_cache_misses",
                    "embedding cache misses",
                    "cache_num_misses",
                    {},
                ),
                (
                    "counter",
                    "encoder_cache_evictions",
                    "embedding cache evictions",
                    "cache_num_evictions",
                    {},
                ),
                (
                    "gauge",
                    "encoder_cache_bytes",
                    "bytes held by the embedding cache",
                    "cache_num_bytes",
                    {},
                ),
            ],
        )
    )
    if hasattr(service.sender, "on_write"):  # the transfer plane's sender (not the discarding one)
        register_transfer_metrics(registry, "sender", service.sender)
    return registry
