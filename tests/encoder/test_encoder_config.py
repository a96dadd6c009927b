"""EncoderConfig: validation, flags and EPD_ENCODER_* / EPD_TRANSFER_* environment variables."""

from __future__ import annotations

import argparse

import pytest

from services.encoder.config import EncoderConfig
from services.encoder.resize import smart_resize
from services.encoder.server import add_arguments, config_from_args


@pytest.mark.parametrize(
    "bad",
    [{"max_images": 0}, {"max_aspect_ratio": 0.5}, {"min_pixels": 10, "max_pixels": 5},
     {"sender": "carrier-pigeon"}, {"device": "tpu"}, {"port": 70000}],
)  # fmt: skip
def test_validation(bad):
    with pytest.raises(ValueError):
        EncoderConfig(**bad)


def test_flags_and_environment(monkeypatch):
    monkeypatch.setenv("EPD_ENCODER_MAX_IMAGES", "5")
    monkeypatch.setenv("EPD_ENCODER_ALLOWED_DIRS", "/a,/b")
    monkeypatch.setenv("EPD_TRANSFER_NUM_BLOCKS", "32")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model-path", "m", "--max-images", "4", "--allow-urls"])
    config = config_from_args(args)
    assert config.max_images == 4  # the flag wins over the environment
    assert config.allowed_dirs == ("/a", "/b") and config.allow_urls
    assert config.transfer.num_blocks == 32


@pytest.mark.parametrize("size", [(1, 1000), (28, 28), (4000, 3000), (333, 777), (20, 4000)])
def test_smart_resize_bounds(size):
    h, w = smart_resize(*size, factor=28, min_pixels=3136, max_pixels=1_003_520)
    assert h % 28 == 0 and w % 28 == 0
    assert 3136 <= h * w <= 1_003_520
