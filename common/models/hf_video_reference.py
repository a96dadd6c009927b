"""The monolithic baseline's videos: what transformers' Qwen-VL processors would give, computed
without their video processors (they need torchvision, which this project must not install).

Shares no code with the encoder: frames are decoded here with PyAV, chosen by qwen-vl-utils'
published rules written out plainly, resized with PIL (bicubic), normalized by the checkpoint's
image processor one frame at a time, and laid out as transformers' video ``patchify`` does. The
prompt text is expanded as the processors do (Qwen3-VL: ``<t seconds>`` per frame group) and
tokenized whole; ``mm_token_type_ids`` are 1 at image tokens and 2 at video tokens.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import torch
from PIL import Image


@dataclass(frozen=True)
class VideoSpec:
    """Qwen's sampling settings, in pixels (qwen-vl-utils' names)."""

    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    min_pixels: int = 128 * 28 * 28
    max_pixels: int = 768 * 28 * 28
    total_pixels: int = 24576 * 28 * 28


@dataclass
class ReferenceVideo:
    pixel_values_videos: torch.Tensor  # [T*h*w, C*2*p*p]
    video_grid_thw: torch.Tensor  # [1, 3]
    second_per_grid_t: float
    timestamps: list[float]  # per frame group, seconds


def smart_resize(h: int, w: int, factor: int, min_pixels: int, max_pixels: int):
    h_bar, w_bar = max(factor, round(h / factor) * factor), max(factor, round(w / factor) * factor)
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(h * w / max_pixels)
        h_bar = max(factor, math.floor(h / beta / factor) * factor)
        w_bar = max(factor, math.floor(w / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (h * w))
        h_bar, w_bar = math.ceil(h * beta / factor) * factor, math.ceil(w * beta / factor) * factor
    return h_bar, w_bar


def reference_video(data: bytes, image_processor, spec: VideoSpec) -> ReferenceVideo:
    """``pixel_values_videos`` and the rest for the encoded video ``data``."""
    import av

    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        video_fps = float(stream.average_rate)
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
    total = len(frames)
    nframes = total / video_fps * spec.fps
    lo = math.ceil(spec.min_frames / 2) * 2
    hi = math.floor(min(spec.max_frames, total) / 2) * 2
    nframes = max(math.floor(min(max(nframes, lo), hi, total) / 2) * 2, 2)
    indices = torch.linspace(0, total - 1, nframes).round().long().tolist()
    p, m = int(image_processor.patch_size), int(image_processor.merge_size)
    max_pixels = max(
        min(spec.max_pixels, spec.total_pixels / nframes * 2), int(spec.min_pixels * 1.05)
    )
    height, width = frames[0].shape[:2]
    h, w = smart_resize(height, width, p * m, spec.min_pixels, int(max_pixels))
    planes = []
    for i in indices:
        frame = Image.fromarray(frames[i]).resize((w, h), Image.Resampling.BICUBIC)
        out = image_processor(images=[frame], do_resize=False, return_tensors="pt")
        x = out["pixel_values"].view(h // p // m, w // p // m, m, m, 3, 2, p, p)[..., 0, :, :]
        planes.append(x.permute(4, 0, 2, 5, 1, 3, 6).reshape(3, h, w))
    video = torch.stack(planes)  # [T, C, H, W]
    grid_t, grid_h, grid_w = nframes // 2, h // p, w // p
    patches = video.view(1, grid_t, 2, 3, grid_h // m, m, p, grid_w // m, m, p)
    patches = patches.permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)
    pixel_values = patches.reshape(grid_t * grid_h * grid_w, 3 * 2 * p * p)
    times = [i / video_fps for i in indices]
    sample_fps = nframes / total * video_fps
    return ReferenceVideo(
        pixel_values_videos=pixel_values,
        video_grid_thw=torch.tensor([[grid_t, grid_h, grid_w]]),
        second_per_grid_t=2 / sample_fps,
        timestamps=[(times[g * 2] + times[g * 2 + 1]) / 2 for g in range(grid_t)],
    )


def expand_video_text(text: str, video: ReferenceVideo, merge_size: int, timestamps: bool) -> str:
    """``text`` with its one ``<|video_pad|>`` expanded as the model's processor does."""
    t, h, w = (int(x) for x in video.video_grid_thw[0])
    per_group = h * w // merge_size**2
    if timestamps:  # Qwen3VLProcessor.replace_video_token
        pads = "".join(
            f"<{stamp:.1f} seconds><|vision_start|>{'<|video_pad|>' * per_group}<|vision_end|>"
            for stamp in video.timestamps
        )
    else:
        pads = "<|video_pad|>" * (t * per_group)
    assert text.count("<|video_pad|>") == 1, "one video placeholder"
    return text.replace("<|video_pad|>", pads)


def mm_token_types(ids: torch.Tensor, config) -> torch.Tensor:
    """1 at image tokens, 2 at video tokens, 0 elsewhere."""
    return (ids == config.image_token_id).long() + 2 * (ids == config.video_token_id).long()
