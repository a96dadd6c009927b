"""Work the slow tests run in a child process, so its memory is its own and is given back.

``python -m tests.slow.child build ARCH SIZE OUT`` writes a generated checkpoint;
``python -m tests.slow.child reference MODEL REQUESTS_JSON MAX_TOKENS`` runs transformers'
monolithic greedy ``generate`` on each request (``[{"prompt": str, "images": [[seed, w, h]]}]``).
Each prints one JSON line: its result, its wall time and its peak RSS (``VmHWM``).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def _status_bytes(pid: int | str, key: str) -> int:
    """A memory figure (``VmHWM``, ``VmRSS``, ...) of a live process, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} for process {pid}")


def peak_rss_bytes(pid: int | str = "self") -> int:
    """``VmHWM`` of a live process: the most resident memory it has had."""
    return _status_bytes(pid, "VmHWM")


def rss_bytes(pid: int | str = "self") -> int:
    """``VmRSS`` of a live process: its resident memory now."""
    return _status_bytes(pid, "VmRSS")


def build(arch: str, size: str, out: str) -> dict:
    from common.models.tiny import make_tiny_model

    make_tiny_model(arch, Path(out), size)
    return {}


def reference(model: str, requests_json: str, max_tokens: str) -> dict:
    from common.models.hf_reference import HFReference
    from tests.e2e.conftest import noise_image

    start = time.monotonic()
    ref = HFReference(model)
    load_s = time.monotonic() - start
    tokens = []
    for request in json.loads(requests_json):
        images = [noise_image(seed, w, h) for seed, w, h in request["images"]]
        tokens.append(ref.generate(ref.build_inputs(request["prompt"], images), int(max_tokens)))
    return {"tokens": tokens, "load_s": load_s}


def main(argv: list[str]) -> int:
    start = time.monotonic()
    result = {"build": build, "reference": reference}[argv[0]](*argv[1:])
    result.update(wall_s=time.monotonic() - start, peak_rss_bytes=peak_rss_bytes())
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
