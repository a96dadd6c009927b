"""Decode requests grouped by KV length (``services/language/engine/decode_groups.py``): where
the groups are cut, attention over several padded groups == unpadded SDPA per request, and the
engine's greedy tokens == transformers' when every distinct length is a group of its own. Also
the prefill chunk's attention after a long prefix (attended apart, ``model/attention.py``)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from common.native_kernels import load_native_kernels
from services.language.config import LanguageConfig
from services.language.engine import decode_groups
from services.language.engine.decode_groups import group_by_kv_len, pad_decode_group
from services.language.engine.model_runner import ModelRunner
from services.language.engine.sampling import SamplingParams
from services.language.model import batch as batch_module
from services.language.model.attention import paged_attention, prefill_attention_kernels
from services.language.model.batch import ExtendSegment, ForwardBatch, slot_run
from tests.language.conftest import make_image, run_to_completion, tokens_of

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 32
# bf16: inputs are the same bf16 values as the fp32 reference's; the difference is the kernel's
# bf16 arithmetic and the output's rounding (~2**-8 relative)
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def lens_of(groups: list[list[int]], kv_lens: list[int]) -> list[list[int]]:
    return [[kv_lens[i] for i in group] for group in groups]


@pytest.mark.parametrize(
    "kv_lens,expected",
    [
        ([100], [[100]]),
        ([7, 7, 7, 7], [[7, 7, 7, 7]]),
        ([120, 100, 110, 130], [[100, 110, 120, 130]]),  # similar: one group, sorted
        ([100] * 15 + [8192], [[100] * 15, [8192]]),
        ([8192] + [100] * 15, [[100] * 15, [8192]]),  # the order given does not matter
        ([8192, 8000, 4000, 3900, 128, 100], [[100, 128], [3900, 4000], [8000, 8192]]),
        ([100, 128, 3900, 4000, 8000, 8192], [[100, 128], [3900, 4000], [8000, 8192]]),
        ([10, 250], [[10, 250]]),  # padding within the slack: one call
        ([10, 300], [[10], [300]]),
        ([1000, 1200, 1600], [[1000, 1200], [1600]]),  # 2400 / 2200 joins, 4800 / 3800 cuts
    ],
)
def test_groups_are_cut_where_padding_would_exceed_factor_and_slack(kv_lens, expected):
    groups = group_by_kv_len(kv_lens)
    assert lens_of(groups, kv_lens) == expected
    assert sorted(i for group in groups for i in group) == list(range(len(kv_lens)))
    for group in groups:
        real = sum(kv_lens[i] for i in group)
        padded = len(group) * max(kv_lens[i] for i in group)
        assert padded <= decode_groups.MAX_PAD_FACTOR * real or (
            padded - real <= decode_groups.PAD_SLACK_KEYS
        )


def test_ties_keep_the_order_given():
    assert group_by_kv_len([5, 3, 5, 3]) == [[1, 3, 0, 2]]
    assert group_by_kv_len([]) == []


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One request's decode attention, unpadded, in fp32: q [heads, dim], k/v [len, kv, dim]."""
    rep = HEADS // KV_HEADS
    k = k.float().repeat_interleave(rep, dim=1).transpose(0, 1)  # [heads, len, dim]
    v = v.float().repeat_interleave(rep, dim=1).transpose(0, 1)
    return F.scaled_dot_product_attention(q.float()[:, None], k, v, scale=scale)[:, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_decode_attention_equals_unpadded_per_request(dtype):
    gen = torch.Generator().manual_seed(0)
    kv_lens = [40, 3000, 35, 2900, 1, 600, 40]
    num_slots = sum(kv_lens) + 100
    k_cache = torch.randn(num_slots, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    v_cache = torch.randn(num_slots, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    perm = torch.randperm(num_slots, generator=gen)  # scattered slots, as after eviction
    slots = list(torch.split(perm[: sum(kv_lens)], kv_lens))
    groups = group_by_kv_len(kv_lens)
    assert len(groups) == 3  # the test covers several groups
    order = [i for group in groups for i in group]
    built, row = [], 0
    for group in groups:
        built.append(pad_decode_group(row, [slots[i] for i in group], dtype, torch.device("cpu")))
        row += len(group)
    q = torch.randn(len(kv_lens), HEADS, HEAD_DIM, generator=gen).to(dtype)
    batch = ForwardBatch(
        fill_ids=torch.zeros(len(kv_lens), dtype=torch.long),
        positions=torch.zeros(3, len(kv_lens), dtype=torch.long),
        image_rows=None,
        out_slots=torch.cat([g.kv_slots[:, -1] for g in built]),
        extends=[],
        decode_groups=built,
        logit_rows=torch.arange(len(kv_lens)),
    )
    assert batch.num_keys == sum(g.kv_slots.numel() for g in built) < len(kv_lens) * max(kv_lens)
    # a group of one length has no pads and attends without a mask
    assert [g.kv_bias is None for g in built] == [
        len(set(kv_lens[i] for i in g)) == 1 for g in groups
    ]
    assert any(g.kv_bias is None for g in built) and any(g.kv_bias is not None for g in built)
    scale = HEAD_DIM**-0.5
    out = paged_attention(q, k_cache, v_cache, batch, scale)
    for row, i in enumerate(order):
        want = reference(q[row], k_cache[slots[i]], v_cache[slots[i]], scale)
        torch.testing.assert_close(out[row].float(), want, **TOL[dtype])


def test_slot_run():
    assert slot_run(torch.arange(5, 9)) == (5, 9)
    assert slot_run(torch.tensor([4])) == (4, 5)
    assert slot_run(torch.tensor([5, 6, 8])) is None
    assert slot_run(torch.tensor([5, 7, 6, 8])) is None  # the right ends, not a run
    assert slot_run(torch.tensor([8, 7, 6])) is None
    assert slot_run(torch.empty(0, dtype=torch.long)) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_keys_in_one_run_read_in_place_equal_the_gathered_ones(dtype):
    """A decode request and a prefill chunk whose slots are one run read a slice of the pool;
    the same keys at scattered slots are gathered: the outputs are the same, bit for bit."""
    gen = torch.Generator().manual_seed(1)
    length, num_slots, chunk = 700, 2000, 64
    k_cache = torch.randn(num_slots, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    v_cache = torch.randn(num_slots, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    run = torch.arange(100, 100 + length)
    scattered = torch.randperm(num_slots - 1000, generator=gen)[:length] + 1000
    k_cache[scattered], v_cache[scattered] = k_cache[run], v_cache[run]
    q = torch.randn(1 + chunk, HEADS, HEAD_DIM, generator=gen).to(dtype)
    outs = []
    for slots in (run, scattered):
        group = pad_decode_group(0, [slots], dtype, torch.device("cpu"))
        segment = ExtendSegment.causal(1, slots, chunk, dtype)
        assert (group.kv_run, segment.kv_run) == (
            ((100, 800),) * 2 if slots is run else (None,) * 2
        )
        batch = ForwardBatch(
            fill_ids=torch.zeros(1 + chunk, dtype=torch.long),
            positions=torch.zeros(3, 1 + chunk, dtype=torch.long),
            image_rows=None,
            out_slots=slots[-1:],
            extends=[segment],
            decode_groups=[group],
            logit_rows=torch.arange(1),
        )
        outs.append(paged_attention(q, k_cache, v_cache, batch, HEAD_DIM**-0.5))
    assert torch.equal(outs[0], outs[1])


def test_engine_with_a_group_per_length_matches_transformers(harness, monkeypatch):
    h = harness("qwen2_5_vl")
    cases = [
        h.case("just text here", [], 10),
        h.case("describe this picture in detail", [make_image(64, 48, 1)], 10),
        h.case("what differs?", [make_image(64, 48, 5), make_image(80, 80, 6)], 10),
        h.case("hello there, who are you?", [], 10),
    ]
    monkeypatch.setattr(decode_groups, "MAX_PAD_FACTOR", 1.0)
    monkeypatch.setattr(decode_groups, "PAD_SLACK_KEYS", 0)  # each distinct length: a group
    most_groups = 0
    build_batch = ModelRunner.build_batch

    def counting(self, groups, parts):
        nonlocal most_groups
        most_groups = max(most_groups, len(groups))
        return build_batch(self, groups, parts)

    monkeypatch.setattr(ModelRunner, "build_batch", counting)
    engine = h.engine(cuda_graphs=False)  # the grouped eager path on a GPU too
    for i, case in enumerate(cases):
        engine.add_request(f"g{i}", SamplingParams(max_new_tokens=10), case.inputs)
    outputs = run_to_completion(engine)
    assert most_groups == len(cases)
    for i, case in enumerate(cases):
        assert tokens_of(outputs[f"g{i}"]) == case.expected


def reference_chunk(q, k, v, prefix_len: int, scale: float) -> torch.Tensor:
    """A prefill chunk's causal attention, unpadded, in fp32: q [q_len, heads, dim], k/v
    [prefix_len + q_len, kv_heads, dim] -> [q_len, heads, dim]."""
    rep = HEADS // KV_HEADS
    k = k.float().repeat_interleave(rep, dim=1).transpose(0, 1)
    v = v.float().repeat_interleave(rep, dim=1).transpose(0, 1)
    q_len = q.shape[0]
    mask = torch.ones(q_len, k.shape[1], dtype=torch.bool).tril_(prefix_len)
    out = F.scaled_dot_product_attention(
        q.float().transpose(0, 1), k, v, attn_mask=mask, scale=scale
    )
    return out.transpose(0, 1)


def chunk_batch(segment: ExtendSegment, slots: torch.Tensor) -> ForwardBatch:
    """A step of the one prefill chunk ``segment`` whose keys are at ``slots``."""
    return ForwardBatch(
        fill_ids=torch.zeros(segment.q_len, dtype=torch.long),
        positions=torch.zeros(3, segment.q_len, dtype=torch.long),
        image_rows=None,
        out_slots=slots[-segment.q_len :],
        extends=[segment],
        decode_groups=[],
        logit_rows=torch.arange(1),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prefix_len", [0, 300, 1024, 2500])
def test_a_chunk_after_a_long_prefix_attends_to_it_apart(dtype, prefix_len):
    """From ``SPLIT_PREFIX_KEYS`` cached keys a chunk attends to its prefix and to its own keys
    in two calls merged by log-sum-exp (no mask); below, with the additive mask. Either way the
    result is causal attention over all its keys, for keys in one run and scattered."""
    gen = torch.Generator().manual_seed(2)
    chunk, num_slots = 96, 6000
    k_cache = torch.randn(num_slots, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    v_cache = torch.randn(num_slots, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    q = torch.randn(chunk, HEADS, HEAD_DIM, generator=gen).to(dtype)
    run = torch.arange(50, 50 + prefix_len + chunk)
    scattered = torch.randperm(num_slots, generator=gen)[: prefix_len + chunk]
    for slots in (run, scattered):
        segment = ExtendSegment.causal(0, slots, chunk, dtype)
        assert segment.split_prefix == (prefix_len >= batch_module.SPLIT_PREFIX_KEYS)
        assert (segment.kv_bias is None) == (prefix_len == 0 or segment.split_prefix)
        batch = chunk_batch(segment, slots)
        out = paged_attention(q, k_cache, v_cache, batch, HEAD_DIM**-0.5)
        want = reference_chunk(q, k_cache[slots], v_cache[slots], prefix_len, HEAD_DIM**-0.5)
        torch.testing.assert_close(out.float(), want, **TOL[dtype])


NATIVE, _ = load_native_kernels()


@pytest.mark.skipif(
    NATIVE is None or not NATIVE.has_avx512_bf16, reason="no native prefill attention here"
)
@pytest.mark.parametrize("prefix_len", [0, 300, 2500])
def test_a_chunk_on_the_native_prefill_attention_takes_its_prefix_as_the_offset(prefix_len):
    """With the native kernel a segment has no mask and no split at any prefix length, and
    ``paged_attention`` gives causal attention over all its keys, in one run and scattered."""
    gen = torch.Generator().manual_seed(3)
    chunk, num_slots, dtype = 96, 6000, torch.bfloat16
    k_cache = torch.randn(num_slots, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    v_cache = torch.randn(num_slots, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    q = torch.randn(chunk + 5, HEADS, HEAD_DIM, generator=gen).to(dtype)  # 5 decode rows first
    run = torch.arange(50, 50 + prefix_len + chunk)
    scattered = torch.randperm(num_slots, generator=gen)[: prefix_len + chunk]
    for slots in (run, scattered):
        segment = ExtendSegment.causal(5, slots, chunk, dtype, NATIVE)
        assert segment.kv_bias is None and not segment.split_prefix
        assert segment.kernels is NATIVE and segment.prefix_len == prefix_len
        batch = chunk_batch(segment, slots)
        out = paged_attention(q, k_cache, v_cache, batch, HEAD_DIM**-0.5)
        want = reference_chunk(q[5:], k_cache[slots], v_cache[slots], prefix_len, HEAD_DIM**-0.5)
        torch.testing.assert_close(out[5:].float(), want, **TOL[dtype])


def test_engine_splits_long_prefixes_and_matches_transformers(harness, monkeypatch):
    """A long prompt in small chunks: the chunks after ``SPLIT_PREFIX_KEYS`` tokens attend to
    their prefix apart, and the greedy tokens are transformers'."""
    h = harness("qwen2_5_vl")
    case = h.case("count the words of this sentence " * 70, [], 8)
    assert len(case.inputs) > batch_module.SPLIT_PREFIX_KEYS + 200
    splits = []
    causal = ExtendSegment.causal.__func__

    def counting(cls, q_start, kv_slots, q_len, dtype, kernels=None):
        segment = causal(cls, q_start, kv_slots, q_len, dtype, kernels)
        splits.append(segment.split_prefix)
        return segment

    monkeypatch.setattr(ExtendSegment, "causal", classmethod(counting))
    engine = h.engine(chunk_size=128)
    engine.add_request("long", SamplingParams(max_new_tokens=8), case.inputs)
    assert tokens_of(run_to_completion(engine)["long"]) == case.expected
    assert any(splits) and not all(splits)


def test_the_prefill_attention_setting_picks_the_kernel_and_native_says_why_not(caplog):
    """``auto`` takes the native kernel only where it runs and logs why not elsewhere;
    ``native`` there raises naming the reason; ``sdpa`` never takes it; a bad value is refused."""
    shape = SimpleNamespace(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM)
    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    runs = NATIVE is not None and NATIVE.has_avx512_bf16
    assert prefill_attention_kernels("auto", NATIVE, cpu, bf16, shape) is (NATIVE if runs else None)
    assert prefill_attention_kernels("sdpa", NATIVE, cpu, bf16, shape) is None
    with caplog.at_level(logging.INFO, logger="services.language.model.attention"):
        assert prefill_attention_kernels("auto", NATIVE, cpu, torch.float32, shape) is None
        assert prefill_attention_kernels("auto", None, cpu, bf16, shape) is None
    assert "prefill attention: SDPA (no native CPU kernels)" in caplog.text
    with pytest.raises(RuntimeError, match="prefill_attention native: on cuda"):
        prefill_attention_kernels("native", NATIVE, torch.device("cuda"), bf16, shape)
    with pytest.raises(RuntimeError, match="prefill_attention native: no native CPU kernels"):
        prefill_attention_kernels("native", None, cpu, bf16, shape)
    if NATIVE is not None:
        with pytest.raises(RuntimeError, match="prefill_attention native: .*torch.float32"):
            prefill_attention_kernels("native", NATIVE, cpu, torch.float32, shape)
    with pytest.raises(ValueError, match="prefill_attention must be one of"):
        LanguageConfig(prefill_attention="flash")
