"""The model processes' allocator (``common/allocator.py``), measured by what it changes: page
faults and resident memory, each in a fresh process (a preloaded library is chosen at start)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from common.allocator import TCMALLOC, find_tcmalloc, with_allocator

LIBRARY = find_tcmalloc()
needs_tcmalloc = pytest.mark.skipif(LIBRARY is None, reason=f"{TCMALLOC} is not installed")

ROUNDS = textwrap.dedent(
    """
    import json, resource, threading
    import torch
    from common.allocator import allocator_line, release_free_memory

    NUMEL = 21 << 20  # 84 MB of fp32: above every mmap threshold glibc picks by itself
    out = {"line": allocator_line()}

    def rss_mb():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 / 2**20

    def rounds():  # on a thread of its own, as the ViT and the engine run
        faults = []
        for _ in range(4):
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            x = torch.empty(NUMEL).fill_(1.0)
            del x
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        out["faults"] = faults
        out["rss_kept"] = rss_mb()
        release_free_memory()
        out["rss_released"] = rss_mb()

    thread = threading.Thread(target=rounds)
    thread.start()
    thread.join()
    print(json.dumps(out))
    """
)
PAGES = (21 << 20) * 4 // 4096  # the tensor's pages


def clean_env() -> dict:
    return {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}


def run(env: dict) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", ROUNDS], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


@needs_tcmalloc
def test_tcmalloc_reuses_a_threads_large_tensors_and_releases_them_when_asked():
    kept = run({**clean_env(), "LD_PRELOAD": LIBRARY})
    assert kept["line"].startswith("allocator: tcmalloc"), kept
    assert kept["faults"][0] > PAGES // 2  # the first one faults its pages in ...
    assert max(kept["faults"][1:]) < PAGES // 20, kept  # ... the next ones reuse them
    assert kept["rss_kept"] - kept["rss_released"] > 50, kept  # kept until released


def test_the_c_librarys_malloc_maps_every_large_tensor_afresh():
    default = run({**clean_env(), "LD_PRELOAD": ""})
    assert default["line"].startswith("allocator: the C library's malloc"), default
    assert all(f > PAGES // 2 for f in default["faults"]), default


@needs_tcmalloc
def test_restart_keeps_the_process_and_preloads_once():
    code = (
        "import os, sys; from common.allocator import restart_with_allocator; "
        "restart_with_allocator(); print(os.getpid(), os.environ['LD_PRELOAD'], sys.argv)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "an-argument"],
        stdout=subprocess.PIPE,
        text=True,
        env=clean_env(),
    )
    out, _ = proc.communicate(timeout=60)
    assert out.splitlines() == [f"{proc.pid} {LIBRARY} ['-c', 'an-argument']"]


def test_an_operators_own_preload_wins(tmp_path):
    assert with_allocator({"PATH": "/bin"}, "/lib/t.so") == {
        "PATH": "/bin",
        "LD_PRELOAD": "/lib/t.so",
    }
    assert with_allocator({"LD_PRELOAD": ""}, "/lib/t.so") is None  # the C library's, asked for
    assert with_allocator({"PATH": "/bin"}, None) is None  # not installed
    assert find_tcmalloc((str(tmp_path),)) is None
    (tmp_path / TCMALLOC).write_bytes(b"")
    assert find_tcmalloc((str(tmp_path),)) == str(tmp_path / TCMALLOC)
