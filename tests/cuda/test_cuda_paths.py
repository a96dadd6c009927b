"""The model paths on a CUDA device, against transformers on the same device.

Skipped where there is no CUDA device (CI has none). On a GPU machine, ``pytest tests/cuda
tests/language`` runs these and every language-engine test on CUDA as well: the engines there
pick their device with ``auto``.

* the encoder's vision tower in fp32 and in bf16 against transformers' on the GPU, and the whole
  encoder on the GPU against the same encoder on the CPU (images, and a clip's frame groups);
* the language engine in fp32: greedy tokens equal transformers' ``generate`` on the GPU, for text,
  images, prompts cut into chunks, and concurrent requests of different lengths decoded together;
* the language engine in bf16 against transformers in bf16: the first steps' greedy tokens equal,
  the first step's log-probabilities within ``BF16_CUDA_LOGPROB_TOL``.
"""

from __future__ import annotations

import pytest
import torch

from bench.local_encode import local_encode
from common.models.hf_reference import HFReference
from common.transfer.config import TransferConfig
from services.encoder.checkpoint import load_checkpoint
from services.encoder.config import EncoderConfig
from services.encoder.pipeline import EncoderPipeline
from services.encoder.types import ChatMessage, ContentPart, VideoInput, VideoSampling
from services.encoder.vision import VisionTower
from services.language.config import LanguageConfig
from services.language.engine.engine import LanguageEngine
from services.language.engine.sampling import SamplingParams
from tests.conftest import ARCHS
from tests.language.conftest import generate, make_image, run_to_completion, tokens_of
from tests.language.test_bf16 import check_against_reference
from tests.media import make_video

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

CUDA = "cuda"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# vision rows: fp32 agrees to rounding (H100: 0 between the towers on the GPU, 1.9e-6 between
# the GPU and CPU encoders), bf16 to its own precision (relative error of the whole block)
FP32_ROWS = {"rtol": 1e-4, "atol": 1e-4}
BF16_ROWS_REL = 0.02
# bf16 first-step log-probabilities on the GPU: the CPU tests' 0.02 is too tight here, where the
# two sides run different kernels (flash / memory-efficient attention, split-K GEMMs); measured
# 0.030-0.035 on an H100 (bf16's unit roundoff 2^-8 on logits of magnitude ~8)
BF16_CUDA_LOGPROB_TOL = 0.05
MESSAGES = [
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Compare"}]},
    {"role": "assistant", "content": "Sure."},
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "And this?"}]},
]


@pytest.fixture(scope="module", params=ARCHS)
def arch(request):
    return request.param


@pytest.fixture(scope="module")
def refs(arch, tiny_model_dir):
    """transformers on the GPU, in each dtype."""
    path = tiny_model_dir(arch)
    return {name: HFReference(path, device=CUDA, dtype=dtype) for name, dtype in DTYPES.items()}


def encoder(path, device: str) -> EncoderPipeline:
    """An fp32 encoder that ships fp32 rows (nothing rounded on the way out)."""
    config = EncoderConfig(
        device=device,
        dtype="float32",
        sender="none",
        cache_mb=0,
        transfer=TransferConfig(dtype="float32"),
    )
    return EncoderPipeline(path, config)


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.float() - expected.float()).norm() / expected.float().norm())


@pytest.mark.parametrize("dtype", DTYPES)
def test_vision_tower_on_cuda_matches_transformers_on_cuda(arch, refs, tiny_model_dir, dtype):
    """The same patches through our tower and through transformers' own, both on the GPU."""
    ref = refs[dtype]
    tower = VisionTower(load_checkpoint(tiny_model_dir(arch)), CUDA, dtype)
    assert tower.device.type == "cuda" and tower.dtype == DTYPES[dtype]
    inputs = ref.build_chat_inputs(MESSAGES, [make_image(100, 80, 1), make_image(60, 130, 2)])
    grids = [tuple(int(x) for x in thw) for thw in inputs.image_grid_thw]
    got = tower.forward(inputs.pixel_values, grids).float().cpu()
    with torch.no_grad():
        out = ref.model.model.visual(
            inputs.pixel_values.to(CUDA), grid_thw=inputs.image_grid_thw.to(CUDA)
        )
    parts = [out.pooler_output, *(getattr(out, "deepstack_features", None) or [])]
    expected = torch.cat(parts, -1).float().cpu()
    assert got.shape == expected.shape
    if dtype == "float32":
        torch.testing.assert_close(got, expected, **FP32_ROWS)
    else:
        assert relative_error(got, expected) <= BF16_ROWS_REL


@pytest.mark.parametrize("media", ["images", "video"])
def test_encoder_on_cuda_gives_the_cpu_encoders_rows(arch, tiny_model_dir, media):
    """The whole encoder (intake, patches cut on the CPU, the tower on the GPU, rows staged on
    the CPU for the wire) against the same encoder on the CPU, which the golden tests hold bit
    for bit to transformers: for images, and for a clip's frame groups, cut lazily."""
    if media == "images":
        messages, images = MESSAGES, [make_image(100, 80, 1), make_image(60, 130, 2)]
    else:
        data = make_video(num_frames=14, width=80, height=60, fps=4, seed=3)
        video = ContentPart(video=VideoInput(data, VideoSampling()))
        messages, images = [ChatMessage("user", (video, ContentPart(text="What happens?")))], []
    rows = {}
    for device in ("cpu", CUDA):
        pipe = encoder(tiny_model_dir(arch), device)
        try:
            assert pipe.tower.device.type == device
            rows[device] = pipe.encode(messages, images, timeout_s=120).image_rows
        finally:
            pipe.close()
    assert rows[CUDA].device.type == "cpu"  # staged for the wire
    assert rows[CUDA].shape == rows["cpu"].shape and rows["cpu"].shape[0] > 0
    torch.testing.assert_close(rows[CUDA], rows["cpu"], **FP32_ROWS)


def engine(path, dtype: str, **overrides) -> LanguageEngine:
    config = dict(model_path=str(path), device=CUDA, dtype=dtype, num_kv_slots=8192, chunk_size=512)
    return LanguageEngine(LanguageConfig(**{**config, **overrides}))


def test_fp32_engine_on_cuda_equals_transformers_on_cuda(arch, refs, tiny_model_dir):
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
    eng = engine(tiny_model_dir(arch), "float32")
    assert eng.device.type == "cuda" and eng.dtype == torch.float32
    for inputs, expected in cases:  # one at a time
        assert generate(eng, inputs, 10)[0] == expected
    eng = engine(tiny_model_dir(arch), "float32", chunk_size=7)  # chunks cut the images
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
