"""Which frames of a video are used and at what size: Qwen-VL's published rules (qwen-vl-utils).

With ``T`` frames at ``video_fps`` in the file, ``fps`` asked for, and the temporal patch size
``F`` (2): the frame count is ``T / video_fps * fps`` clamped to ``[ceil_F(min_frames),
floor_F(min(max_frames, T))]`` and rounded down to a multiple of ``F``; the frames are
``linspace(0, T - 1, n).round()``. Every frame is resized with ``smart_resize`` under
``max(min(max_pixels, total_pixels * F / n), 1.05 * min_pixels)`` pixels (a per-frame share of
the video's total budget). Qwen2.5-VL's M-RoPE spaces frame groups by ``F / sample_fps`` seconds
(``sample_fps = n / T * video_fps``); Qwen3-VL writes each group's time, the mean of its frames'
times, into the prompt as ``<t seconds>``.

Everything here is known from the header alone, before a frame is decoded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .errors import InvalidInput
from .resize import smart_resize
from .types import VideoSampling
from .video_decode import VideoHeader


@dataclass(frozen=True)
class VideoSettings:
    """Resolved sampling settings of one video (request values over the encoder's defaults)."""

    fps: float
    min_frames: int
    max_frames: int
    min_pixels: int
    max_pixels: int
    total_pixels: int

    @classmethod
    def resolve(cls, asked: VideoSampling, default: VideoSettings) -> VideoSettings:
        """``asked`` over ``default``; values beyond the encoder's are ``InvalidInput``."""
        max_frames = asked.max_frames or default.max_frames
        max_pixels = asked.max_pixels or default.max_pixels
        out = cls(
            fps=asked.fps or default.fps,
            # a lower maximum asked for lowers the default minimum with it
            min_frames=asked.min_frames or min(default.min_frames, max_frames),
            max_frames=max_frames,
            min_pixels=asked.min_pixels or min(default.min_pixels, max_pixels),
            max_pixels=max_pixels,
            total_pixels=asked.total_pixels or default.total_pixels,
        )
        for name in ("fps", "max_frames", "max_pixels", "total_pixels"):
            value, bound = getattr(out, name), getattr(default, name)
            if value > bound:
                value, bound = (f"{value:g}", f"{bound:g}") if name == "fps" else (value, bound)
                raise InvalidInput(
                    f"video sampling {name} is {value}; this encoder allows at most {bound}"
                )
        if out.min_frames > out.max_frames:
            raise InvalidInput(f"video min_frames {out.min_frames} > max_frames {out.max_frames}")
        if out.min_pixels > out.max_pixels:
            raise InvalidInput(f"video min_pixels {out.min_pixels} > max_pixels {out.max_pixels}")
        return out


@dataclass(frozen=True)
class VideoPlan:
    """What a video will be: its frames, their size, its groups' times; and its cost."""

    indices: tuple[int, ...]  # frames used, ascending (repeats possible)
    height: int  # every frame resized to this
    width: int
    sample_fps: float
    second_per_grid_t: float
    timestamps: tuple[float, ...]  # seconds, one per frame group
    grid_thw: tuple[int, int, int]  # (groups, h, w) in patches
    num_tokens: int
    pixel_bytes: int  # its patches


def plan_video(
    header: VideoHeader,
    settings: VideoSettings,
    patch_size: int,
    merge_size: int,
    temporal_patch_size: int,
    value_bytes: int = 4,
) -> VideoPlan:
    """The frames and size Qwen's rules give ``header``'s video under ``settings``
    (``value_bytes``: bytes per patch value, for the budget)."""
    indices = sample_indices(header.num_frames, header.fps, settings, temporal_patch_size)
    num = len(indices)
    factor = patch_size * merge_size
    max_pixels = max(
        min(settings.max_pixels, settings.total_pixels * temporal_patch_size / num),
        int(settings.min_pixels * 1.05),
    )
    height, width = smart_resize(
        header.height, header.width, factor, settings.min_pixels, int(max_pixels)
    )
    groups = num // temporal_patch_size
    grid = (groups, height // patch_size, width // patch_size)
    sample_fps = num / header.num_frames * header.fps
    times = [i / header.fps for i in indices]
    stamps = tuple(
        (times[g * temporal_patch_size] + times[(g + 1) * temporal_patch_size - 1]) / 2
        for g in range(groups)
    )
    num_patches = grid[0] * grid[1] * grid[2]
    return VideoPlan(
        indices=tuple(indices),
        height=height,
        width=width,
        sample_fps=sample_fps,
        second_per_grid_t=temporal_patch_size / sample_fps,
        timestamps=stamps,
        grid_thw=grid,
        num_tokens=num_patches // merge_size**2,
        pixel_bytes=num_patches * 3 * temporal_patch_size * patch_size**2 * value_bytes,
    )


def sample_indices(total: int, video_fps: float, settings: VideoSettings, factor: int) -> list[int]:
    """qwen-vl-utils' ``smart_nframes`` and frame choice; ``InvalidInput`` when the video has
    fewer frames than one temporal patch."""
    if total < factor:
        raise InvalidInput(f"video has {total} frame(s); at least {factor} are needed")
    min_frames = math.ceil(settings.min_frames / factor) * factor
    max_frames = math.floor(min(settings.max_frames, total) / factor) * factor
    num = total / video_fps * settings.fps
    num = min(max(num, min_frames), max_frames, total)
    num = math.floor(num / factor) * factor
    num = max(num, factor)
    return np.linspace(0, total - 1, num).round().astype(np.int64).tolist()
