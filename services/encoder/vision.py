"""The vision tower alone: only the checkpoint's visual weights are read and held.

The tower is built from ``config.vision_config`` the way the full model builds it
(``VisionClass._from_config``), then the safetensors entries under the visual prefix are read
(only those, from exactly the files the checkpoint's index names) and loaded with
``load_state_dict(strict=True)``.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import torch

from common.compute import prepare_device, resolve_compute
from common.linear_kernels import use_linear_kernel
from common.models import checkpoint_files
from common.native_kernels import NativeKernels, resolve_cpu_kernels, use_native_rms_norms

from .checkpoint import VISION_CLASS, Checkpoint
from .patch_embed import patch_embed_as_linear
from .vision_attention import rotate_qk, use_grouped_attention

logger = logging.getLogger(__name__)

VISUAL_PREFIXES = ("model.visual.", "visual.")


def to_host(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``rows`` as a CPU tensor of its own (no view of a batch) in ``dtype``.

    The cast runs where the rows are (on the GPU before the copy to the host, so a narrower
    dtype also halves the copied bytes); exactly one new tensor is made.
    """
    out = rows.to(dtype=dtype)
    if out.device.type != "cpu":
        return out.to("cpu")
    if out.data_ptr() == rows.data_ptr():
        out = out.clone()
    return out.contiguous()


def weight_files(path: Path) -> list[Path]:
    """The checkpoint's weight files: exactly the shards its index names, when it has one."""
    return checkpoint_files.weight_files(path)


def read_visual_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """The visual tensors of the checkpoint, keys relative to the tower.

    Values are views of the weight files' memory maps (see ``common.models.checkpoint_files``):
    only the visual tensors' pages are ever read, and they cost no memory of their own beyond
    the page cache once the caller has copied them into the tower.
    """

    def visual_name(key: str) -> str | None:
        for prefix in VISUAL_PREFIXES:
            if key.startswith(prefix):
                return key[len(prefix) :]
        return None

    state = {name: tensor for name, _, tensor in checkpoint_files.iter_tensors(path, visual_name)}
    if not state:
        raise ValueError(f"no vision weights (prefixes {VISUAL_PREFIXES}) in {path}")
    return state


class VisionTower:
    """Runs ``visual(pixel_values, grid_thw)``; one output row per image token.

    Rows are ``[main | deepstack_0 | deepstack_1 ...]`` (width ``hidden * (1 + K)``) for Qwen3-VL,
    the main embedding alone otherwise.
    """

    def __init__(
        self,
        checkpoint: Checkpoint,
        device: str = "auto",
        dtype: str = "auto",
        linear_kernel: str = "auto",
        attention: str = "auto",
        cpu_kernels: str = "auto",
    ) -> None:
        from transformers.initialization import no_init_weights

        compute = resolve_compute(device, dtype)
        self.device, self.dtype = compute.device, compute.dtype
        logger.info("vision tower on %s in %s (%s)", self.device, self.dtype, compute.reason)
        prepare_device(self.device)
        vision_cls = checkpoint.model_class(VISION_CLASS)
        # its own copy of the configuration: the attention setting below is this tower's alone
        vision_config = copy.deepcopy(checkpoint.config.vision_config)
        with no_init_weights():
            module = vision_cls._from_config(vision_config, dtype=self.dtype)
        state = read_visual_state_dict(checkpoint.path)
        module.load_state_dict(state, strict=True)
        self.module = module.to(self.device).eval()
        self.linear_kernel = use_linear_kernel(
            self.module, linear_kernel, self.device, self.dtype, "vision tower"
        )
        if self.linear_kernel == "onednn" and patch_embed_as_linear(self.module):
            logger.info("vision tower: patch embedding runs as a prepacked linear layer")
        native = resolve_cpu_kernels(cpu_kernels, self.device, self.dtype, "vision tower")
        self.native = native  # also cuts the patches (``ImagePreprocessor``)
        self.cpu_kernels = "torch" if native is None else "native"
        if native is not None:
            num = use_native_rms_norms(self.module, native)
            logger.info("vision tower: %d RMSNorms on the native kernel", num)
        rotate = rotate_qk if native is None else native.rotate_qk
        kernel = vision_attention_kernel(attention, self.module, native, self.dtype)
        self.attention = "per_piece"
        if attention != "per_piece" and use_grouped_attention(self.module, rotate, kernel):
            self.attention = "grouped" if kernel is None else "native"
        elif attention == "native":
            raise RuntimeError("vision_attention native: the tower's attention is not SDPA's")
        logger.info("vision tower: attention %s", self.attention)
        self.row_width = checkpoint.row_width
        self.merge_size = int(checkpoint.config.vision_config.spatial_merge_size)

    @torch.inference_mode()
    def forward(
        self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]
    ) -> torch.Tensor:
        """Rows ``[sum(t*h*w) / merge**2, row_width]`` of the images, concatenated in order."""
        grid_thw = torch.tensor(grids, dtype=torch.long, device=self.device)
        out = self.module(pixel_values.to(self.device, self.dtype), grid_thw=grid_thw)
        parts = [out.pooler_output, *(getattr(out, "deepstack_features", None) or [])]
        rows = torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]
        if rows.shape[-1] != self.row_width:
            raise RuntimeError(f"vision rows are {rows.shape[-1]} wide, expected {self.row_width}")
        return rows

    def split(self, rows: torch.Tensor, grids: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        """Per-image views of ``forward``'s output."""
        sizes = [t * h * w // self.merge_size**2 for t, h, w in grids]
        return list(torch.split(rows, sizes))


def vision_attention_kernel(
    choice: str, module: torch.nn.Module, native: NativeKernels | None, dtype: torch.dtype
) -> NativeKernels | None:
    """The kernels whose ``self_attention`` the tower's attention takes under the
    ``vision_attention`` setting, or None for SDPA. ``auto`` takes the native kernel where it
    runs (the native CPU kernels loaded, bf16, AVX-512 BF16, a head_dim it takes) and logs why
    not elsewhere; ``native`` raises ``RuntimeError`` naming why where it cannot run."""
    if choice in ("grouped", "per_piece"):
        return None
    config = module.config
    heads = int(config.num_heads)
    head_dim = int(getattr(config, "embed_dim", None) or config.hidden_size) // heads
    why = ""
    if native is None:
        why = "no native CPU kernels (cpu_kernels)"
    elif not native.attention_fits(dtype, heads, heads, head_dim):
        why = (
            f"the kernel takes bf16 on a CPU with AVX-512 BF16 and head_dim a multiple of 16 up "
            f"to 256 (here {dtype}, {heads} heads of {head_dim})"
        )
    if not why:
        return native
    if choice == "native":
        raise RuntimeError(f"vision_attention native: {why}")
    logger.info("vision tower: no native attention (%s)", why)
    return None
