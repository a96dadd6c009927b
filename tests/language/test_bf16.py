"""bf16 serving against transformers run in bf16, and the prepacked linear kernel against the
plain one.

A bf16 engine and transformers in bf16 round differently in places (fused ops, accumulation
order), so only the first steps' greedy tokens are required equal, and the first step's
log-probabilities within ``BF16_LOGPROB_TOL`` of the reference's (the same bound the e2e bf16
test uses). Where the reference's best two tokens of a step are within that bound of each other
(a near tie: random weights make them common), either is the right answer, and after a step
that took the other one the continuations are no longer comparable.

On a CPU with native bf16 the ``onednn`` kernel computes exactly what ``plain`` does, so
engines on the two kernels must agree token for token and in every log-probability. Where bf16
is emulated (no ``avx512_bf16`` or AMX: a Cascade Lake, say) oneDNN's prepacked and plain paths
accumulate in different orders, and the prepacked engine is held to the reference's bounds
like the others. The native RMSNorm (``auto``'s choice
on a CPU where it builds) sums a row in another order: it is held to the reference's bounds.

The native prefill attention (``auto``'s choice in bf16 on a CPU with AVX-512 BF16) is as
accurate as SDPA but rounds elsewhere (its own key blocks, exponential and sums), so an engine
on it is not the reference's arithmetic: it is held to ``BF16_KERNEL_LOGPROB_TOL``, and the
kernel itself to SDPA's error against float32 in ``tests/common/test_native_kernels.py``.

The native LM head (with the native CPU kernels, in bf16 on a CPU with AVX-512 BF16) sums in
another order than a bf16 ``linear``: its engines are held to the reference's bounds, and a step
whose rows are all greedy takes each row's maximum from the head itself, the same tokens as the
maximum of its logits.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from bench.local_encode import local_encode
from common.compute import cpu_native_bf16
from common.linear_kernels import onednn_usable
from common.models.hf_reference import HFReference
from common.native_kernels import load_native_kernels
from services.language.engine.sampling import SamplingParams
from services.language.model.layers import Attention
from tests.conftest import ARCHS
from tests.language.conftest import generate, make_image, run_to_completion

BF16_LOGPROB_TOL = 0.02
# an engine whose prefill attention is the native kernel against transformers' SDPA, both bf16.
# Measured on the test checkpoints (text, one image): 0.015-0.033 apart, where transformers in
# bf16 is itself 0.03-0.07 from its float32 run and the kernel engine 0.01-0.10 (the same
# spread: neither is the closer one throughout)
BF16_KERNEL_LOGPROB_TOL = 0.05
NUM_EQUAL_STEPS = 4  # greedy tokens required equal to the bf16 reference
TOP = 5
ONEDNN, WHY_NOT = onednn_usable(torch.device("cpu"), torch.bfloat16)
NATIVE, WHY_NO_NATIVE = load_native_kernels()
NATIVE_BF16, WHY_EMULATED = cpu_native_bf16()
PREFILL_KERNEL = NATIVE is not None and NATIVE.has_avx512_bf16
LM_HEAD_KERNEL = NATIVE is not None and NATIVE.has_avx512_bf16
# (linear kernel, CPU kernels, prefill attention) of the engines compared with the reference
ENGINES = [("plain", "torch", "sdpa")]
ENGINES += [("onednn", "torch", "sdpa")] if ONEDNN else []
ENGINES += [("onednn" if ONEDNN else "plain", "native", "sdpa")] if NATIVE is not None else []
ENGINES += [("onednn" if ONEDNN else "plain", "native", "native")] if PREFILL_KERNEL else []
NATIVE_DECODER = ("native", "native", "native")  # the decoder layers on the native kernels
ENGINES += [NATIVE_DECODER] if LM_HEAD_KERNEL else []


@pytest.fixture(scope="module", params=ARCHS)
def arch(request):
    return request.param


@pytest.fixture(scope="module")
def ref(arch, tiny_model_dir):
    return HFReference(tiny_model_dir(arch), dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def engines(arch, harness):
    h = harness(arch)
    # on the CPU, as the reference: the CUDA engine is checked against transformers on CUDA
    # (tests/cuda)
    built = {}
    for linear, cpu, attention in ENGINES:
        try:
            built[linear, cpu, attention] = h.engine(
                device="cpu",
                dtype="bfloat16",
                linear_kernel=linear,
                cpu_kernels=cpu,
                prefill_attention=attention,
            )
        except ValueError as exc:  # the native decoder takes Qwen2-style layers only
            assert linear == "native" and arch == "qwen3_vl", exc
    return built


def cases(ref):
    """(reference inputs, engine inputs) for a text prompt and a one-image prompt."""
    out = []
    for prompt, images in (
        ("hello there, who are you?", []),
        ("describe it", [make_image(64, 48, 1)]),
    ):
        ref_inputs = ref.build_inputs(prompt, images)
        out.append((ref_inputs, local_encode(ref, ref_inputs)))
    return out


def check_greedy_tokens(
    got: list[int], expected: list[int], logprobs: list[torch.Tensor], tolerance: float
) -> None:
    """``got`` follows the reference's greedy ``expected`` (with each step's ``logprobs``) up
    to its length; at a near tie (the reference's best two within ``tolerance``) any token
    within ``tolerance`` of the best is right, and the comparison ends where such a step took
    another token than the reference's."""
    assert len(got) == len(expected), (got, expected)
    for step, (token, want, lp) in enumerate(zip(got, expected, logprobs, strict=True)):
        if token == want:
            continue
        best = float(lp[want])
        assert best - float(lp[token]) <= tolerance, (
            f"step {step}: {token} ({float(lp[token]):.4f}) instead of {want} ({best:.4f}); "
            f"tokens {got} against {expected}"
        )
        return


def check_against_reference(engine, ref, tolerance: float) -> None:
    """For a text and a one-image prompt: the engine's first ``NUM_EQUAL_STEPS`` greedy tokens
    are the reference's (``check_greedy_tokens``), and its first step's top log-probabilities
    within ``tolerance``."""
    for ref_inputs, inputs in cases(ref):
        check_greedy_tokens(
            generate(engine, inputs, NUM_EQUAL_STEPS)[0],
            *ref.generate_scored(ref_inputs, NUM_EQUAL_STEPS),
            tolerance,
        )
        got = generate(engine, inputs, 1, top_logprobs=TOP)[1].logprobs[0]
        reference = ref.next_token_logprobs(ref_inputs)
        assert got.token_id == int(reference.argmax())
        worst = max(abs(t.logprob - float(reference[t.token_id])) for t in got.top)
        assert worst <= tolerance, f"first-step log-probabilities differ by {worst:.4f}"


@pytest.mark.parametrize("kernels", ENGINES, ids="-".join)
def test_bf16_engine_matches_bf16_transformers(ref, engines, kernels):
    if kernels not in engines:
        pytest.skip("the native decoder does not take this architecture's layers")
    engine = engines[kernels]
    assert engine.dtype == torch.bfloat16
    assert (engine.linear_kernel, engine.cpu_kernels) == kernels[:2]
    native_attention = kernels[2] == "native"
    assert (engine.runner.prefill_kernels is not None) == native_attention
    tolerance = BF16_KERNEL_LOGPROB_TOL if native_attention else BF16_LOGPROB_TOL
    check_against_reference(engine, ref, tolerance)


@pytest.mark.skipif(not ONEDNN, reason=WHY_NOT)
@pytest.mark.skipif(not NATIVE_BF16, reason=f"bf16 emulated ({WHY_EMULATED}): not bit-equal")
def test_onednn_kernel_equals_plain(ref, engines):
    def run(engine, inputs):
        engine.add_request("r", SamplingParams(max_new_tokens=12, top_logprobs=TOP), inputs)
        return [lp for out in run_to_completion(engine)["r"] for lp in out.logprobs]

    for _, inputs in cases(ref):
        plain = run(engines["plain", "torch", "sdpa"], inputs)
        assert len(plain) == 12
        # every token and log-probability
        assert run(engines["onednn", "torch", "sdpa"], inputs) == plain


def test_a_near_tie_may_go_either_way_and_ends_the_comparison():
    lp = torch.log_softmax(torch.tensor([0.0, 3.0, 2.99, 1.0]), dim=-1)
    steps = [lp, lp, lp]
    check_greedy_tokens([1, 1, 1], [1, 1, 1], steps, 0.02)
    check_greedy_tokens([1, 2, 0], [1, 1, 1], steps, 0.02)  # the tie, then anything
    with pytest.raises(AssertionError, match="step 1: 3"):
        check_greedy_tokens([1, 3, 1], [1, 1, 1], steps, 0.02)  # 2.0 below the best
    with pytest.raises(AssertionError):
        check_greedy_tokens([1, 1], [1, 1, 1], steps, 0.02)


@pytest.mark.skipif(NATIVE is None, reason=f"native kernels: {WHY_NO_NATIVE}")
def test_native_rotary_and_kv_write_equal_torchs(ref, engines):
    """The attention layers' one-pass rotary embedding and KV write compute exactly what
    torch's operators do: every token and log-probability equal with and without it."""
    engine = engines["onednn" if ONEDNN else "plain", "native", "sdpa"]
    layers = [m for m in engine.runner.model.modules() if isinstance(m, Attention)]
    assert layers and all(layer.native is NATIVE for layer in layers)

    def run(inputs):
        engine.add_request("r", SamplingParams(max_new_tokens=12, top_logprobs=TOP), inputs)
        return [lp for out in run_to_completion(engine)["r"] for lp in out.logprobs]

    for _, inputs in cases(ref):
        native = run(inputs)
        for layer in layers:
            layer.native = None
        try:
            assert run(inputs) == native
        finally:
            for layer in layers:
                layer.native = NATIVE


@pytest.mark.skipif(not PREFILL_KERNEL, reason="no native prefill attention (AVX-512 BF16) here")
def test_native_prefill_attention_in_chunks_equals_it_whole(arch, harness, ref, engines):
    """Chunks after a cached prefix take the kernel's causal offset: prompts prefilled 7 tokens a
    step agree with the same engine prefilling them whole, token for token and within bf16's
    rounding of the first step (the chunks' GEMMs see other row counts)."""
    whole = engines["onednn" if ONEDNN else "plain", "native", "native"]
    chunked = harness(arch).engine(
        device="cpu", dtype="bfloat16", prefill_attention="native", chunk_size=7
    )
    assert chunked.runner.prefill_kernels is NATIVE
    for _, inputs in cases(ref):
        got, want = (generate(e, inputs, 6, top_logprobs=TOP) for e in (chunked, whole))
        assert got[0] == want[0]
        worst = max(
            abs(a.logprob - b.logprob)
            for a, b in zip(got[1].logprobs[0].top, want[1].logprobs[0].top, strict=True)
        )
        assert worst <= BF16_LOGPROB_TOL, f"chunked and whole differ by {worst:.4f}"


@pytest.mark.skipif(not LM_HEAD_KERNEL, reason="no native LM head (AVX-512 BF16) here")
def test_greedy_steps_take_the_heads_maxima_the_same_tokens_as_its_logits(ref, engines):
    """Requests that only take the maximum go through ``maxima`` (no logits made); the same
    requests with one asking for log-probabilities take the logits path, token for token the
    same."""
    engine = engines["onednn" if ONEDNN else "plain", "native", "sdpa"]
    model = engine.runner.model
    assert model.has_head_maxima
    calls = {"maxima": 0}
    maxima = model.maxima

    def counted(*args):
        calls["maxima"] += 1
        return maxima(*args)

    def run(logprobs_for: set[int]) -> dict[str, list[int]]:
        for i, (_, inputs) in enumerate(cases(ref) * 2):
            top = TOP if i in logprobs_for else 0
            params = SamplingParams(max_new_tokens=10, top_logprobs=top, ignore_eos=True)
            engine.add_request(f"r{i}", params, inputs)
        outs = run_to_completion(engine)
        return {rid: [t for o in out for t in o.token_ids] for rid, out in outs.items()}

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(model, "maxima", counted)
        fused = run(set())
        assert calls["maxima"] >= 10
        calls["maxima"] = 0
        assert run({1}) == fused
        assert calls["maxima"] == 0  # every step had a row that wanted logits


@pytest.mark.skipif(not LM_HEAD_KERNEL, reason="no native LM head (AVX-512 BF16) here")
def test_non_finite_maxima_fail_their_request_only(arch, harness, ref):
    # a fresh engine: the module's engines hold the clean image's prefix in their radix caches
    engine = harness(arch).engine(device="cpu", dtype="bfloat16")
    assert engine.runner.model.has_head_maxima
    (_, text), (_, image) = cases(ref)
    rows = image.image_rows.clone()
    rows[3, 5] = float("nan")
    poisoned = dataclasses.replace(image, image_rows=rows)
    alone = generate(engine, text, 6)[0]
    engine.add_request("text", SamplingParams(max_new_tokens=6), text)
    engine.add_request("bad", SamplingParams(max_new_tokens=6), poisoned)
    outs = run_to_completion(engine)
    assert [t for o in outs["text"] for t in o.token_ids] == alone
    assert "non-finite logits" in outs["bad"][-1].error
    assert not engine.requests


@pytest.mark.skipif(not LM_HEAD_KERNEL, reason="no native decoder (AVX-512 BF16) here")
def test_native_decoder_steps_match_the_module_path(arch, harness, ref, engines):
    """A step's layers in one C call (decode rows alone, decode rows beside a prefill chunk, a
    chunk after a cached prefix) give the tokens of the same engine's module path, and its
    log-probabilities within bf16's rounding (the linears sum in the packed blocks' order);
    where the step's attention is not all native (SDPA decode groups) the modules run it."""
    if NATIVE_DECODER not in engines:
        with pytest.raises(ValueError, match="linear_kernel native cannot run here: .*q/k"):
            raise_for = engines["plain", "torch", "sdpa"]
            raise_for.runner.model.use_linear_kernel("native", NATIVE)
        return
    # a fresh engine: its first prompt's keys land in one run of slots, later ones gathered
    engine = harness(arch).engine(device="cpu", dtype="bfloat16", linear_kernel="native")
    model = engine.runner.model
    decoder = model.decoder
    assert decoder is not None and engine.linear_kernel == "native"
    taken = []
    run_decoder = decoder.run

    def counted(h, cos, sin, batch, kv_pool, threads):
        # (decode rows?, per prefill chunk: are its keys gathered, not one run of slots?)
        taken.append((batch.decode_rows is not None, [s.kv_run is None for s in batch.extends]))
        return run_decoder(h, cos, sin, batch, kv_pool, threads)

    def run() -> dict[str, list]:
        cache = engine.cache_manager
        cache.allocator.free(cache.cache.evict(cache.cache.size_info().evictable_size))
        (_, text), (_, image) = cases(ref)
        params = SamplingParams(max_new_tokens=8, top_logprobs=TOP, ignore_eos=True)
        engine.add_request("a", params, text)
        engine.step()
        engine.step()  # "a" decodes while "b" prefills: a mixed step
        engine.add_request("b", params, image)
        outs = run_to_completion(engine)
        engine.add_request("c", params, text)  # its prompt cached: a chunk after a prefix
        outs.update(run_to_completion(engine))
        return {rid: [lp for o in out for lp in o.logprobs] for rid, out in outs.items()}

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(decoder, "run", counted)
        native = run()
        patch.setattr(model, "decoder", None)
        modules = run()
    assert any(decode and not extends for decode, extends in taken)  # decode alone
    assert any(decode and extends for decode, extends in taken)  # mixed
    gathered = [g for _, extends in taken for g in extends]
    assert True in gathered and False in gathered  # chunks' keys gathered and in place
    assert native.keys() == modules.keys() == {"a", "b", "c"}
    for rid, lps in native.items():
        assert [lp.token_id for lp in lps] == [lp.token_id for lp in modules[rid]], rid
        worst = max(
            abs(a.logprob - b.logprob)
            for x, y in zip(lps, modules[rid], strict=True)
            for a, b in zip(x.top, y.top, strict=True)
        )
        assert worst <= BF16_LOGPROB_TOL, f"{rid}: {worst:.4f}"


@pytest.mark.skipif(NATIVE is None, reason=f"native kernels: {WHY_NO_NATIVE}")
def test_native_linear_kernel_where_it_cannot_run_says_why(harness):
    """``auto`` falls back to oneDNN / plain in fp32 and with torch's CPU kernels; an explicit
    ``native`` is an error naming the reason."""
    h = harness("qwen2_5_vl")
    assert h.engine(device="cpu", dtype="float32").linear_kernel in ("onednn", "plain")
    with pytest.raises(ValueError, match="bf16 on a CPU with AVX-512 BF16, not torch.float32"):
        h.engine(device="cpu", dtype="float32", linear_kernel="native")
    with pytest.raises(ValueError, match="native CPU kernels are off"):
        h.engine(device="cpu", dtype="bfloat16", linear_kernel="native", cpu_kernels="torch")
