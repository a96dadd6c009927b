"""The Qwen-VL text decoder: embeddings + image rows, decoder layers, deepstack, LM head."""

from __future__ import annotations

import torch
from torch import nn

from common.linear_kernels import PackedLinear, use_linear_kernel
from services.language.kvcache.pool import KVPool
from services.language.model.batch import ForwardBatch
from services.language.model.config import TextModelConfig
from services.language.model.layers import DecoderLayer, RMSNorm
from services.language.model.rope import MRotaryEmbedding


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

    def use_linear_kernel(self, kernel: str) -> str:
        """Give every linear layer, the LM head included, the kernel ``kernel`` resolves to
        (see ``common/linear_kernels.py``); returns the one that runs."""
        weight = self.embed_tokens.weight
        chosen = use_linear_kernel(self, kernel, weight.device, weight.dtype, "language model")
        if chosen == "onednn" and self.lm_head is None:
            # NOTE: tied embeddings: the table stays for the lookups, the head gets a packed copy
            self.lm_head = PackedLinear(weight, None)
        return chosen
