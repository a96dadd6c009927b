"""``make bench``: every benchmark, one after the other, each printing its own table.

Each part runs in a fresh interpreter so that one benchmark's threads and memory do not skew
the next; a failing part is reported and the rest still run (exit status 1 at the end).
"""

from __future__ import annotations

import subprocess
import sys
import time

PARTS = (
    ("transfer protocol vs raw Mooncake / memcpy", ["-m", "bench.transfer"]),
    ("encoder: batching and embedding cache", ["-m", "bench.encoder"]),
    ("language engine vs transformers", ["-m", "bench.language"]),
    ("end to end through the gateway vs transformers", ["-m", "bench.e2e"]),
    ("elastic: 1 vs 2 gateways, rolling restarts under load", ["-m", "bench.elastic"]),
)


def main() -> int:
    failed = []
    for title, args in PARTS:
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
