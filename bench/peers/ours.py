"""Our stack for the peer benchmark: gateway + encoder + language worker on 127.0.0.1.

``start_local_stack`` (what every benchmark here uses) with the gateway's HTTP API on a free
port, the same checkpoint as vLLM and the same dtype given explicitly to both workers
(``--dtype``), on the CPU (``--device cpu``: vLLM's CPU build is the peer, so neither side gets
a GPU even on a machine that has one).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from services.local_stack import LocalStack, start_local_stack

STARTUP_TIMEOUT_S = 300.0
QUIET_ENV = {"GLOG_minloglevel": "2", "MC_LOG_LEVEL": "ERROR"}


def worker_args(dtype: str) -> tuple[str, ...]:
    """The arguments both workers get."""
    return ("--dtype", dtype, "--device", "cpu")


@contextlib.contextmanager
def ours_serving(
    model_dir: Path, dtype: str, log_dir: Path, timeout_s: float = STARTUP_TIMEOUT_S
) -> Iterator[LocalStack]:
    """A healthy stack serving HTTP for the ``with`` block (``stack.http_url``), stopped when
    it ends (each process's log tail goes to stderr when the block fails)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    stack = start_local_stack(
        model_dir,
        log_dir,
        http_port=0,
        worker_args=worker_args(dtype),
        env=QUIET_ENV,
        startup_timeout_s=timeout_s,
    )
    with stack.serving():
        yield stack
