"""The tensors of one model step: a flat batch of new tokens from several requests.

Every step concatenates the new tokens of all scheduled requests (prefill chunks and decode
tokens alike) into ``T`` rows. Attention is computed per request over its KV slots, which hold
the cached prefix followed by the tokens of this step (written before attention runs).

Row layout: the ``B`` decode tokens first, as consecutive ``DecodeGroup`` row ranges (requests
of similar KV length, see ``services/language/engine/decode_groups.py``) or, on a CPU with the
native decode-attention kernel, one ``DecodeRows`` whose keys are read in the pool in place;
then the prefill chunks, one ``ExtendSegment`` each.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.native_kernels import NativeKernels

# SDPA's CPU kernel, called directly where its log-sum-exp is needed too (None where torch lacks it)
FLASH_ATTENTION_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
# a prefill chunk after at least this many cached keys attends to them apart on a CPU (see
# ``ExtendSegment.split_prefix`` and ``model/attention.py``); below it the second call and the
# merge cost more than the mask saves
SPLIT_PREFIX_KEYS = 1024


def slot_run(slots: torch.Tensor) -> tuple[int, int] | None:
    """``(first, end)`` when the 1-D ``slots`` are the run ``first, first + 1, ..., end - 1``:
    their keys are then a slice of the pool, read in place instead of gathered (a long request
    alone usually holds one run); None otherwise."""
    n = int(slots.shape[0])
    if n == 0 or slots.device.type != "cpu":
        return None
    first = int(slots[0])
    if int(slots[-1]) - first != n - 1:
        return None
    if n > 1 and not bool(torch.all(slots[1:] - slots[:-1] == 1)):
        return None
    return first, first + n


@dataclass
class ExtendSegment:
    """One request with ``q_len >= 2`` new tokens (a prefill chunk) attending causally."""

    q_start: int  # first row of this request in the flat batch
    q_len: int  # new tokens this step
    kv_slots: torch.Tensor  # long [prefix_len + q_len]: slots of every token it attends to
    # [q_len, prefix_len + q_len] in the model's dtype, added to the scores: 0 where query i
    # sees key j (j <= prefix_len + i), -inf after. Made once per step for every layer (a bool
    # mask costs a conversion per call and makes SDPA ~1.4x slower here); None without a prefix
    # (plain causal attention).
    kv_bias: torch.Tensor | None = None
    kv_run: tuple[int, int] | None = None  # ``slot_run(kv_slots)``: the keys are a slice
    # a long prefix on a CPU (at least ``SPLIT_PREFIX_KEYS``): attended apart from the chunk's
    # own keys, without a mask, and the two parts merged (``model/attention.py``); no kv_bias
    split_prefix: bool = False
    # the native prefill attention (bf16 on a CPU with AVX-512 BF16): the causal offset is the
    # prefix length, no kv_bias and no split
    kernels: NativeKernels | None = None

    @property
    def prefix_len(self) -> int:
        return int(self.kv_slots.shape[0]) - self.q_len

    @classmethod
    def causal(
        cls,
        q_start: int,
        kv_slots: torch.Tensor,
        q_len: int,
        dtype: torch.dtype,
        kernels: NativeKernels | None = None,
    ) -> ExtendSegment:
        """The segment of ``q_len`` new tokens whose keys are ``kv_slots`` (the prefix first);
        ``kernels``: attended by the native prefill attention (no mask whatever the prefix)."""
        if kernels is not None:
            return cls(q_start, q_len, kv_slots, kv_run=slot_run(kv_slots), kernels=kernels)
        prefix_len = int(kv_slots.shape[0]) - q_len
        split = (
            prefix_len >= SPLIT_PREFIX_KEYS
            and kv_slots.device.type == "cpu"
            and FLASH_ATTENTION_CPU is not None
        )
        bias = None
        if prefix_len and not split:
            shape = (q_len, prefix_len + q_len)
            bias = torch.full(shape, float("-inf"), dtype=dtype, device=kv_slots.device)
            bias.triu_(prefix_len + 1)
        return cls(q_start, q_len, kv_slots, bias, slot_run(kv_slots), split)


@dataclass
class DecodeGroup:
    """Requests with exactly one new token, attended in one padded SDPA call. Their tokens are
    the ``n`` consecutive rows from ``row_start`` of the flat batch, so queries and outputs are
    slices, not gathers."""

    row_start: int  # first row of the group in the flat batch
    kv_slots: torch.Tensor  # long [n, max_kv_len], padded with each request's own first slot
    # [n, 1, 1, max_kv_len] in the model's dtype, added to the scores: 0 at real keys, -inf at
    # pads (made once per step; a bool mask is converted to this by every attention call);
    # None when the group has no pads
    kv_bias: torch.Tensor | None = None
    kv_run: tuple[int, int] | None = None  # one request whose keys are a slice (``slot_run``)

    @property
    def num_rows(self) -> int:
        return int(self.kv_slots.shape[0])


@dataclass
class DecodeRows:
    """Every decode request's keys one after the other, for the native kernel that attends to
    them in the pool in place (``NativeKernels.decode_attention``): no gather, no padding, one
    call per layer. The decode tokens are rows ``0 .. n - 1`` of the flat batch."""

    kernels: NativeKernels
    slots: torch.Tensor  # long [sum of the requests' KV lengths], request by request (CPU)
    offsets: torch.Tensor  # long [n + 1]: request i's keys are slots[offsets[i]:offsets[i + 1]]
    max_len: int  # the longest request's keys

    @property
    def num_rows(self) -> int:
        return int(self.offsets.shape[0]) - 1


@dataclass
class ForwardBatch:
    """Inputs of one forward step (all on the model's device)."""

    fill_ids: torch.Tensor  # long [T]; >= vocab_size at image tokens
    positions: torch.Tensor  # long [3, T] M-RoPE positions
    image_rows: torch.Tensor | None  # [num_image_tokens, hidden*(1+num_deepstack)], token order
    out_slots: torch.Tensor  # long [T]: where each new token's K/V is written
    extends: list[ExtendSegment]
    decode_groups: list[DecodeGroup]  # consecutive row ranges from row 0; empty: no decodes
    logit_rows: torch.Tensor  # long [S]: rows whose next-token logits are returned
    # the decode rows for the native kernel instead of ``decode_groups`` (then empty)
    decode_rows: DecodeRows | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.fill_ids.shape[0])

    @property
    def num_keys(self) -> int:
        """Cached keys the step's attention reads, the decode groups' padding included."""
        keys = sum(int(seg.kv_slots.shape[0]) for seg in self.extends)
        if self.decode_rows is not None:
            keys += int(self.decode_rows.slots.shape[0])
        return keys + sum(int(group.kv_slots.numel()) for group in self.decode_groups)
