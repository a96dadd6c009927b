"""Fixtures: real tiny checkpoints of the three architectures, built once per session."""

from __future__ import annotations

import pytest

from common.models.tiny import ARCHS, ensure_tiny_model
from services.encoder.config import EncoderConfig
from services.encoder.pipeline import EncoderPipeline


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("encoder-models")
    return {arch: ensure_tiny_model(arch, "test", root) for arch in ARCHS}


@pytest.fixture(scope="session")
def qwen25_dir(model_dirs):
    return model_dirs["qwen2_5_vl"]


@pytest.fixture(scope="module")
def pipeline(qwen25_dir, tmp_path_factory):
    allowed = tmp_path_factory.mktemp("allowed")
    pipe = EncoderPipeline(
        qwen25_dir,
        EncoderConfig(
            device="cpu",
            dtype="float32",
            max_images=3,
            max_prompt_tokens=400,
            allowed_dirs=(str(allowed),),
        ),
    )
    pipe.allowed_dir = allowed
    yield pipe
    pipe.close()
