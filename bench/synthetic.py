"""Deterministic synthetic requests for tests and the benchmark (same seed -> same bytes)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from common.transfer.layout import BufferLayout
from common.transfer.types import AuxInfo, ReceivedEmbeddings


@dataclass(frozen=True)
class RequestSpec:
    seed: int
    total_tokens: int
    num_image_rows: int  # == total_tokens: every token is an image token


@dataclass
class SyntheticRequest:
    fill_ids: np.ndarray
    positions: np.ndarray
    image_rows: torch.Tensor
    image_mask: np.ndarray
    aux: AuxInfo


def make_request(spec: RequestSpec, layout: BufferLayout) -> SyntheticRequest:
    rng = np.random.default_rng(spec.seed)
    total, num_rows = spec.total_tokens, spec.num_image_rows
    mask = np.zeros(total, dtype=bool)
    if num_rows:
        start = int(rng.integers(0, total - num_rows + 1))
        mask[start : start + num_rows] = True  # one contiguous image, like a real prompt
    fill_ids = rng.integers(0, 2**31 - 1, size=total, dtype=np.int32)
    positions = rng.integers(0, 2**20, size=(3, total), dtype=np.int32)
    gen = torch.Generator().manual_seed(spec.seed)
    rows = torch.randn((num_rows, layout.row_width), generator=gen).to(layout.dtype)
    extra = bytes(rng.integers(0, 256, size=int(rng.integers(0, 64)), dtype=np.uint8))
    aux = AuxInfo(total, num_rows, mrope_delta=int(rng.integers(-50, 50)), num_items=1, extra=extra)
    return SyntheticRequest(fill_ids, positions, rows, mask, aux)


def matches(received: ReceivedEmbeddings, expected: SyntheticRequest) -> bool:
    """Every byte equal."""
    return (
        received.aux == expected.aux
        and np.array_equal(received.fill_ids, expected.fill_ids)
        and np.array_equal(received.positions, expected.positions)
        and received.image_rows.dtype == expected.image_rows.dtype
        and torch.equal(received.image_rows, expected.image_rows)
    )
