"""Fixtures shared by every test package."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("GLOG_minloglevel", "2")  # quiet Mooncake's glog in child processes

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
