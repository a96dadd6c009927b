"""A probed video -> a ``PreparedVideo``: its sampled frames decoded, resized and cut into one
ViT unit per frame group, or its groups' rows taken from the embedding cache.

Frames are resized like images (PIL bicubic, to the plan's size) as soon as they are decoded,
on as many threads as the process computes with, beside the decoding, so only resized frames
are held; a group's frames are normalized and cut with the image path's
lookup table when the ViT takes the group (``PatchCutter.cut_frames``: ``[grid_h * grid_w,
C * temporal * p * p]`` per group, the video processor's layout), not while the Encode call
waits. The checkpoint's image processor gives the normalization (Qwen's video
processors use the same mean and std).

Keys: the video's key is xxh3_128 over the preprocessing parameters, the plan (frame indices,
size, fps, timestamps) and the resized frames; group ``g``'s key (its cache entry) is xxh3_128
over the video's key and ``g``. The same clip sampled differently is another video.
"""

from __future__ import annotations

import json
from functools import partial

import numpy as np
import torch
import xxhash
from PIL import Image

from .cache import EmbeddingCache
from .preprocess import ImagePreprocessor
from .stop import StopCheck
from .types import PendingPatches, PreparedImage, PreparedVideo
from .video_decode import VideoHeader, decode_frames
from .video_sampling import VideoPlan, VideoSettings, plan_video


class VideoPreprocessor:
    def __init__(self, images: ImagePreprocessor, defaults: VideoSettings) -> None:
        self._images = images
        self.defaults = defaults
        self.patch_size = images.patch_size
        self.merge_size = images.merge_size
        self.temporal_patch_size = int(images.processor.temporal_patch_size)

    def plan(self, header: VideoHeader, settings: VideoSettings) -> VideoPlan:
        return plan_video(
            header,
            settings,
            self.patch_size,
            self.merge_size,
            self.temporal_patch_size,
            self._images.value_bytes,
        )

    def prepare(
        self,
        data: bytes,
        header: VideoHeader,
        plan: VideoPlan,
        cache: EmbeddingCache | None,
        stop: StopCheck | None = None,
    ) -> PreparedVideo:
        """Decode the plan's frames and key the video; each uncached group keeps its frames
        and is cut when the ViT takes it (``PreparedImage.patches``), so the first groups are
        encoded while later ones wait as bytes. The decode stops between frames when ``stop``
        says so (``DeadlineExpired``, ``RequestCancelled``)."""
        frames = self.sampled_frames(data, header, plan, stop)
        key = self._key(plan, frames)
        tp = self.temporal_patch_size
        group_bytes = plan.pixel_bytes // plan.grid_thw[0]
        groups = []
        for g, group_key in enumerate(self._group_keys(key, plan)):
            rows = cache.get(group_key) if cache is not None else None
            if rows is not None:
                groups.append(self._group(plan, group_key, rows=rows))
                continue
            cut = partial(self.cut, frames[g * tp : (g + 1) * tp])
            pending = PendingPatches(cut, group_bytes)
            groups.append(self._group(plan, group_key, pending=pending))
        return self._video(key, plan, groups)

    def cached(self, key: bytes, plan: VideoPlan, cache: EmbeddingCache) -> PreparedVideo | None:
        """The video ``key`` (sampled by ``plan``) when the cache holds every frame group's rows,
        with nothing decoded; None (no hit or miss counted) when one is missing."""
        group_keys = self._group_keys(key, plan)
        if not all(group_key in cache for group_key in group_keys):
            return None
        groups = []
        for group_key in group_keys:
            rows = cache.get(group_key)
            if rows is None:  # evicted since the check
                return None
            groups.append(self._group(plan, group_key, rows=rows))
        return self._video(key, plan, groups)

    def _group_keys(self, key: bytes, plan: VideoPlan) -> list[bytes]:
        return [
            xxhash.xxh3_128(key + g.to_bytes(4, "little")).digest() for g in range(plan.grid_thw[0])
        ]

    def _group(self, plan: VideoPlan, key: bytes, **content) -> PreparedImage:
        _, grid_h, grid_w = plan.grid_thw
        return PreparedImage(
            key, (1, grid_h, grid_w), grid_h * grid_w // self.merge_size**2, **content
        )

    @staticmethod
    def _video(key: bytes, plan: VideoPlan, groups: list[PreparedImage]) -> PreparedVideo:
        return PreparedVideo(
            key=key,
            grid_thw=plan.grid_thw,
            groups=groups,
            second_per_grid_t=plan.second_per_grid_t,
            timestamps=list(plan.timestamps),
            num_frames=len(plan.indices),
        )

    @staticmethod
    def plan_meta(plan: VideoPlan) -> bytes:
        """How ``plan`` samples its video: part of the video's key and of its bytes' digest."""
        meta = {
            "indices": list(plan.indices),
            "size": [plan.height, plan.width],
            "sample_fps": plan.sample_fps,
            "timestamps": list(plan.timestamps),
        }
        return b"video:" + json.dumps(meta, sort_keys=True).encode()

    def sampled_frames(
        self, data: bytes, header: VideoHeader, plan: VideoPlan, stop: StopCheck | None = None
    ) -> list[np.ndarray]:
        """The plan's frames, decoded and resized: ``[height, width, 3]`` uint8 each, in the
        plan's order (a frame used twice appears twice)."""
        resized: dict[int, np.ndarray] = {}
        size = (plan.width, plan.height)

        def keep(index: int, rgb: np.ndarray) -> None:
            if (rgb.shape[1], rgb.shape[0]) != size:  # else kept as decoded: no PIL round trip
                img = Image.fromarray(rgb, "RGB").resize(size, Image.Resampling.BICUBIC)
                rgb = np.asarray(img)
            resized[index] = rgb

        workers = torch.get_num_threads()  # the resizes (and conversions) beside the decoding
        decode_frames(data, header, list(plan.indices), keep, stop, workers)
        return [resized[i] for i in plan.indices]

    def cut(self, frames: list[np.ndarray]) -> torch.Tensor:
        """One frame group's flat patches, in the image path's dtype."""
        cutter = self._images.cutter
        if cutter is not None:
            return cutter.cut_frames(frames)
        # The processor cuts an image with its frame repeated; take one temporal slice per frame.
        proc, p = self._images.processor, self.patch_size
        slices = []
        for t, frame in enumerate(frames):
            out = proc(images=[Image.fromarray(frame)], do_resize=False, return_tensors="pt")
            patches = out["pixel_values"]
            slices.append(patches.view(patches.shape[0], 3, len(frames), p, p)[:, :, t])
        flat = torch.stack(slices, dim=2).reshape(slices[0].shape[0], -1)
        return flat.to(self._images.dtype, memory_format=torch.contiguous_format)

    def _key(self, plan: VideoPlan, frames: list[np.ndarray]) -> bytes:
        h = xxhash.xxh3_128()
        h.update(self._images.params_digest)
        h.update(self.plan_meta(plan))
        for frame in frames:
            h.update(frame.tobytes())
        return h.digest()
