"""Child processes of the peer benchmark that die with it: vLLM's server and aiperf.

They run in other venvs' pythons, so ``common.procs.die_with_parent_from_env`` (which ``epd``'s
own main calls) is not there to call. Instead a small trampoline, run by the child's own
python, asks the kernel for ``PR_SET_PDEATHSIG`` (SIGTERM when this process dies, however it
dies) and then ``exec``s the real command: the setting survives ``exec``, and no ``preexec_fn``
runs in a parent that may have gRPC threads (see ``common.procs.ServiceProcess``). Each child
leads a process group of its own, so that stopping it stops everything it started.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import IO

# Runs in the child's python: die with the given parent (SIGTERM), then become the command.
TRAMPOLINE = (
    "import ctypes, os, shutil, signal, sys\n"
    "if ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0) != 0:\n"
    "    raise SystemExit('prctl(PR_SET_PDEATHSIG) failed')\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    raise SystemExit('parent already gone')\n"
    "os.execv(shutil.which(sys.argv[2]) or sys.argv[2], sys.argv[2:])\n"
)


def spawn(
    python: Path,
    argv: Sequence[str],
    log: IO[bytes],
    env: dict[str, str],
    cwd: Path,
) -> subprocess.Popen:
    """Start ``argv`` (its first item a path) through ``python``'s trampoline, in a new
    session, stdout and stderr to ``log``."""
    return subprocess.Popen(
        [str(python), "-c", TRAMPOLINE, str(os.getpid()), *map(str, argv)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=cwd,
        start_new_session=True,
    )


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    """``sig`` to ``proc``'s process group (which outlives its leader while members live)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def stop_group(proc: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM to the group, SIGKILL to whatever is left of it after ``timeout_s`` (or once
    the leader has exited); reaps the leader."""
    if proc.poll() is None:
        signal_group(proc, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout_s)
    signal_group(proc, signal.SIGKILL)
    proc.wait()
