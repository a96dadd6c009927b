"""Shape of the transfer buffers: block geometry and the width/dtype of an embedding row."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_DTYPE_NAMES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPE_NAMES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use one of {sorted(_DTYPE_NAMES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class BufferLayout:
    """Geometry shared by both ends; the sender refuses a receiver whose row layout differs.

    A row is one image token's embedding followed by its deepstack rows:
    ``row_width = hidden_size * (1 + num_deepstack)`` elements of ``dtype``.
    """

    num_blocks: int
    block_size: int
    hidden_size: int
    num_deepstack: int = 0
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.num_blocks <= 0 or self.block_size <= 0 or self.hidden_size <= 0:
            raise ValueError(f"invalid layout {self}")
        if self.num_deepstack < 0:
            raise ValueError("num_deepstack must be >= 0")

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def row_width(self) -> int:
        return self.hidden_size * (1 + self.num_deepstack)

    @property
    def row_bytes(self) -> int:
        return self.row_width * self.dtype.itemsize

    def describe(self) -> str:
        return (
            f"hidden={self.hidden_size} deepstack={self.num_deepstack} "
            f"dtype={dtype_name(self.dtype)} row_bytes={self.row_bytes}"
        )


def layout_for(
    config: object, hidden_size: int, num_deepstack: int = 0, dtype: torch.dtype | None = None
) -> BufferLayout:
    """The layout of a ``TransferConfig``'s buffer for rows of the given model, in the config's
    wire dtype unless ``dtype`` overrides it."""
    return BufferLayout(
        num_blocks=config.num_blocks,  # type: ignore[attr-defined]
        block_size=config.block_size,  # type: ignore[attr-defined]
        hidden_size=hidden_size,
        num_deepstack=num_deepstack,
        dtype=dtype if dtype is not None else parse_dtype(config.dtype),  # type: ignore[attr-defined]
    )
