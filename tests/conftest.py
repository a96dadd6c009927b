"""Fixtures shared by every test package."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("GLOG_minloglevel", "2")  # quiet Mooncake's glog in child processes
# NOTE: the suite compares served tokens with transformers run in fp32, so the services it starts
# compute in fp32 unless a test asks for another dtype (``--dtype`` wins over these). ``auto``
# would pick bf16 on a CPU with native bf16; the bf16 tests ask for it by name.
os.environ.setdefault("EPD_ENCODER_DTYPE", "float32")
os.environ.setdefault("EPD_LANGUAGE_DTYPE", "float32")

ARCHS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory):
    """``tiny_model_dir(arch)`` -> a test-size checkpoint, built once per session."""
    from common.models.tiny import ensure_tiny_model

    root = tmp_path_factory.mktemp("models")
    built: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in built:
            built[arch] = ensure_tiny_model(arch, "test", cache_dir=root)
        return built[arch]

    return get
