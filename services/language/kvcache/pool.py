"""The preallocated KV pool: per layer K and V of shape ``[num_slots, kv_heads, head_dim]``.

A *slot* holds the K/V of one token in every layer. Requests and the radix cache refer to
tokens by slot index; the pool itself knows nothing about who owns which slot.

NOTE: the pool is allocated with ``torch.empty``: a slot is always written (its token's K/V)
before anything reads it, and attention pads with a slot of the same request, never an unused
one. On CPU the pages of an empty tensor are committed only when first written, so a pool sized
from free memory costs nothing until it is used; the allocator hands out never-used slots in
ascending order and reuses freed ones first (LIFO), so the touched part stays as small as the
peak number of slots in use (radix cache included).

One row past the last slot is the *scratch slot* (``scratch_slot``), zeroed, owned by no
request and never handed out: the padded rows of a CUDA-graph decode step write their K/V there
and pad keys point at it (``engine/decode_graphs.py``).
"""

from __future__ import annotations

import numpy as np
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
        shape = (num_slots + 1, num_kv_heads, head_dim)  # + the scratch slot
        self.num_slots = num_slots
        self.scratch_slot = num_slots
        self._k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        for cache in (*self._k, *self._v):
            cache[self.scratch_slot].zero_()  # finite: a masked key still meets its value

    def layer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._k[layer_id], self._v[layer_id]


class SlotAllocator:
    """Free slot ids. Invariant: every slot is either free here or owned elsewhere (a request or
    the radix cache), never both; ``free`` of a free slot raises.

    Free slots are the freed ones (a stack, most recent on top; a block taken from it keeps the
    order its slots were freed in, so a request's run of slots comes back a run) and the
    never-used ones (``num_fresh`` of them, from ``num_slots - num_fresh`` up). Both arrays are
    zero-filled or empty at start, so their memory too is committed only as slots are used.
    """

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._stack = np.empty(num_slots, dtype=np.int64)  # freed slots, [0, _num_stacked)
        self._num_stacked = 0
        self._num_fresh = num_slots
        self._in_use = np.zeros(num_slots, dtype=bool)

    @property
    def num_free(self) -> int:
        return self._num_stacked + self._num_fresh

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """``num_tokens`` slot ids (long, CPU), or None when not enough are free."""
        if num_tokens > self.num_free:
            return None
        from_stack = min(num_tokens, self._num_stacked)
        top = self._num_stacked
        reused = self._stack[top - from_stack : top]  # in the order freed: a run stays a run
        self._num_stacked -= from_stack
        first_fresh = self.num_slots - self._num_fresh
        fresh = np.arange(first_fresh, first_fresh + num_tokens - from_stack, dtype=np.int64)
        self._num_fresh -= fresh.shape[0]
        ids = np.concatenate([reused, fresh])
        self._in_use[ids] = True
        return torch.from_numpy(ids)

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel() == 0:
            return
        ids = slots.cpu().numpy().astype(np.int64, copy=False)
        if not self._in_use[ids].all() or np.unique(ids).shape[0] != ids.shape[0]:
            raise RuntimeError("double free of KV slots")
        self._in_use[ids] = False
        self._stack[self._num_stacked : self._num_stacked + ids.shape[0]] = ids
        self._num_stacked += ids.shape[0]
