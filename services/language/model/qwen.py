"""The Qwen-VL text decoder: embeddings + image rows, decoder layers, deepstack, LM head.

Threads: on a CPU, a step whose decoder-layer work is small (a decode batch of a small model:
a few MFLOP per layer, weights that sit in cache) runs its decoder layers on one intra-op thread
and only the LM head on all of them. Each operator run on several OpenMP threads wakes the
sleeping ones (the serving processes set ``OMP_WAIT_POLICY=PASSIVE``), which costs more than
such an operator's work: a [16, 256] x [256, 512] bf16 linear takes 50 us on one thread and
150 us on two. Greedy tokens are the same either way (tested); torch's CPU attention kernel
may round a log-probability's last bits differently on another number of threads. The native
decoder (``model/native_decoder.py``) makes the same choice per kernel inside its one call: each
linear and the decode attention by its own work.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn

from common.compute import intra_op_threads
from common.linear_kernels import PackedLinear, use_linear_kernel
from common.native_kernels import NativeKernels, resolve_cpu_kernels
from services.language.kvcache.pool import KVPool
from services.language.model.batch import ForwardBatch
from services.language.model.config import TextModelConfig
from services.language.model.layers import Attention, DecoderLayer, RMSNorm
from services.language.model.lm_head import NativeLMHead
from services.language.model.native_decoder import NativeDecoder, why_not_native
from services.language.model.rope import MRotaryEmbedding

logger = logging.getLogger(__name__)

# Below all three, a step's decoder layers run on one thread (see the module doc; measured with
# passive OpenMP threads on 2 cores: one thread wins up to ~150 MFLOP per layer, two from ~300;
# a decode step attending to 8,700 cached keys took 21 ms on one thread against 16 on two).
SINGLE_THREAD_LAYER_FLOPS = 200e6
SINGLE_THREAD_LAYER_BYTES = 8 << 20
SINGLE_THREAD_KEYS = 4096  # cached keys the step's attention reads, padding included


class QwenTextModel(nn.Module):
    """Parameter names follow the checkpoint's text weights with the model prefix stripped."""

    def __init__(self, config: TextModelConfig, rope: MRotaryEmbedding) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rope = rope
        self.decoder: NativeDecoder | None = None  # the layers on the native kernels, when set

    def layer_threads(self, num_rows: int, num_keys: int) -> int:
        """Intra-op threads for the decoder layers of a step of ``num_rows`` rows whose
        attention reads ``num_keys`` cached keys: one when its work per layer is small (see the
        module doc), else this thread's setting."""
        threads = torch.get_num_threads()
        if threads == 1 or self.embed_tokens.weight.device.type != "cpu":
            return threads
        params, nbytes = self._layer_size
        small = 2 * num_rows * params < SINGLE_THREAD_LAYER_FLOPS and num_keys < SINGLE_THREAD_KEYS
        return 1 if small and nbytes < SINGLE_THREAD_LAYER_BYTES else threads

    @functools.cached_property
    def _layer_size(self) -> tuple[int, int]:
        """(weights, bytes) of one decoder layer, as the step runs it (after packing)."""
        tensors = [*self.layers[0].parameters(), *self.layers[0].buffers()]  # packed: buffers
        return sum(t.numel() for t in tensors), sum(t.numel() * t.element_size() for t in tensors)

    def embed(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Text rows from the embedding table; image rows scattered at image tokens.

        Returns the hidden states and the image-token mask (None when the batch has none).
        """
        vocab, hidden = self.config.vocab_size, self.config.hidden_size
        image_mask = batch.fill_ids >= vocab
        h = self.embed_tokens(batch.fill_ids.masked_fill(image_mask, 0))
        if batch.image_rows is None or batch.image_rows.shape[0] == 0:
            return h, None
        h[image_mask] = batch.image_rows[:, :hidden].to(h.dtype)
        return h, image_mask

    def forward(self, batch: ForwardBatch, kv_pool: KVPool) -> torch.Tensor:
        """Logits [len(batch.logit_rows), vocab] of the requested rows."""
        return self.head(self.hidden_states(batch, kv_pool)[batch.logit_rows])

    def hidden_states(self, batch: ForwardBatch, kv_pool: KVPool) -> torch.Tensor:
        """The last decoder layer's output [T, hidden] of every row (before the final norm)."""
        hidden = self.config.hidden_size
        if self.decoder is not None and self.decoder.takes(batch):
            # one call; it picks each kernel's threads itself (``native_decoder.c``)
            h, _ = self.embed(batch)
            cos, sin = self.rope.cos_sin(batch.positions, h.dtype)
            return self.decoder.run(h, cos, sin, batch, kv_pool, torch.get_num_threads())
        with intra_op_threads(self.layer_threads(batch.num_tokens, batch.num_keys)):
            h, image_mask = self.embed(batch)
            cos, sin = self.rope.cos_sin(batch.positions, h.dtype)
            for i, layer in enumerate(self.layers):
                h = layer(h, cos, sin, batch, kv_pool)
                if image_mask is not None and i < self.config.num_deepstack:
                    # NOTE: deepstack row i is added after decoder layer i, as in transformers.
                    extra = batch.image_rows[:, (i + 1) * hidden : (i + 2) * hidden]
                    h[image_mask] = h[image_mask] + extra.to(h.dtype)
        return h

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Logits [n, vocab] of hidden states ``h`` [n, hidden]: the final norm, the LM head."""
        h = self.norm(h)
        if self.lm_head is None:  # tied: the embedding table is the output matrix
            return nn.functional.linear(h, self.embed_tokens.weight)
        return self.lm_head(h)

    @property
    def has_head_maxima(self) -> bool:
        """Whether ``maxima`` runs (the LM head on the native kernel)."""
        return isinstance(self.lm_head, NativeLMHead)

    def maxima(self, batch: ForwardBatch, kv_pool: KVPool) -> tuple[torch.Tensor, torch.Tensor]:
        """Each requested row's largest logit (float32; NaN where a logit is NaN or +inf) and
        the first token holding it, the logits never made whole. Only where
        ``has_head_maxima``."""
        h = self.norm(self.hidden_states(batch, kv_pool)[batch.logit_rows])
        return self.lm_head.maxima(h)

    def checkpoint_targets(self) -> dict[str, torch.Tensor]:
        """Where each of the checkpoint's text tensors goes, by its name there (model prefix
        stripped): the parameters, and for the projections the checkpoint stores apart
        (q / k / v, gate / up) views of the fused layer that holds them."""
        targets = dict(self.named_parameters())
        for i, layer in enumerate(self.layers):
            for name, module in (("self_attn", layer.self_attn), ("mlp", layer.mlp)):
                fused, views = module.checkpoint_views()
                prefix = f"layers.{i}.{name}."
                del targets[f"{prefix}{fused}.weight"]
                # Qwen2(.5)-VL's q/k/v have biases, Qwen3-VL's none
                targets.pop(f"{prefix}{fused}.bias", None)
                targets.update((prefix + key, view) for key, view in views.items())
        return targets

    def use_linear_kernel(self, kernel: str, native: NativeKernels | None) -> str:
        """Give every linear layer, the LM head included unless it is on the native kernel
        (``use_cpu_kernels``, called first; ``native``: the kernels it returned), the kernel
        ``kernel`` resolves to; returns the one that runs. ``native`` (``auto``'s first choice):
        the decoder layers on the native kernels (``model/native_decoder.py``), a
        ``ValueError`` saying why where they cannot run; else see
        ``common/linear_kernels.py``."""
        weight = self.embed_tokens.weight
        if kernel in ("auto", "native"):
            why = why_not_native(native, self.config, weight.dtype)
            if not why:
                self.decoder = NativeDecoder(self.layers, self.config, native)
                logger.info(
                    "language model: decoder layers on the native kernels (bf16, AVX-512 "
                    "BF16): %d layers' linears packed for them, a step's layers in one call",
                    len(self.layers),
                )
                return "native"
            if kernel == "native":
                raise ValueError(f"linear_kernel native cannot run here: {why}")
        chosen = use_linear_kernel(self, kernel, weight.device, weight.dtype, "language model")
        if chosen == "onednn" and self.lm_head is None:
            # NOTE: tied embeddings: the table stays for the lookups, the head gets a packed copy
            self.lm_head = PackedLinear(weight, None)
        return chosen

    def use_cpu_kernels(self, kernel: str) -> NativeKernels | None:
        """Give every RMSNorm and attention layer (rotary embedding and KV write) the native
        kernels when ``kernel`` resolves to them (see ``common/native_kernels.py``) and return
        them (None: torch's ops); the runner takes their decode attention where it is the
        faster path. The LM head goes on the native head kernel where it runs (bf16 on a CPU
        with AVX-512 BF16; a tied table stays for the lookups, the head gets a packed copy).
        Call before ``use_linear_kernel``: an untied head's weight is then still whole."""
        weight = self.embed_tokens.weight
        native = resolve_cpu_kernels(kernel, weight.device, weight.dtype, "language model")
        for module in self.modules():
            if isinstance(module, (RMSNorm, Attention)):
                module.native = native
        if native is not None and native.lm_head_fits(weight.dtype, self.config.hidden_size):
            head = weight if self.lm_head is None else self.lm_head.weight
            self.lm_head = NativeLMHead(head, native)
            logger.info("language model: LM head on the native kernel (bf16, AVX-512 BF16)")
        return native
