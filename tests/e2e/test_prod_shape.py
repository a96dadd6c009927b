"""The production shape on CPU: bf16 on the wire, bf16 and fp32 compute, Mooncake, every role
its own process, checked against transformers run in the same dtypes.

* encoder bf16, language worker fp32, wire bf16: the arithmetic is the reference's when its
  vision tower runs in bf16 (a copy loaded in bf16, as the encoder loads it) and its rows are
  handed to the fp32 text model through bf16 — so greedy tokens are equal token for token and
  the first step's log-probabilities agree to fp32 rounding;
* encoder and language worker bf16: on this CPU the engine's bf16 text model performs the same
  operations in the same order as transformers' bf16 model, so tokens are equal too; the first
  step's log-probabilities are compared with a tolerance (``BF16_LOGPROB_TOL``) that other
  kernels (a GPU's) would need, yet that still tells a bf16 path from an fp32 one;
* the prod overlay's own settings (its dtypes, KV sizing and limits; CPU for CUDA, tcp for rdma,
  no secrets) serve image requests.

The rows themselves are checked bit for bit in ``tests/encoder/test_encoder_dtype.py`` (the
encoder's bf16 ViT output cast to the wire dtype, through a real sender and receiver).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import yaml

from common.models.hf_reference import HFReference
from tests.e2e.conftest import noise_image, png_bytes

ARCH = "qwen3_vl"  # deepstack rows travel too
MAX_TOKENS = 8
TOP = 5
PROMPT = "Describe the image."
MOONCAKE = {"EPD_TRANSFER_TRANSPORT": "mooncake", "EPD_TRANSFER_DTYPE": "bfloat16"}
# fp32 text arithmetic on both sides, different kernels: differences are float32 rounding.
FP32_LOGPROB_TOL = 1e-3
# bf16 keeps 8 significant bits. Measured on the tiny qwen3_vl checkpoint: the stack in bf16 vs
# transformers in bf16 differs by 0 here (same operations, same order); transformers in bf16 vs
# fp32 differs by 0.06 nats on the top-5 log-probabilities. 0.02 allows kernels that round
# differently (about a third of a bf16-vs-fp32 step) and still fails if either side ran in fp32.
BF16_LOGPROB_TOL = 0.02
PROD = Path(__file__).resolve().parents[2] / "deploy" / "k8s" / "overlays" / "prod"


def first_step(reply) -> dict[int, float]:
    """The first generated token's top log-probabilities, token id -> logprob."""
    return {t.token_id: t.logprob for t in reply.logprobs[0].top}


def compare(reply, expected: torch.Tensor, tol: float) -> float:
    got = first_step(reply)
    assert len(got) == TOP
    ref_top = torch.topk(expected, TOP)
    assert reply.logprobs[0].token_id == int(ref_top.indices[0])  # the greedy choice
    worst = max(abs(got[t] - float(expected[t])) for t in got)
    assert worst <= tol, f"first-step log-probabilities differ by up to {worst:.4f}"
    return worst


def ask_bf16_encoder(
    stack_factory, model_dir, image, language_dtype: str, encoder_kernel="auto", attention="auto"
):
    """A stack with a bf16 encoder (its linear kernel ``encoder_kernel``) and a language worker
    in ``language_dtype`` (its prefill attention ``attention``) over Mooncake, and its greedy
    answer (with log-probabilities) to PROMPT and ``image``."""
    env = {**MOONCAKE, "EPD_ENCODER_DTYPE": "bfloat16", "EPD_LANGUAGE_DTYPE": language_dtype}
    # the vision tower attends with SDPA as the reference does (auto's native kernel rounds
    # elsewhere; tests/encoder/test_vision_attention.py bounds it)
    env |= {"EPD_ENCODER_LINEAR_KERNEL": encoder_kernel, "EPD_ENCODER_VISION_ATTENTION": "grouped"}
    stack = stack_factory(model_dir, env={**env, "EPD_LANGUAGE_PREFILL_ATTENTION": attention})
    with stack.client() as client:
        reply = client.generate(
            PROMPT, [png_bytes(image)], max_tokens=MAX_TOKENS, timeout=60, logprobs=True,
            top_logprobs=TOP,
        )  # fmt: skip
    return stack, reply


def test_bf16_encoder_fp32_language_equals_reference(tiny_model_dir, stack_factory) -> None:
    model_dir = tiny_model_dir(ARCH)
    ref = HFReference(model_dir, wire_dtype=torch.bfloat16, vision_dtype=torch.bfloat16)
    image = noise_image(21, 112, 84)
    inputs = ref.build_inputs(PROMPT, [image])
    expected = ref.generate(inputs, MAX_TOKENS)
    # NOTE: the plain kernel runs the ViT exactly as the reference's bf16 tower does (its
    # patch convolution included), which this tight tolerance needs; the onednn kernel's rows
    # are checked against it in tests/encoder/test_encoder_dtype.py.
    stack, reply = ask_bf16_encoder(
        stack_factory, model_dir, image, language_dtype="float32", encoder_kernel="plain"
    )
    assert list(reply.token_ids) == expected
    assert len(reply.logprobs) == len(reply.token_ids)
    compare(reply, ref.next_token_logprobs(inputs), FP32_LOGPROB_TOL)
    layouts = {w.role: w.transfer_layout.dtype for w in stack.workers()}
    assert layouts == {"encoder": "bfloat16", "language": "bfloat16"}
    stack.wait_no_leaks()


def test_bf16_everywhere_matches_reference_logprobs(tiny_model_dir, stack_factory) -> None:
    model_dir = tiny_model_dir(ARCH)
    ref = HFReference(model_dir, dtype=torch.bfloat16)
    image = noise_image(22, 112, 84)
    inputs = ref.build_inputs(PROMPT, [image])
    # NOTE: the plain kernel, as above: the onednn tower's patch embedding sums in another order
    # than the reference's convolution, and on a CPU without AMX (AVX-512 BF16 only) that alone
    # moved the first step's log-probabilities by 0.047 on this tiny model (0 with the plain
    # kernel). The onednn rows have their own bound in tests/encoder/test_encoder_dtype.py.
    # SDPA, the reference's attention, for the same reason: the native prefill attention (auto's
    # choice on a CPU with AVX-512 BF16) rounds elsewhere; tests/language/test_bf16.py bounds it.
    stack, reply = ask_bf16_encoder(
        stack_factory,
        model_dir,
        image,
        language_dtype="bfloat16",
        encoder_kernel="plain",
        attention="sdpa",
    )
    assert list(reply.token_ids) == ref.generate(inputs, MAX_TOKENS)  # same arithmetic here
    compare(reply, ref.next_token_logprobs(inputs), BF16_LOGPROB_TOL)
    stack.wait_no_leaks()


def prod_overlay_env() -> dict[str, str]:
    """The prod overlay's encoder, language and transfer settings, on CPU: CUDA becomes CPU,
    rdma becomes tcp, model paths come from the test, secret files are left out (the security
    tests cover them)."""
    kustomization = yaml.safe_load((PROD / "kustomization.yaml").read_text())
    env: dict[str, str] = {}
    for generator in kustomization.get("configMapGenerator", []):
        for literal in generator.get("literals", []):
            key, _, value = literal.partition("=")
            if re.match(r"EPD_(ENCODER|LANGUAGE|TRANSFER)_", key):
                env[key] = value
    for key in list(env):
        if key.endswith(("_MODEL_PATH", "_FILE")) or key == "EPD_TRANSFER_DEVICE_NAMES":
            del env[key]
        elif key.endswith("_DEVICE"):
            env[key] = "cpu"
    env["EPD_TRANSFER_PROTOCOL"] = "tcp"
    return env


def test_prod_overlay_settings_serve_images_on_cpu(tiny_model_dir, stack_factory) -> None:
    env = prod_overlay_env()
    assert env["EPD_TRANSFER_DTYPE"] == "bfloat16" and env["EPD_ENCODER_DTYPE"] == "bfloat16"
    assert env["EPD_LANGUAGE_DTYPE"] == "bfloat16"
    assert int(env["EPD_ENCODER_MAX_PROMPT_TOKENS"]) <= int(env["EPD_LANGUAGE_MAX_SEQ_LEN"])
    stack = stack_factory(tiny_model_dir("qwen2_5_vl"), env=env)
    images = [png_bytes(noise_image(30 + i, 112 + 28 * i)) for i in range(3)]
    with stack.client() as client:
        for i, image in enumerate(images):
            reply = client.generate(f"Picture {i}?", [image], max_tokens=4, timeout=60)
            assert len(reply.token_ids) == 4 and reply.encoder and reply.language
    workers = stack.workers()
    assert {w.transfer_layout.dtype for w in workers} == {"bfloat16"}
    assert all(not w.problem for w in workers), [w.problem for w in workers]
    stack.wait_no_leaks()


@pytest.fixture(autouse=True)
def _quiet_weights_progress(monkeypatch) -> None:
    monkeypatch.setenv("TQDM_DISABLE", "1")
