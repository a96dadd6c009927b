"""The encoder on a CUDA device, against transformers on the same device (skipped without
CUDA; CI has none): the vision tower in fp32 and in bf16 against transformers' on the GPU, and
the whole encoder on the GPU against the same encoder on the CPU (images, and a clip's frame
groups). The language engine's CUDA tests are in ``test_cuda_language.py``.
"""

from __future__ import annotations

import pytest
import torch

from common.transfer.config import TransferConfig
from services.encoder.checkpoint import load_checkpoint
from services.encoder.config import EncoderConfig
from services.encoder.pipeline import EncoderPipeline
from services.encoder.types import ChatMessage, ContentPart, VideoInput, VideoSampling
from services.encoder.vision import VisionTower
from tests.cuda.conftest import CUDA, DTYPES, requires_cuda
from tests.language.conftest import make_image
from tests.media import make_video

pytestmark = requires_cuda

# vision rows: fp32 agrees to rounding (H100: 0 between the towers on the GPU, 1.9e-6 between
# the GPU and CPU encoders), bf16 to its own precision (relative error of the whole block)
FP32_ROWS = {"rtol": 1e-4, "atol": 1e-4}
BF16_ROWS_REL = 0.02
MESSAGES = [
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Compare"}]},
    {"role": "assistant", "content": "Sure."},
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "And this?"}]},
]


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
