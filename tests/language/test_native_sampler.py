"""The native sampler (``NativeKernels.sample_rows``, the sampled rows of a step drawn together):
each token is the inverse of the kept distribution's running sum at the row's uniform, the kept
tokens are what temperature, min-p, top-k and top-p keep, rows that cannot be sampled fail
alone, and a seed reproduces.

The reference is written here in float64 from the definitions (``sampling.py``'s torch path is
the other implementation of them); the cases are chosen with no value within a rounding of a
threshold, and uniforms within a rounding of a token's edge are skipped: the kernel's weights
are float32 (each within ~1e-7 of the reference's) summed in float32 blocks of 1,024 and then in
float64, so a mass is taken as known to ``SUM_EDGE`` of the row's total.
"""

from __future__ import annotations

import pytest
import torch

from common.native_kernels import load_native_kernels
from services.language.engine.sampling import (
    NonFiniteLogitsError,
    SamplerState,
    SamplingParams,
    sample,
)

KERNELS, WHY_NOT = load_native_kernels()
pytestmark = pytest.mark.skipif(KERNELS is None, reason=f"native kernels: {WHY_NOT}")
EDGE = 1e-5  # relative distance of a weight from the min_p threshold counted as ambiguous
SUM_EDGE = 1e-6  # distance, relative to the row's total, of a sum from a target: ambiguous


def kept_weights(
    row: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float
) -> torch.Tensor:
    """The row's unnormalised probabilities after min-p, top-k and top-p (float64), by
    sorting: the definitions the kernel implements without a sort."""
    z = row.float() / temperature
    w = torch.exp((z - z.max()).double())
    if min_p > 0:
        assert ((w / min_p - 1).abs() > EDGE).all(), "a weight on the min_p threshold"
        w[w < min_p] = 0
    if 0 < top_k < w.shape[0]:
        kth = w.sort(descending=True).values[top_k - 1]
        w[w < kth] = 0
    if top_p < 1:
        ordered = w.sort(descending=True).values
        cumulative = ordered.cumsum(0)
        target = top_p * cumulative[-1]
        at = int(torch.searchsorted(cumulative, target))  # first reaching the target
        margin = SUM_EDGE * cumulative[-1]
        assert abs(cumulative[at] - target) > margin, "top_p ends within a rounding"
        assert at == 0 or abs(cumulative[at - 1] - target) > margin
        w[w < ordered[at]] = 0
    return w


CASES = [  # temperature, top_k, top_p, min_p, logit scale
    (1.0, 0, 1.0, 0.0, 3.0),
    (0.7, 0, 0.9, 0.0, 3.0),
    (1.3, 20, 1.0, 0.0, 2.0),
    (1.0, 0, 1.0, 0.05, 2.0),
    (0.8, 40, 0.8, 0.01, 2.0),
    (1.0, 0, 0.5, 0.0, 0.05),  # flat: the nucleus is thousands of tokens
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [64, 151_936])
@pytest.mark.parametrize(("temperature", "top_k", "top_p", "min_p", "scale"), CASES)
def test_each_token_is_the_inverse_of_the_kept_distribution(
    dtype, vocab, temperature, top_k, top_p, min_p, scale
):
    gen = torch.Generator().manual_seed(vocab + int(100 * temperature) + top_k)
    row = (torch.randn(vocab, generator=gen) * scale).to(dtype)
    row[vocab // 3] = float("-inf")  # a token of probability 0
    kept = kept_weights(row, temperature, top_k, top_p, min_p)
    cumulative = kept.cumsum(0)
    total = float(cumulative[-1])
    uniform = torch.rand(200, generator=gen, dtype=torch.float64)
    clear = [
        i
        for i, u in enumerate(uniform.tolist())
        if (cumulative - u * total).abs().min() > SUM_EDGE * total
    ]
    assert len(clear) > 150
    rows = row[None].expand(len(clear), vocab)
    n = len(clear)
    tokens = KERNELS.sample_rows(
        rows, [temperature] * n, [top_k] * n, [top_p] * n, [min_p] * n, uniform[clear]
    )
    expected = torch.searchsorted(cumulative, uniform[clear] * total, right=True).tolist()
    assert tokens == expected
    assert all(kept[t] > 0 for t in tokens)


def test_draws_follow_the_distribution_and_never_take_a_token_without_mass():
    logits = torch.tensor([0.0, 1.0, 2.0, float("-inf"), 0.5, float("-inf")])
    draws = 40_000
    uniform = torch.rand(draws, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    ones = [1.0] * draws
    tokens = KERNELS.sample_rows(
        logits[None].expand(draws, 6), ones, [0] * draws, ones, [0.0] * draws, uniform
    )
    counts = torch.bincount(torch.tensor(tokens), minlength=6)
    assert counts[3] == 0 and counts[5] == 0
    expected = torch.softmax(logits, -1) * draws
    chi2 = float((((counts - expected) ** 2)[expected > 0] / expected[expected > 0]).sum())
    assert chi2 < 20.5  # 3 degrees of freedom: p < 0.0002 by chance


def test_rows_that_cannot_be_sampled_fail_alone():
    logits = torch.randn(5, 100, generator=torch.Generator().manual_seed(1))
    logits[1, 7] = float("nan")
    logits[2, 9] = float("inf")
    logits[3] = float("-inf")
    logits[4, 5] = 3e38  # finite, but past float32 once divided by the temperature
    states = [SamplerState.create(SamplingParams(temperature=0.5, seed=i)) for i in range(5)]
    out = sample(logits, states, kernels=KERNELS)
    assert isinstance(out[0], int) and 0 <= out[0] < 100
    assert all(isinstance(token, NonFiniteLogitsError) for token in out[1:])


def test_a_seed_reproduces_and_draws_what_the_torch_sampler_draws():
    """Both samplers take one uniform per token from the request's generator and invert the
    running sum in index order: the same seed gives the same tokens on either."""
    logits = torch.randn(1, 300, generator=torch.Generator().manual_seed(2)) * 2
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=11)
    native, again, in_torch = (SamplerState.create(params) for _ in range(3))
    drawn = [sample(logits, [native], kernels=KERNELS)[0] for _ in range(40)]
    assert drawn == [sample(logits, [again], kernels=KERNELS)[0] for _ in range(40)]
    assert drawn == [sample(logits, [in_torch])[0] for _ in range(40)]
    assert len(set(drawn)) > 5


class Even:
    """A constraint allowing even tokens only."""

    def allows(self, token: int) -> bool:
        return token % 2 == 0

    def allowed(self, vocab: int) -> torch.Tensor:
        return torch.arange(vocab) % 2 == 0

    def packed(self) -> bytes:
        raise NotImplementedError


def test_a_mixed_step_keeps_greedy_rows_and_constraints():
    logits = torch.randn(4, 200, generator=torch.Generator().manual_seed(3)).bfloat16()
    states = [
        SamplerState.create(SamplingParams(temperature=0.0)),
        SamplerState.create(SamplingParams(temperature=1.0, seed=1)),
        SamplerState.create(SamplingParams(temperature=1.0, seed=2)),
        SamplerState.create(SamplingParams(temperature=0.0)),
    ]
    greedy = logits.float().argmax(-1).tolist()
    for _ in range(20):
        out = sample(logits, states, [None, None, Even(), None], kernels=KERNELS)
        assert [out[0], out[3]] == [greedy[0], greedy[3]]
        assert isinstance(out[1], int) and out[2] % 2 == 0


def test_a_row_whose_draw_fails_fails_alone():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(4))
    states = [SamplerState.create(SamplingParams(temperature=0.7, seed=i)) for i in range(3)]

    def broken():
        raise RuntimeError("generator gone")

    states[1].uniform = broken
    out = sample(logits, states, kernels=KERNELS)
    assert isinstance(out[0], int) and isinstance(out[2], int)
    assert isinstance(out[1], RuntimeError) and str(out[1]) == "generator gone"
