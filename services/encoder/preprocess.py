"""RGB image -> ViT patches: smart_resize, then the checkpoint's image processor (PIL backend),
or the lookup table that gives the same values in one pass (``patches.py``).

The image processor is called with ``do_resize=False`` on an image we resized ourselves with the
same filter (bicubic), so the token count is known from ``smart_resize`` alone and the result
equals what transformers' processor gives for the original image. ``plan`` gives the token count
and the patch bytes from the header's size, before anything is decoded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch
import xxhash
from PIL import Image

from common.native_kernels import NativeKernels

from .checkpoint import Checkpoint
from .patches import PatchCutter
from .resize import smart_resize
from .types import PreparedImage


@dataclass(frozen=True)
class ImagePlan:
    """An image's cost, known from its header before any pixel is decoded."""

    num_tokens: int  # rows it yields
    pixel_bytes: int  # bytes of its patches


class ImagePreprocessor:
    """Resizes and normalizes images for one checkpoint; computes their cache keys."""

    def __init__(
        self,
        checkpoint: Checkpoint,
        min_pixels: int = 0,
        max_pixels: int = 0,
        dtype: torch.dtype = torch.float32,
        native: NativeKernels | None = None,
    ) -> None:
        """``native``: the kernels that cut patches in one pass (the same values), if any."""
        proc = checkpoint.image_processor
        self._processor = proc
        self.patch_size = int(proc.patch_size)
        self.merge_size = int(proc.merge_size)
        self.factor = self.patch_size * self.merge_size
        # values per patch: channels x frames (an image is repeated) x patch x patch
        self.patch_values = 3 * int(proc.temporal_patch_size) * self.patch_size**2
        self.dtype = dtype  # of the patches: the tower's, which would cast them to it anyway
        self.value_bytes = dtype.itemsize
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
        self._cutter = PatchCutter.for_processor(proc, dtype)  # None: the processor cuts them
        if self._cutter is not None:
            self._cutter.native = native

    @property
    def params_digest(self) -> bytes:
        """xxh3_128 of the preprocessing parameters and the model revision (part of every key)."""
        return self._params_digest

    @property
    def processor(self):
        return self._processor

    @property
    def cutter(self) -> PatchCutter | None:
        return self._cutter

    def target_size(self, width: int, height: int) -> tuple[int, int]:
        """(height, width) the image is resized to."""
        return smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)

    def plan(self, width: int, height: int) -> ImagePlan:
        """What a ``width`` x ``height`` image will cost, from its header alone.

        Tokens and patch bytes do not depend on the orientation (smart_resize is symmetric),
        so the EXIF rotation applied at decoding changes neither.
        """
        h, w = self.target_size(width, height)
        num_patches = (h // self.patch_size) * (w // self.patch_size)  # one frame: t = 1
        return ImagePlan(
            num_tokens=num_patches // self.merge_size**2,
            pixel_bytes=num_patches * self.patch_values * self.value_bytes,
        )

    def cache_key(self, img: Image.Image) -> bytes:
        """xxh3_128 of the decoded RGB pixels, their size and the preprocessing parameters."""
        h = xxhash.xxh3_128()
        h.update(self._params_digest)
        h.update(f"{img.mode}:{img.width}x{img.height}".encode())
        h.update(img.tobytes())
        return h.digest()

    def prepare(self, img: Image.Image, key: bytes | None = None) -> PreparedImage:
        """Resize ``img`` (RGB) and cut it into patches (``key``: its ``cache_key``)."""
        key = key if key is not None else self.cache_key(img)
        height, width = self.target_size(img.width, img.height)
        if (img.height, img.width) != (height, width):
            img = img.resize((width, height), Image.Resampling.BICUBIC)
        grid = (1, height // self.patch_size, width // self.patch_size)
        if self._cutter is not None:
            pixel_values = self._cutter(img)
        else:
            out = self._processor(images=[img], do_resize=False, return_tensors="pt")
            if tuple(int(x) for x in out["image_grid_thw"][0]) != grid:
                raise RuntimeError(f"image processor grid {out['image_grid_thw'][0]} != {grid}")
            pixel_values = out["pixel_values"].to(self.dtype)
        expected = (grid[1] * grid[2], self.patch_values)
        if tuple(pixel_values.shape) != expected:
            raise RuntimeError(f"patches {tuple(pixel_values.shape)} != {expected}")
        return PreparedImage(
            key=key,
            grid_thw=grid,
            num_tokens=grid[0] * grid[1] * grid[2] // self.merge_size**2,
            pixel_values=pixel_values,
        )

    def cached(self, rows: torch.Tensor, key: bytes, width: int, height: int) -> PreparedImage:
        """A ``width`` x ``height`` image whose rows the cache holds: no resize, no patches."""
        height, width = self.target_size(width, height)
        grid = (1, height // self.patch_size, width // self.patch_size)
        return PreparedImage(key, grid, grid[1] * grid[2] // self.merge_size**2, rows=rows)
