"""The decoder layers on the native bf16 kernels: each linear on ``linear_bf16`` (the LM head's
packed blocks), and a step's whole layer stack in one C call (``common/native_decoder.c``).

A small model's decode step on a CPU is dispatch more than arithmetic: the demo checkpoint's
four layers at 16 rows are ~4 MFLOP, and through torch a dozen operators each, ~3 ms of Python
and dispatch a step on a busy serving process (measured under the peer benchmark's load: 5.3 ms
of wall time, 2.8 of it on the engine thread's CPU, the rest waiting on the GIL). One call does
them with the interpreter released. The linears on the packed blocks run 1.2-2.6x oneDNN's
prepacked bf16 linear at decode sizes (1-16 rows, the demo's and Qwen2.5-VL-3B's widths, 2
cores) and 0.96-1.0x at prefill sizes, so they replace oneDNN outright: one packed copy of each
weight, shared by the one-call path and the module path (``NativeLinear``), which still runs a
step the call does not take (attention the native kernels do not cover: decode groups through
SDPA, a prefill chunk without the native kernel).

Where: bf16 on a CPU with AVX-512 BF16 (``NativeKernels.lm_head_fits``), a model without q/k
norms nor deepstack (Qwen2/2.5-VL's text model), its attention within the native prefill and
decode kernels' limits (``why_not_native``). Results are those of the module path up to the
order of the linears' sums (bit-equal to oneDNN's on the demo checkpoint here).
"""

from __future__ import annotations

import torch
from torch import nn

from common.native_kernels import DecoderLayerArgs, DecoderStepArgs, NativeKernels
from services.language.kvcache.pool import KVPool
from services.language.model.batch import ForwardBatch
from services.language.model.config import TextModelConfig


class NativeLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` packed once for ``linear_bf16`` (bf16)."""

    def __init__(self, linear: nn.Linear, native: NativeKernels) -> None:
        super().__init__()
        self.out_features, self.in_features = linear.weight.shape
        self.native = native
        packed = native.pack_lm_head(linear.weight.detach())
        self.register_buffer("packed_weight", packed, persistent=False)
        bias = None if linear.bias is None else linear.bias.detach().contiguous()
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.native.linear(x, self.packed_weight, self.out_features, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, native"


def why_not_native(
    native: NativeKernels | None, config: TextModelConfig, dtype: torch.dtype
) -> str:
    """Why the native decoder cannot run this model in ``dtype`` ("" where it can; see the
    module doc)."""
    if native is None:
        return "the native CPU kernels are off (cpu_kernels torch, or they do not build here)"
    heads, kv_heads, dim = config.num_heads, config.num_kv_heads, config.head_dim
    if not native.lm_head_fits(dtype, config.hidden_size):
        return f"it runs in bf16 on a CPU with AVX-512 BF16, not {dtype} here"
    if config.qk_norm or config.num_deepstack:
        return "it runs Qwen2-style layers: no q/k norms, no deepstack"
    if not all(width % 2 == 0 for width in (heads * dim, config.intermediate_size)):
        return "its linears take even input widths"
    if not (
        native.attention_fits(dtype, heads, kv_heads, dim)
        and native.decode_attention_fits(dtype, heads, kv_heads, dim)
    ):
        return f"{heads} heads over {kv_heads} KV heads of {dim} do not fit its attention"
    return ""


class NativeDecoder:
    """A model's decoder layers (their linears made ``NativeLinear`` here) run one step in one
    call, where the step's attention is all on the native kernels (``takes``)."""

    def __init__(self, layers: nn.ModuleList, config: TextModelConfig, native: NativeKernels):
        self.native = native
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.qkv_proj = NativeLinear(attn.qkv_proj, native)
            attn.o_proj = NativeLinear(attn.o_proj, native)
            mlp.gate_up_proj = NativeLinear(mlp.gate_up_proj, native)
            mlp.down_proj = NativeLinear(mlp.down_proj, native)
        self.args = (DecoderLayerArgs * len(layers))()
        for args, layer in zip(self.args, layers, strict=True):
            attn, mlp = layer.self_attn, layer.mlp
            bias = attn.qkv_proj.bias
            args.input_norm = layer.input_layernorm.weight.data_ptr()
            args.qkv = attn.qkv_proj.packed_weight.data_ptr()
            args.qkv_bias = None if bias is None else bias.data_ptr()
            args.o = attn.o_proj.packed_weight.data_ptr()
            args.post_norm = layer.post_attention_layernorm.weight.data_ptr()
            args.gate_up = mlp.gate_up_proj.packed_weight.data_ptr()
            args.down = mlp.down_proj.packed_weight.data_ptr()
        self.widths = dict(
            hidden=config.hidden_size,
            heads=config.num_heads,
            kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            intermediate=config.intermediate_size,
            eps=config.rms_norm_eps,
            scale=config.head_dim**-0.5,
        )

    @staticmethod
    def takes(batch: ForwardBatch) -> bool:
        """Whether the step's attention is all on the native kernels: decode rows in place (no
        SDPA decode groups), every prefill chunk on the native prefill attention."""
        return not batch.decode_groups and all(seg.kernels is not None for seg in batch.extends)

    def run(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        kv_pool: KVPool,
        threads: int,
    ) -> torch.Tensor:
        """Every layer over ``h`` ``[T, hidden]`` (in place; returned), K/V written into
        ``kv_pool``; ``cos`` / ``sin`` ``[T, 1, head_dim]``; on ``threads`` threads."""
        h = h.contiguous()
        cos, sin, out_slots = cos.contiguous(), sin.contiguous(), batch.out_slots.contiguous()
        for i, args in enumerate(self.args):
            k_cache, v_cache = kv_pool.layer(i)
            args.k_cache, args.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
        step = DecoderStepArgs(**self.widths, tokens=h.shape[0], threads=threads)
        step.cos, step.sin, step.out_slots = cos.data_ptr(), sin.data_ptr(), out_slots.data_ptr()
        rows = batch.decode_rows
        if rows is not None:
            step.num_decode, step.decode_max_len = rows.num_rows, rows.max_len
            step.decode_slots = rows.slots.data_ptr()
            step.decode_offsets = rows.offsets.data_ptr()
        if batch.extends:  # its tensors are locals: alive until the call returns
            segs = batch.extends
            starts = torch.tensor([s.q_start for s in segs], dtype=torch.long)
            lens = torch.tensor([s.q_len for s in segs], dtype=torch.long)
            kv_lens = torch.tensor([0] + [int(s.kv_slots.shape[0]) for s in segs])
            offsets = kv_lens.cumsum(0)
            slots = torch.cat([s.kv_slots for s in segs]) if len(segs) > 1 else segs[0].kv_slots
            slots = slots.contiguous()
            step.num_extends = len(segs)
            step.extend_q_start, step.extend_q_len = starts.data_ptr(), lens.data_ptr()
            step.extend_kv_offsets, step.extend_kv_slots = offsets.data_ptr(), slots.data_ptr()
        return self.native.decoder_layers(h, self.args, step)
