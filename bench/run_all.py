"""``make bench``: every benchmark, one after the other, each printing its own table.

The encoder, language-engine and end-to-end benchmarks run twice: on the demo checkpoint and on
the bench checkpoint (real layer widths, few layers; ``epd make-tiny-model --size bench``).
``bench.limits`` holds each compute stage against the machine's own mm FLOP/s and copy
bandwidth on the bench checkpoint only (the demo model's layers are too narrow to load a core).

On a machine with CUDA, ``bench.cuda_graphs`` runs too (decode steps with and without CUDA graphs).

Each part runs in a fresh interpreter so that one benchmark's threads and memory do not skew
the next; a failing part is reported and the rest still run (exit status 1 at the end).
"""

from __future__ import annotations

import subprocess
import sys
import time

BENCH = "bench model: Qwen2.5-VL-3B widths, 4+4 layers"
PARTS = (
    (f"every stage vs the machine's limits, {BENCH}", ["-m", "bench.limits", "--size", "bench"]),
    ("transfer protocol vs raw Mooncake / memcpy, fixed cost per room", ["-m", "bench.transfer"]),
    ("encoder: batching and embedding cache", ["-m", "bench.encoder"]),
    (f"encoder, {BENCH}", ["-m", "bench.encoder", "--size", "bench"]),
    ("language engine vs transformers", ["-m", "bench.language"]),
    (f"language engine vs transformers, {BENCH}", ["-m", "bench.language", "--size", "bench"]),
    ("decode beside a long context: grouped by KV length or not", ["-m", "bench.decode_groups"]),
    ("end to end through the gateway vs transformers", ["-m", "bench.e2e"]),
    (f"end to end vs transformers, {BENCH}", ["-m", "bench.e2e", "--size", "bench"]),
    ("tail latency under load: mixed workload at concurrency 16 and 64", ["-m", "bench.tail"]),
    ("the HTTP front door vs gRPC, same gateway", ["-m", "bench.http"]),
    ("gateway overhead: direct vs relay vs gateway", ["-m", "bench.gateway"]),
    ("elastic: 1 vs 2 gateways, rolling restarts under load", ["-m", "bench.elastic"]),
    ("image by image + prefill while receiving, on vs off", ["-m", "bench.overlap"]),
)
CUDA_PARTS = ((f"decode steps with and without CUDA graphs, {BENCH}", ["-m", "bench.cuda_graphs"]),)


def main() -> int:
    import torch

    failed = []
    parts = PARTS
    if torch.cuda.is_available():
        parts += CUDA_PARTS
    else:
        print("no CUDA device: bench.cuda_graphs skipped", flush=True)
    for title, args in parts:
        print(f"\n=== {title} ===", flush=True)
        start = time.monotonic()
        rc = subprocess.call([sys.executable, *args])
        print(f"({time.monotonic() - start:.0f} s)", flush=True)
        if rc:
            failed.append(title)
    if failed:
        print("\nfailed: " + "; ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
