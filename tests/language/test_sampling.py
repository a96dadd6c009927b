"""SamplingParams' bounds and the sampler's per-row isolation."""

from __future__ import annotations

import math

import pytest
import torch

from services.language.engine.sampling import (
    NonFiniteLogitsError,
    SamplerState,
    SamplingParams,
    draw,
    nucleus,
    row_max,
    sample,
    token_logprob,
    top_k_rows,
)


@pytest.mark.parametrize(
    ("kwargs", "field", "bound"),
    [
        (dict(temperature=math.nan), "temperature", "[0, 100]"),
        (dict(temperature=math.inf), "temperature", "[0, 100]"),
        (dict(temperature=-0.5), "temperature", "[0, 100]"),
        (dict(temperature=100.5), "temperature", "[0, 100]"),
        (dict(top_p=0.0), "top_p", "(0, 1]"),
        (dict(top_p=1.5), "top_p", "(0, 1]"),
        (dict(top_p=math.nan), "top_p", "(0, 1]"),
        (dict(top_k=-1), "top_k", ">= 0"),
        (dict(max_new_tokens=0), "max_new_tokens", ">= 1"),
        (dict(stop_token_ids=(3, -2)), "stop_token_ids", ">= 0"),
    ],
)
def test_out_of_range_values_are_refused_naming_field_and_bound(kwargs, field, bound):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    assert field in str(err.value) and bound in str(err.value)


def test_bounds_themselves_are_accepted():
    SamplingParams(temperature=0.0, top_p=1.0, top_k=0, max_new_tokens=1)
    SamplingParams(temperature=100.0, top_p=1e-6, top_k=5, max_new_tokens=None)


def test_tiny_temperature_is_clamped_not_overflowed():
    logits = torch.randn(1, 500, generator=torch.Generator().manual_seed(0)) * 30
    for temperature in (1e-45, 1e-30, 1e-5):
        state = SamplerState.create(SamplingParams(temperature=temperature, seed=1))
        [token] = sample(logits, [state])
        assert isinstance(token, int) and 0 <= token < 500
    # at 1e-2 a gap of >= 1 between the two best logits leaves the best one certain
    state = SamplerState.create(SamplingParams(temperature=1e-45, seed=2))
    peaked = torch.zeros(1, 500)
    peaked[0, 123] = 5.0
    assert sample(peaked, [state]) == [123]


def test_a_bad_row_fails_alone():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    logits[1, 7] = math.nan
    states = [SamplerState.create(SamplingParams()) for _ in range(3)]
    out = sample(logits, states)
    assert out[0] == int(logits[0].argmax()) and out[2] == int(logits[2].argmax())
    assert isinstance(out[1], NonFiniteLogitsError)


def test_inf_rows_fail_and_a_minus_inf_logit_is_only_improbable():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(3))
    logits[0, 3] = math.inf
    logits[1, :] = -math.inf
    logits[2, 9] = -math.inf  # a masked-out token: the row is still usable
    logits[3, 9] = -math.inf
    states = [SamplerState.create(SamplingParams()) for _ in range(3)]
    states.append(SamplerState.create(SamplingParams(temperature=0.8, seed=4)))
    out = sample(logits, states)
    assert isinstance(out[0], NonFiniteLogitsError) and isinstance(out[1], NonFiniteLogitsError)
    assert out[2] == int(logits[2].argmax())
    assert isinstance(out[3], int) and out[3] != 9


def test_greedy_rows_of_bf16_logits_match_their_float32_argmax():
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(5)).bfloat16()
    out = sample(logits, [SamplerState.create(SamplingParams()) for _ in range(3)])
    assert out == logits.float().argmax(dim=-1).tolist()


def test_a_raising_sampler_fails_its_row_alone():
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(2))
    good = SamplerState.create(SamplingParams(temperature=0.7, seed=5))
    bad = SamplerState.create(SamplingParams(temperature=0.7, seed=5))

    def broken(row):
        raise RuntimeError("sampler broke")

    bad.sample = broken
    out = sample(logits, [bad, good])
    assert isinstance(out[0], RuntimeError) and "sampler broke" in str(out[0])
    assert isinstance(out[1], int)


def test_token_logprob_is_the_model_distribution_with_its_top_tokens():
    row = torch.tensor([2.0, 0.5, 3.0, -1.0])
    got = token_logprob(row, 1, num_top=2)
    expected = torch.log_softmax(row, dim=-1)
    assert got.token_id == 1 and math.isclose(got.logprob, float(expected[1]), rel_tol=1e-6)
    assert [t.token_id for t in got.top] == [2, 0]  # most likely first
    assert all(math.isclose(t.logprob, float(expected[t.token_id]), rel_tol=1e-6) for t in got.top)
    assert token_logprob(row, 0, num_top=0).top == []


def test_top_logprobs_is_bounded():
    with pytest.raises(ValueError, match=r"top_logprobs must be in \[0, 20\], got 21"):
        SamplingParams(top_logprobs=21)
    assert SamplingParams(top_logprobs=3).wants_logprobs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [151936, 151669, 1024, 300, 100])
def test_row_max_equals_max_with_ties_and_non_finite_rows(dtype, vocab):
    torch.manual_seed(vocab)
    logits = torch.randn(7, vocab).to(dtype)
    logits[1, 3] = logits[1, vocab - 1] = 50.0  # a tie: the first index wins
    logits[2, vocab // 2] = float("nan")
    logits[3, 5] = float("inf")
    logits[4] = float("-inf")
    logits[5, 10:20] = 60.0  # a tie inside one block
    logits[6, vocab - 1] = 70.0  # the max in the last columns
    logits[0, vocab - 2] = float("nan")  # a NaN in the last columns only
    values, indices = row_max(logits)
    expected_values, expected_indices = logits.max(dim=-1)
    assert torch.equal(indices, expected_indices)
    assert torch.equal(values.isnan(), expected_values.isnan())
    finite = ~values.isnan()
    assert torch.equal(values[finite], expected_values[finite])
    assert indices[1] == 3 and indices[5] == 10


def test_draw_follows_the_distribution_and_never_takes_a_token_without_mass():
    probs = torch.softmax(torch.tensor([0.0, 1.0, 2.0, float("-inf"), 0.5, float("-inf")]), -1)
    gen = torch.Generator().manual_seed(0)
    draws = 40_000
    counts = torch.bincount(torch.tensor([draw(probs, gen) for _ in range(draws)]), minlength=6)
    assert counts[3] == 0 and counts[5] == 0
    expected = probs * draws
    chi2 = float((((counts - expected) ** 2)[expected > 0] / expected[expected > 0]).sum())
    assert chi2 < 20.5  # 3 degrees of freedom: p < 0.0002 by chance
    first = [draw(probs, torch.Generator().manual_seed(7)) for _ in range(3)]
    assert first == [first[0]] * 3  # the same seed, the same token


@pytest.mark.parametrize("scale", [0.5, 3.0, 10.0])
@pytest.mark.parametrize("top_p", [1e-6, 0.1, 0.5, 0.9, 0.99, 1.0])
def test_nucleus_keeps_what_sorting_the_whole_row_keeps(scale, top_p):
    """Flat rows (scale 0.5) need more than the first ``NUCLEUS_FIRST`` tokens: the whole row
    is sorted then; peaked ones are decided within them."""
    probs = torch.softmax(torch.randn(5000, generator=torch.Generator().manual_seed(9)) * scale, -1)
    ordered, order = probs.sort(descending=True)
    ordered[ordered.cumsum(0) - ordered > top_p] = 0.0
    assert torch.equal(nucleus(probs, top_p), torch.zeros_like(probs).scatter_(0, order, ordered))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [151_936, 151_669, 1_000])
@pytest.mark.parametrize("k", [1, 5, 20])
def test_top_k_rows_takes_the_values_topk_takes(dtype, vocab, k):
    """Blocks by their maxima, then topk inside them: the same values as ``torch.topk``, ties
    at the top and a maximum in the columns past the last whole block included."""
    x = (torch.randn(6, vocab, generator=torch.Generator().manual_seed(vocab + k)) * 3).to(dtype)
    x[1, 100:140] = 50.0  # forty tied maxima over two blocks
    x[2, -1] = 99.0  # the maximum in the last column
    values, indices = top_k_rows(x, k)
    assert torch.equal(values, torch.topk(x, k, dim=-1).values)
    assert torch.equal(x.gather(1, indices), values)
    assert all(len(set(row)) == k for row in indices.tolist())
