"""The preallocated KV pool: per layer K and V of shape ``[num_slots, kv_heads, head_dim]``.

A *slot* holds the K/V of one token in every layer. Requests and the radix cache refer to
tokens by slot index; the pool itself knows nothing about who owns which slot.
"""

from __future__ import annotations

import torch


def slot_bytes(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one token slot occupies across all layers (K and V)."""
    return 2 * num_layers * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8


class KVPool:
    """Owns the K/V tensors; indexes are slot ids handed out by ``SlotAllocator``."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (num_slots, num_kv_heads, head_dim)
        self.num_slots = num_slots
        self._k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    def layer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._k[layer_id], self._v[layer_id]


class SlotAllocator:
    """Free list of slot ids. Invariant: every slot is either free here or owned elsewhere
    (a request or the radix cache), never both; ``free`` of a free slot raises."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out low ids first
        self._is_free = torch.ones(num_slots, dtype=torch.bool)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """``num_tokens`` slot ids (long, CPU), or None when not enough are free."""
        if num_tokens > len(self._free):
            return None
        ids = [self._free.pop() for _ in range(num_tokens)]
        out = torch.tensor(ids, dtype=torch.long)
        self._is_free[out] = False
        return out

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel() == 0:
            return
        slots = slots.cpu()
        if bool(self._is_free[slots].any()) or slots.unique().numel() != slots.numel():
            raise RuntimeError("double free of KV slots")
        self._is_free[slots] = True
        self._free.extend(slots.tolist())
