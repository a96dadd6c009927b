"""Decoder layers of a small step on one thread (``QwenTextModel.layer_threads``): the choice,
and the same tokens as with every layer on all threads, in fp32 (plain linears) and bf16
(prepacked ones where oneDNN runs bf16). Log-probabilities agree within ``LOGPROB_TOL``: torch's
CPU attention kernel may round the last bits differently on another number of threads."""

from __future__ import annotations

import pytest
import torch

from common.compute import intra_op_threads
from common.linear_kernels import onednn_usable
from services.language.engine.sampling import SamplingParams
from services.language.model import qwen
from tests.language.conftest import run_to_completion

ONEDNN, WHY_NOT = onednn_usable(torch.device("cpu"), torch.bfloat16)
SETTINGS = [
    ("float32", "plain"),
    pytest.param("bfloat16", "onednn", marks=pytest.mark.skipif(not ONEDNN, reason=WHY_NOT)),
]
LOGPROB_TOL = {"float32": 1e-5, "bfloat16": 0.02}  # bf16: the bound of test_bf16
PROMPTS = ("hello there, who are you?", "count: one two three", "a b c d e f g")


@pytest.fixture(scope="module")
def qwen25(harness):
    return harness("qwen2_5_vl")


def test_intra_op_threads_restores_the_setting():
    before = torch.get_num_threads()
    with intra_op_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before


def test_small_steps_run_their_layers_on_one_thread(qwen25):
    model = qwen25.engine(device="cpu").runner.model
    with intra_op_threads(2):
        assert model.layer_threads(16, 16 * 100) == 1  # a decode batch of the test model
        assert model.layer_threads(100_000, 100_000) == 2  # a long prefill: every thread
        assert model.layer_threads(1, 9000) == 2  # one decode over a long context
    with intra_op_threads(1):
        assert model.layer_threads(16, 16 * 100) == 1


@pytest.mark.parametrize("dtype,kernel", SETTINGS)
def test_one_thread_layers_give_the_same_answers(qwen25, monkeypatch, dtype, kernel):
    prompts = [qwen25.case(prompt, [], max_new_tokens=1).inputs for prompt in PROMPTS]

    def answers(engine):
        params = SamplingParams(max_new_tokens=10, top_logprobs=3)
        for i, inputs in enumerate(prompts):  # decoded together: a batch of three
            engine.add_request(f"r{i}", params, inputs)
        with intra_op_threads(2):
            outs = run_to_completion(engine)
        return {rid: [lp for o in got for lp in o.logprobs] for rid, got in sorted(outs.items())}

    engine = qwen25.engine(device="cpu", dtype=dtype, linear_kernel=kernel)
    assert engine.runner.model.layer_threads(len(PROMPTS), 100) == 1
    split = answers(engine)
    monkeypatch.setattr(qwen, "SINGLE_THREAD_LAYER_FLOPS", 0)  # every layer on all threads
    engine = qwen25.engine(device="cpu", dtype=dtype, linear_kernel=kernel)
    assert engine.runner.model.layer_threads(len(PROMPTS), 100) == torch.get_num_threads()
    every = answers(engine)
    assert [[t.token_id for t in a] for a in every.values()] == [
        [t.token_id for t in a] for a in split.values()
    ]
    worst = max(
        abs(x.logprob - y.logprob)
        for a, b in zip(every.values(), split.values(), strict=True)
        for x, y in zip(a, b, strict=True)
    )
    assert worst <= LOGPROB_TOL[dtype]
