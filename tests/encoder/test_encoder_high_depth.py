"""16-bit and float images (real encoded files) become 8-bit RGB with their range scaled."""

from __future__ import annotations

import io

import numpy as np
import pytest
from encoder_helpers import encode_bytes, png16, tiff_grey, user_turn
from PIL import Image

from services.encoder.config import EncoderConfig
from services.encoder.intake import ImageIntake

W, H = 64, 32
RAMP16 = (np.arange(W * H, dtype=np.int64).reshape(H, W) * 65535 // (W * H - 1)).astype(np.uint16)


def _scaled(values: np.ndarray, low: float, high: float) -> np.ndarray:
    """The 8-bit grey the encoder must produce: [low, high] onto [0, 255], rounded."""
    scaled = (values.astype(np.float64) - low) * 255.0 / (high - low)
    return np.clip(np.rint(scaled), 0, 255).astype(np.uint8)


def _pil_tiff(values: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(values).save(buf, "TIFF")
    return buf.getvalue()


FLOAT_RAMP = RAMP16.astype(np.float32) / 65535  # in [0, 1]
WIDE_INT = RAMP16.astype(np.int32) * 1000 - 5_000_000  # beyond 16 bits, negative too
HDR = RAMP16.astype(np.float32) / 65535 * 40.0 - 2.0  # outside [0, 1]

CASES = {
    # name: (encoded file, PIL mode it opens as, expected 8-bit grey)
    "png-16-grey": (encode_bytes(Image.fromarray(RAMP16)), "I;16", _scaled(RAMP16, 0, 65535)),
    "png-16-grey-by-hand": (png16(RAMP16), "I;16", _scaled(RAMP16, 0, 65535)),
    "tiff-16-big-endian": (tiff_grey(RAMP16, True), "I;16B", _scaled(RAMP16, 0, 65535)),
    "tiff-16-little-endian": (tiff_grey(RAMP16, False), "I;16", _scaled(RAMP16, 0, 65535)),
    "tiff-int32-16bit-range": (
        _pil_tiff(RAMP16.astype(np.int32)),
        "I",
        _scaled(RAMP16, 0, 65535),
    ),
    "tiff-int32-wide": (
        tiff_grey(WIDE_INT),
        "I",
        _scaled(WIDE_INT, WIDE_INT.min(), WIDE_INT.max()),
    ),
    "tiff-float-unit": (_pil_tiff(FLOAT_RAMP), "F", _scaled(FLOAT_RAMP, 0, 1)),
    "tiff-float-big-endian": (tiff_grey(FLOAT_RAMP), "F", _scaled(FLOAT_RAMP, 0, 1)),
    "tiff-float-hdr": (tiff_grey(HDR, False), "F", _scaled(HDR, HDR.min(), HDR.max())),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_high_depth_grey_is_scaled_not_clipped(name):
    data, mode, expected = CASES[name]
    assert Image.open(io.BytesIO(data)).mode == mode  # the file really is of that kind
    rgb = ImageIntake(EncoderConfig()).load(data, 0)
    assert rgb.mode == "RGB" and rgb.size == (W, H)
    pixels = np.asarray(rgb)
    assert (pixels[..., 0] == pixels[..., 1]).all() and (pixels[..., 1] == pixels[..., 2]).all()
    np.testing.assert_allclose(pixels[..., 0], expected, atol=1)  # float32 arithmetic rounding
    assert pixels.min() == 0 and pixels.max() == 255  # the whole range is used


def test_16_bit_rgb_png_keeps_its_high_byte():
    values = np.zeros((H, W, 3), dtype=np.uint16)
    values[..., 0] = RAMP16
    values[..., 1] = 65535 - RAMP16
    values[..., 2] = 0x8000
    assert Image.open(io.BytesIO(png16(values))).mode == "RGB"
    pixels = np.asarray(ImageIntake(EncoderConfig()).load(png16(values), 0))
    np.testing.assert_array_equal(pixels, (values >> 8).astype(np.uint8))


def test_nan_and_constant_floats_stay_defined():
    values = FLOAT_RAMP.copy()
    values[0, :4] = [np.nan, np.inf, -np.inf, 0.5]
    pixels = np.asarray(ImageIntake(EncoderConfig()).load(tiff_grey(values), 0))[..., 0]
    # the finite values span [0, 1]: nan and -inf count as 0, inf as 1
    assert pixels[0, :4].tolist() == [0, 255, 0, 128]
    constant = np.full((H, W), 7.5, dtype=np.float32)
    assert np.asarray(ImageIntake(EncoderConfig()).load(tiff_grey(constant), 0)).max() == 0


def test_a_16_bit_file_encodes_as_its_8_bit_equivalent(pipeline):
    """Through the whole pipeline: the same pixels (so the same cache key and rows) as the
    8-bit image the scaling describes."""
    eight_bit = Image.fromarray(_scaled(RAMP16, 0, 65535), "L")
    keys = [
        pipeline.prepare(user_turn(1), [data]).images[0].key
        for data in (tiff_grey(RAMP16), encode_bytes(eight_bit))
    ]
    assert keys[0] == keys[1]
