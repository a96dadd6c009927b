"""Sampling parameters and the sampler (greedy, temperature, top-k, top-p, per-request seed)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # 1 = off
    top_k: int = 0  # 0 or -1 = off
    seed: int | None = None  # reproducible sampling when set
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings, cut from the output
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError("temperature must be >= 0 and top_p in (0, 1]")


@dataclass
class SamplerState:
    """Per-request random state: seeded requests draw from their own generator."""

    params: SamplingParams
    generator: torch.Generator | None = field(default=None)

    @classmethod
    def create(cls, params: SamplingParams) -> SamplerState:
        gen = None
        if params.seed is not None and params.temperature > 0:
            gen = torch.Generator().manual_seed(int(params.seed) & (2**63 - 1))
        return cls(params, gen)


def sample(logits: torch.Tensor, states: list[SamplerState]) -> list[int]:
    """One token per row of ``logits`` [S, vocab]."""
    logits = logits.float()
    greedy = logits.argmax(dim=-1).tolist()
    out = []
    for row, state, best in zip(logits, states, greedy, strict=True):
        p = state.params
        if p.temperature == 0:
            out.append(int(best))
            continue
        row = row.cpu() / p.temperature
        if 0 < p.top_k < row.shape[0]:
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            cumulative = sorted_probs.cumsum(0)
            drop = cumulative - sorted_probs > p.top_p  # keep the smallest set reaching top_p
            sorted_probs[drop] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        out.append(int(torch.multinomial(probs, 1, generator=state.generator)))
    return out
