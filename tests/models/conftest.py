"""Small checkpoints in the Hub's layout: sharded bf16 safetensors with an index, Hub keys and
the Hub's config layout (flat for Qwen2/2.5-VL, nested for Qwen3-VL), tied or untied."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from common.models.hub_checkpoint import write_hub_checkpoint
from common.models.hub_config import HUB_SPECS, HubSpec

# The test size's widths (tiny.SPECS["test"]) on each real spec's layout.
SMALL = dict(
    hidden_size=128,
    intermediate_size=256,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    vision_depth=2,
    vision_hidden=64,
    vision_intermediate=128,
    vision_heads=4,
)
SHARD_BYTES = 150_000  # several shards even at this size


def small_spec(arch: str, tied: bool) -> HubSpec:
    base = HUB_SPECS[arch]
    if arch == "qwen3_vl":
        extra = dict(mrope_section=(6, 5, 5), deepstack_indexes=(0, 1), num_position_embeddings=576)
    else:
        extra = dict(mrope_section=(4, 6, 6), fullatt_indexes=(1,) if base.fullatt_indexes else ())
    return replace(base, **SMALL, **extra, tie_word_embeddings=tied)


@pytest.fixture(scope="session")
def hub_checkpoint(tmp_path_factory):
    """``hub_checkpoint(arch, tied)`` -> a small Hub-layout checkpoint, built once per session."""
    root = tmp_path_factory.mktemp("hub-models")
    built: dict[tuple[str, bool], Path] = {}

    def get(arch: str, tied: bool) -> Path:
        if (arch, tied) not in built:
            out = root / f"{arch}-{'tied' if tied else 'untied'}"
            built[arch, tied] = write_hub_checkpoint(
                out, small_spec(arch, tied), tokenizer="test", max_shard_bytes=SHARD_BYTES
            )
        return built[arch, tied]

    return get
