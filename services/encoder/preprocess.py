"""RGB image -> ViT patches: smart_resize, then the checkpoint's image processor (PIL backend).

The image processor is called with ``do_resize=False`` on an image we resized ourselves with the
same filter (bicubic), so the token count is known from ``smart_resize`` alone and the result
equals what transformers' processor gives for the original image.
"""

from __future__ import annotations

import json

import torch
import xxhash
from PIL import Image

from .checkpoint import Checkpoint
from .resize import smart_resize
from .types import PreparedImage


class ImagePreprocessor:
    """Resizes and normalizes images for one checkpoint; computes their cache keys."""

    def __init__(self, checkpoint: Checkpoint, min_pixels: int = 0, max_pixels: int = 0) -> None:
        proc = checkpoint.image_processor
        self._processor = proc
        self.patch_size = int(proc.patch_size)
        self.merge_size = int(proc.merge_size)
        self.factor = self.patch_size * self.merge_size
        size = proc.size
        self.min_pixels = min_pixels or int(size.shortest_edge)
        self.max_pixels = max_pixels or int(size.longest_edge)
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels {self.min_pixels} > max_pixels {self.max_pixels}")
        params = {
            "revision": checkpoint.revision,
            "factor": self.factor,
            "min_pixels": self.min_pixels,
            "max_pixels": self.max_pixels,
            "mean": list(proc.image_mean),
            "std": list(proc.image_std),
            "temporal_patch_size": int(proc.temporal_patch_size),
        }
        self._params_digest = xxhash.xxh3_128(json.dumps(params, sort_keys=True).encode()).digest()

    def target_size(self, width: int, height: int) -> tuple[int, int]:
        """(height, width) the image is resized to."""
        return smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)

    def cache_key(self, img: Image.Image) -> bytes:
        """xxh3_128 of the decoded RGB pixels, their size and the preprocessing parameters."""
        h = xxhash.xxh3_128()
        h.update(self._params_digest)
        h.update(f"{img.mode}:{img.width}x{img.height}".encode())
        h.update(img.tobytes())
        return h.digest()

    def prepare(self, img: Image.Image, with_pixels: bool = True) -> PreparedImage:
        """Resize ``img`` (RGB) and cut it into patches (``with_pixels=False``: key and grid only,
        keeping the resized image so ``pixels`` can run later, e.g. after a cache eviction)."""
        height, width = self.target_size(img.width, img.height)
        resized = (
            img
            if (img.height, img.width) == (height, width)
            else img.resize((width, height), Image.Resampling.BICUBIC)
        )
        grid = (1, height // self.patch_size, width // self.patch_size)
        prepared = PreparedImage(
            key=self.cache_key(img),
            pixel_values=None,
            grid_thw=grid,
            num_tokens=grid[0] * grid[1] * grid[2] // self.merge_size**2,
            resized=resized,
        )
        if with_pixels:
            self.fill_pixels(prepared)
        return prepared

    def fill_pixels(self, prepared: PreparedImage) -> torch.Tensor:
        """Compute (once) and return ``prepared.pixel_values``."""
        if prepared.pixel_values is None:
            out = self._processor(images=[prepared.resized], do_resize=False, return_tensors="pt")
            grid = tuple(int(x) for x in out["image_grid_thw"][0])
            if grid != prepared.grid_thw:
                raise RuntimeError(f"image processor grid {grid} != expected {prepared.grid_thw}")
            prepared.pixel_values = out["pixel_values"]
        return prepared.pixel_values
