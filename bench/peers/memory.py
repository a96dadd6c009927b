"""Whether both servers fit in this host's memory at once, from the checkpoint's size.

A rough, deliberately generous estimate: each system holds the weights in the compute dtype
plus its runtime; vLLM adds its KV cache (``VLLM_CPU_KVCACHE_SPACE``), ours its two transfer
buffers (512 blocks x 128 tokens x hidden in fp32, encoder and language worker). Both fit when
the sum is at most ``SHARE`` of the available memory; otherwise the benchmark runs them one at
a time.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

GIB = 1 << 30
RUNTIME_BYTES = int(1.5 * GIB)  # python, torch, tokenizer, activations: per system
VLLM_KV_BYTES = 2 * GIB
TRANSFER_TOKENS = 512 * 128
SHARE = 0.8


def checkpoint_params(model_dir: Path) -> int:
    """Parameters of every ``*.safetensors`` file of ``model_dir``, from their headers."""
    total = 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            count = 1
            for dim in entry["shape"]:
                count *= dim
            total += count
    return total


def text_hidden(model_dir: Path) -> int:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return int((config.get("text_config") or {}).get("hidden_size") or config["hidden_size"])


def needed_bytes(model_dir: Path, dtype: str) -> int:
    """Both systems' estimated resident memory for ``model_dir`` computing in ``dtype``."""
    weights = checkpoint_params(model_dir) * (4 if dtype == "float32" else 2)
    vllm = weights + VLLM_KV_BYTES + RUNTIME_BYTES
    ours = weights + 2 * TRANSFER_TOKENS * text_hidden(model_dir) * 4 + 2 * RUNTIME_BYTES
    return vllm + ours


def available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def fit_together(model_dir: Path, dtype: str) -> tuple[bool, int, int]:
    """(both fit, bytes needed, bytes available)."""
    need, have = needed_bytes(model_dir, dtype), available_bytes()
    return need <= SHARE * have, need, have
