"""Decoder building blocks: RMSNorm, SwiGLU MLP and GQA self-attention over the KV pool."""

from __future__ import annotations

import torch
from torch import nn

from common.native_kernels import NativeKernels
from services.language.kvcache.pool import KVPool
from services.language.model.attention import paged_attention
from services.language.model.batch import ForwardBatch
from services.language.model.config import TextModelConfig
from services.language.model.rope import apply_rotary


class RMSNorm(nn.Module):
    """RMS normalisation computed in fp32, scaled by ``weight`` in the input dtype; in one pass
    on the ``native`` kernels where they are set (``QwenTextModel.use_cpu_kernels``)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.native: NativeKernels | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None and self.native.supports(x, self.weight):
            return self.native.rms_norm(x, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def split_rows(fused: nn.Linear, parts: dict[str, int]) -> dict[str, torch.Tensor]:
    """The separate projections ``fused`` stacks (``parts``: name -> output rows, in order) as
    views of its weight and bias rows, named as a checkpoint stores them
    (``{"q_proj.weight": ..., "q_proj.bias": ...}``): loading into the views fills ``fused``."""
    views, start = {}, 0
    for name, rows in parts.items():
        views[f"{name}.weight"] = fused.weight[start : start + rows]
        if fused.bias is not None:
            views[f"{name}.bias"] = fused.bias[start : start + rows]
        start += rows
    return views


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``; gate and up are one linear layer
    (``gate_up_proj``: the gate's rows, then the up's), one matrix product instead of two."""

    def __init__(self, config: TextModelConfig) -> None:
        super().__init__()
        hidden, self.intermediate_size = config.hidden_size, config.intermediate_size
        self.gate_up_proj = nn.Linear(hidden, 2 * self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)

    def checkpoint_views(self) -> tuple[str, dict[str, torch.Tensor]]:
        """The fused layer's name and the checkpoint's separate projections as its views."""
        size = self.intermediate_size
        return "gate_up_proj", split_rows(self.gate_up_proj, {"gate_proj": size, "up_proj": size})


class Attention(nn.Module):
    """GQA self-attention; Qwen3 normalises each q/k head before RoPE. The q, k and v
    projections are one linear layer (``qkv_proj``: q's rows, k's, v's)."""

    def __init__(self, config: TextModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(hidden, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        # the rotary embedding and KV write in one native pass where set
        # (``QwenTextModel.use_cpu_kernels``)
        self.native: NativeKernels | None = None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        kv_pool: KVPool,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        k_cache, v_cache = kv_pool.layer(self.layer_id)
        # the native pass assumes CPU tensors of one dtype (``supports``) and slots in range
        # (the engine's allocator gives them; the kernel does not check)
        if self.native is not None and self.native.supports(q, k, v, cos, sin, k_cache, v_cache):
            q = self.native.rope_store(q, k, v, cos, sin, k_cache, v_cache, batch.out_slots)
        else:
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            k_cache.index_copy_(0, batch.out_slots, k)
            v_cache.index_copy_(0, batch.out_slots, v)
        out = paged_attention(q, k_cache, v_cache, batch, self.scale)
        return self.o_proj(out.reshape(num_tokens, -1))

    def checkpoint_views(self) -> tuple[str, dict[str, torch.Tensor]]:
        """The fused layer's name and the checkpoint's separate projections as its views."""
        parts = {"q_proj": self.q_size, "k_proj": self.kv_size, "v_proj": self.kv_size}
        return "qkv_proj", split_rows(self.qkv_proj, parts)


class DecoderLayer(nn.Module):
    """Pre-norm block: ``h += attn(norm(h)); h += mlp(norm(h))``."""

    def __init__(self, config: TextModelConfig, layer_id: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_id)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, h, cos, sin, batch: ForwardBatch, kv_pool: KVPool) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, batch, kv_pool)
        return h + self.mlp(self.post_attention_layernorm(h))
