"""The lookup-table patch cutter gives exactly the image processor's patches (in bf16: exactly
those patches cast to bf16, as a bf16 tower would cast them)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from PIL import Image

from common.native_kernels import load_native_kernels
from services.encoder.checkpoint import load_checkpoint
from services.encoder.patches import PatchCutter
from tests.conftest import ARCHS

NATIVE, WHY_NOT = load_native_kernels()
# torch's passes, and where they build the native kernel's one pass: the same values
CUTS = ["torch", pytest.param("native", marks=pytest.mark.skipif(NATIVE is None, reason=WHY_NOT))]


@pytest.mark.parametrize("cut", CUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ARCHS)
def test_cutter_equals_the_processor_bit_for_bit(tiny_model_dir, arch, dtype, cut):
    proc = load_checkpoint(tiny_model_dir(arch)).image_processor
    cutter = PatchCutter.for_processor(proc, dtype)
    assert cutter is not None
    cutter.native = NATIVE if cut == "native" else None
    side = cutter.patch_size * cutter.merge_size
    rng = np.random.default_rng(7)
    for grid_h, grid_w in ((1, 1), (2, 3), (7, 4)):
        pixels = rng.integers(0, 256, (grid_h * side, grid_w * side, 3), dtype=np.uint8)
        img = Image.fromarray(pixels)
        expected = proc(images=[img], do_resize=False, return_tensors="pt")["pixel_values"]
        got = cutter(img)
        assert got.dtype == dtype and got.is_contiguous()
        assert torch.equal(got, expected.to(dtype))


def test_the_table_follows_the_processors_settings_or_steps_aside(tiny_model_dir):
    proc = copy.deepcopy(load_checkpoint(tiny_model_dir("qwen2_5_vl")).image_processor)
    proc.do_normalize = False
    assert PatchCutter.for_processor(proc) is None
    proc.do_normalize, proc.image_mean = True, [0.0, 0.0, 0.0]  # a probe tells it apart
    cutter = PatchCutter.for_processor(proc)
    assert cutter is not None  # still exact: the table is built from the processor's own values
    assert np.allclose(cutter.table[0], np.arange(256) / 255 / np.float32(proc.image_std[0]))


@pytest.mark.skipif(NATIVE is None, reason=WHY_NOT)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_cut_of_video_frames_equals_torchs(tiny_model_dir, dtype):
    """A frame group (two different frames) and an image, cut by the native kernel and by
    torch's passes: the same values in the same order."""
    proc = load_checkpoint(tiny_model_dir("qwen2_5_vl")).image_processor
    plain, native = PatchCutter.for_processor(proc, dtype), PatchCutter.for_processor(proc, dtype)
    native.native = NATIVE
    side = plain.patch_size * plain.merge_size
    rng = np.random.default_rng(11)
    frames = [rng.integers(0, 256, (3 * side, 5 * side, 3), dtype=np.uint8) for _ in range(2)]
    assert torch.equal(native.cut_frames(frames), plain.cut_frames(frames))
    img = Image.fromarray(frames[0])
    assert torch.equal(native(img), plain(img))
    with pytest.raises(ValueError, match="not a whole number"):
        NATIVE.cut_patches(torch.zeros(1, side + 1, side, 3, dtype=torch.uint8),
                           native._flat_table, native.patch_size, native.merge_size)  # fmt: skip
