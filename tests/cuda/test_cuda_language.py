"""The language engine on a CUDA device, against transformers on the same device (skipped
without CUDA; CI has none). On a GPU machine, ``pytest tests/cuda tests/language`` runs these
and every language-engine test on CUDA as well: the engines there pick their device with
``auto``.

* fp32: greedy tokens equal transformers' ``generate`` on the GPU, for text, images, prompts cut
  into chunks, and concurrent requests of different lengths decoded together, with decode steps
  through captured CUDA graphs (the default) and without;
* bf16 against transformers in bf16: the first steps' greedy tokens equal, the first step's
  log-probabilities within ``BF16_CUDA_LOGPROB_TOL``;
* decode steps through the graphs against eager ones: the same tokens and log-probabilities.
"""

from __future__ import annotations

import pytest
import torch

from bench.local_encode import local_encode
from services.language.config import LanguageConfig
from services.language.engine.engine import LanguageEngine
from services.language.engine.sampling import SamplingParams
from services.language.inputs import PromptInputs
from tests.cuda.conftest import CUDA, requires_cuda
from tests.language.conftest import generate, make_image, run_to_completion, tokens_of
from tests.language.test_bf16 import check_against_reference

pytestmark = requires_cuda

# bf16 log-probabilities on the GPU: the CPU tests' 0.02 is too tight here, where the two sides
# run different kernels (flash / memory-efficient attention, split-K GEMMs). Measured on an H100:
# 0.025-0.035 for a prompt computed whole (bf16's unit roundoff 2^-8 on logits of magnitude
# ~8); 0.066 when its first tokens' K/V come from the radix cache, computed in another request's
# prefill (cuBLAS rounds a GEMM of another row count differently), eager and graph steps alike
BF16_CUDA_LOGPROB_TOL = 0.08


def engine(path, dtype: str, **overrides) -> LanguageEngine:
    config = dict(model_path=str(path), device=CUDA, dtype=dtype, num_kv_slots=8192, chunk_size=512)
    return LanguageEngine(LanguageConfig(**{**config, **overrides}))


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_fp32_engine_on_cuda_equals_transformers_on_cuda(arch, refs, tiny_model_dir, graphs):
    ref = refs["float32"]
    prompts = [
        ("hello there, who are you?", []),
        ("describe this picture in detail", [make_image(64, 48, 1)]),
        ("what differs?", [make_image(64, 48, 5), make_image(100, 60, 6)]),
        ("just text here, a little longer than the first one", []),
    ]
    cases = []
    for prompt, images in prompts:
        ref_inputs = ref.build_inputs(prompt, images)
        cases.append((local_encode(ref, ref_inputs), ref.generate(ref_inputs, 10)))
    eng = engine(tiny_model_dir(arch), "float32", cuda_graphs=graphs)
    assert eng.device.type == "cuda" and eng.dtype == torch.float32
    assert (eng.runner.decode_graphs is not None) == graphs
    for inputs, expected in cases:  # one at a time
        assert generate(eng, inputs, 10)[0] == expected
    assert not graphs or eng.runner.decode_graphs.num_steps >= 4 * 8
    # chunks cut the images
    eng = engine(tiny_model_dir(arch), "float32", chunk_size=7, cuda_graphs=graphs)
    for i, (inputs, _) in enumerate(cases):  # all at once: prefill chunks beside decode steps
        eng.add_request(f"m{i}", SamplingParams(max_new_tokens=10), inputs)
    outputs = run_to_completion(eng)
    for i, (_, expected) in enumerate(cases):
        assert tokens_of(outputs[f"m{i}"]) == expected
    again, out = generate(eng, cases[1][0], 10)  # the radix cache's prefix, on the GPU
    assert again == cases[1][1] and out.num_cached_tokens > 0
    eng.cache_manager.cache.check_integrity()


def test_bf16_engine_on_cuda_matches_bf16_transformers_on_cuda(arch, refs, tiny_model_dir):
    eng = engine(tiny_model_dir(arch), "bfloat16")
    assert eng.device.type == "cuda" and eng.dtype == torch.bfloat16
    check_against_reference(eng, refs["bfloat16"], BF16_CUDA_LOGPROB_TOL)
    assert eng.runner.decode_graphs.num_steps > 0  # its decode steps ran through graphs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_steps_equal_eager_steps(tiny_model_dir, dtype):
    """Three requests of different lengths decoding together (a batch of four: a pad row; pad
    keys), the longest crossing the 256-key bucket, with top log-probabilities: through the
    captured graphs and eagerly (grouped, unpadded), the same tokens and log-probabilities
    within rounding (the padded keys change the kernels' reduction order)."""
    prompts = [[11 + i for i in range(n)] for n in (20, 70, 250)]
    runs = {}
    for graphs in (True, False):
        eng = engine(tiny_model_dir("qwen2_5_vl"), dtype, cuda_graphs=graphs)
        for i, ids in enumerate(prompts):
            inputs = PromptInputs.from_text_ids(ids, eng.model_config.hidden_size)
            params = SamplingParams(max_new_tokens=12, ignore_eos=True, top_logprobs=3)
            eng.add_request(f"q{i}", params, inputs)
        runs[graphs] = run_to_completion(eng)
        if graphs:
            assert eng.runner.decode_graphs.num_graphs >= 2  # (4, 256) and (4, 512)
            assert eng.runner.decode_graphs.num_steps >= 10
    tol = 1e-4 if dtype == "float32" else BF16_CUDA_LOGPROB_TOL
    for rid, outs in runs[False].items():
        assert tokens_of(runs[True][rid]) == tokens_of(outs)
        got = [lp.logprob for out in runs[True][rid] for lp in out.logprobs]
        want = [lp.logprob for out in outs for lp in out.logprobs]
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= tol
