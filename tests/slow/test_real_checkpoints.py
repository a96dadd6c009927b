"""Real-size checkpoints serve as they come from the Hub (``make test-slow``).

For each architecture a random checkpoint with the published shapes (``real``: Qwen2-VL-2B,
Qwen2.5-VL-3B, Qwen3-VL-2B) or with their widths and 4+4 layers (``bench``, the benchmark
model) is written the Hub's way (bf16 shards with an index, Hub keys and config layout) by the
builder in a child process, served by the whole stack (gateway, encoder and language worker as
processes), and the greedy tokens must equal transformers' monolithic ``generate`` on the same
checkpoint. The reference runs in a child after the stack has stopped, so the machine never
holds both copies of the model.

Printed per run: the builder's peak RSS against the checkpoint's size, and for each service
and the reference its startup time and peak RSS (``VmHWM``) against the bytes of the weights it
holds (fp32 on CPU: twice the stored bf16 bytes). A run is skipped, saying so, when this machine
has too little memory or disk available for it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from common.models.hub_checkpoint import tensor_plan, weight_bytes
from common.models.hub_config import hub_config
from common.models.tiny import hub_spec
from common.procs import check_health
from services.local_stack import start_local_stack
from tests.conftest import ARCHS
from tests.e2e.conftest import Stack, noise_image, png_bytes
from tests.slow.child import peak_rss_bytes

REQUESTS = [
    {"prompt": "Describe the image.", "images": [[7, 112, 84]]},
    {"prompt": "Describe the image.", "images": [[8, 112, 84]]},
    {"prompt": "Write a short poem about the sea.", "images": []},
]
MAX_TOKENS = 6
STARTUP_S = 900.0
REQUEST_TIMEOUT_S = 900.0
# NOTE: image rows cross the wire in fp32 here. The default bf16 wire rounds them, and at real
# widths that alone can flip a greedy token a few steps in (seen on Qwen3-VL's deepstack rows),
# so token equality with the fp32 monolithic model is only a fair check with an fp32 wire.
# 8192-token transfer buffers: the default 65536 would be 2.1 GB per side for Qwen3-VL-2B rows
# (2048 x 4 with deepstack) in fp32, more than the vision tower's weights.
TRANSFER_TOKENS = 64 * 128
ENV = {"EPD_TRANSFER_DTYPE": "float32", "EPD_TRANSFER_NUM_BLOCKS": str(TRANSFER_TOKENS // 128)}
CASES = [(arch, size) for size in ("bench", "real") for arch in ARCHS]
GB = 1e9


class MeasuredStack(Stack):
    """A stack that records when each worker first answers its health check."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.started = time.monotonic()
        self.ready_s: dict[str, float] = {}
        self._done = threading.Event()
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        while not self._done.wait(0.2):
            for proc in self.procs:  # the worker lists fill while the stack starts
                if proc.name not in self.ready_s and check_health(proc.address, 0.5):
                    self.ready_s[proc.name] = time.monotonic() - self.started

    def stop(self) -> None:
        self._done.set()
        super().stop()


def run_child(*args: object) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "tests.slow.child", *map(str, args)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def available_memory() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize(("arch", "size"), CASES)
def test_hub_checkpoint_serves_like_transformers(arch, size, tmp_path, capsys) -> None:
    spec = hub_spec(arch, size)
    stored = sum(t.nbytes for t, _ in tensor_plan(hub_config(spec), torch.bfloat16))
    # fp32 copies of every weight (the stack's services, later the reference) plus runtimes
    need = 2 * stored + 3 * GB
    if (available := available_memory()) < need:
        pytest.skip(f"{spec.name} needs {need / GB:.1f} GB of memory, {available / GB:.1f} free")
    if shutil.disk_usage(tmp_path).free < stored + GB:
        pytest.skip(f"{spec.name} needs {(stored + GB) / GB:.1f} GB of free disk")

    model_dir = tmp_path / "model"
    built = run_child("build", arch, size, model_dir)
    sizes = weight_bytes(model_dir)
    assert sizes["total"] == stored

    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    stack = start_local_stack(
        model_dir, log_dir, env=ENV, startup_timeout_s=STARTUP_S, stack_cls=MeasuredStack
    )
    with stack.serving():
        with stack.client() as client:
            replies = [
                client.generate(
                    r["prompt"],
                    [png_bytes(noise_image(*image)) for image in r["images"]],
                    max_tokens=MAX_TOKENS,
                    timeout=REQUEST_TIMEOUT_S,
                )
                for r in REQUESTS
            ]
        stack.wait_no_leaks()
        peaks = {proc.name: peak_rss_bytes(proc.proc.pid) for proc in stack.procs}
    reference = run_child("reference", model_dir, json.dumps(REQUESTS), MAX_TOKENS)

    # bytes each process holds by design: fp32 weights, and each worker's fp32 transfer buffer
    row_bytes = 4 * spec.hidden_size * (1 + spec.num_deepstack)
    held = {
        "encoder-0": (2 * sizes["visual"], TRANSFER_TOKENS * row_bytes),
        "language-0": (2 * sizes["text"], TRANSFER_TOKENS * row_bytes),
    }
    num_shards = len(list(model_dir.glob("*.safetensors")))
    lines = [
        f"{spec.name}: {sizes['total'] / GB:.2f} GB bf16 in {num_shards} shards; built in "
        f"{built['wall_s']:.0f} s, builder peak RSS {built['peak_rss_bytes'] / GB:.2f} GB",
        f"  {'process':<12}{'ready s':>8}{'peak RSS':>10}{'weights':>9}{'buffers':>9}"
        f"{'rest':>7}{'peak/weights':>14}  (GB)",
    ]
    rows = [(name, stack.ready_s.get(name, float("nan")), peaks[name], *held.get(name, (0, 0)))
            for name in peaks]  # fmt: skip
    rows.append(("reference", reference["load_s"], reference["peak_rss_bytes"], 2 * stored, 0))
    for name, ready, peak, weights, buffers in rows:
        ratio = f"{peak / weights:.2f}" if weights else "-"
        rest = peak - weights - buffers
        lines.append(
            f"  {name:<12}{ready:>8.1f}{peak / GB:>10.2f}{weights / GB:>9.2f}"
            f"{buffers / GB:>9.2f}{rest / GB:>7.2f}{ratio:>14}"
        )
    with capsys.disabled():
        print("\n" + "\n".join(lines), flush=True)

    tokens = [list(reply.token_ids) for reply in replies]
    assert tokens == reference["tokens"]
    assert tokens[0] != tokens[1]  # the image decides the answer at real widths too
    # streamed, never the whole model in memory
    assert built["peak_rss_bytes"] < 1.5 * GB
    for name, (weights, buffers) in held.items():  # one copy of the weights, not two
        assert peaks[name] < 1.3 * weights + buffers + 2 * GB, (name, peaks[name], weights)
