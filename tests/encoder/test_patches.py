"""The lookup-table patch cutter gives exactly the image processor's patches (in bf16: exactly
those patches cast to bf16, as a bf16 tower would cast them)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from PIL import Image

from services.encoder.checkpoint import load_checkpoint
from services.encoder.patches import PatchCutter
from tests.conftest import ARCHS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ARCHS)
def test_cutter_equals_the_processor_bit_for_bit(tiny_model_dir, arch, dtype):
    proc = load_checkpoint(tiny_model_dir(arch)).image_processor
    cutter = PatchCutter.for_processor(proc, dtype)
    assert cutter is not None
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
