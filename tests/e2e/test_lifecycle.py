"""Process lifecycle: children die with their parent, ports are exclusive, failures are one line.

Every process here is real: ``epd run`` and ``epd serve`` started the way a user (or a pod)
starts them.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from common.procs import ServiceProcess, free_port
from tests.e2e.test_run import _read_until, _services_of


def _epd(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "services.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **kw.pop("env", {})},
        **kw,
    )


def _wait_gone(pids_of, timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (pids := pids_of()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return pids


def test_services_die_with_a_killed_epd_run(tiny_model_dir, tmp_path: Path) -> None:
    """SIGKILL leaves no handler to run: the children must go by themselves (PDEATHSIG)."""
    port, registry_port = free_port(), free_port()
    ports = (port, registry_port)
    model = str(tiny_model_dir("qwen2_vl"))
    proc = _epd("run", "--model-path", model, "--gateway-port", str(port), "--registry-port",
                str(registry_port), "--log-dir", str(tmp_path), "--max-tokens", "4")  # fmt: skip
    try:
        out = _read_until(proc, "serving on", 240.0)
        assert "serving on" in out, out[-3000:]
        assert len(_services_of(*ports)) == 3
        proc.kill()
        proc.wait(10)
        assert _wait_gone(lambda: _services_of(*ports), 30) == []
        # the port is free again (as servers bind: SO_REUSEADDR, past TIME_WAIT connections)
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", port))
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in _services_of(*ports):
            os.kill(pid, signal.SIGKILL)


def test_a_busy_port_is_a_one_line_startup_error() -> None:
    """grpcio's default SO_REUSEPORT would let a second server share the port silently."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        free_registry = ["--registry-port", "0"]
        for role_args in (
            ["serve", "gateway", "--port", str(port), *free_registry],
            ["serve", "gateway", "--port", "0", "--registry-port", str(port)],
            ["serve", "gateway", "--port", "0", *free_registry, "--metrics-port", str(port)],
        ):
            proc = _epd(*role_args)
            out, _ = proc.communicate(timeout=60)
            assert proc.returncode == 2, out
            assert "Traceback" not in out, out
            assert f"127.0.0.1:{port}" in out or f"0.0.0.0:{port}" in out, out


def test_two_gateways_cannot_share_a_port(tmp_path: Path) -> None:
    port = free_port()
    first = _epd("serve", "gateway", "--port", str(port), "--registry-port", "0")
    try:
        out = _read_until(first, "listening", 60.0)
        assert "listening" in out, out
        second = _epd("serve", "gateway", "--port", str(port), "--registry-port", "0")
        out2, _ = second.communicate(timeout=60)
        assert second.returncode == 2 and f"{port}" in out2 and "Traceback" not in out2, out2
    finally:
        first.terminate()
        first.wait(20)


def _tgkill(pid: int, tid: int, sig: int) -> None:
    """Send ``sig`` to one thread (``tid``) of process ``pid``."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.tgkill(pid, tid, int(sig)) != 0:
        raise OSError(ctypes.get_errno(), f"tgkill({pid}, {tid})")


def test_a_sigterm_taken_by_any_thread_drains_and_exits(tmp_path: Path) -> None:
    """The kernel may hand a process's SIGTERM to any of its threads; Python runs the handler
    in the main thread only. A gateway whose gRPC thread took it must still drain and exit."""
    port = free_port()
    args = ["serve", "gateway", "--port", str(port), "--registry-port", "0",
            "--drain-timeout-s", "30"]  # fmt: skip
    gateway = ServiceProcess("gateway", args, f"127.0.0.1:{port}", tmp_path)
    try:
        gateway.wait_healthy(60)
        threads = sorted(int(t) for t in os.listdir(f"/proc/{gateway.proc.pid}/task"))
        assert len(threads) > 1, threads
        _tgkill(gateway.proc.pid, threads[-1], signal.SIGTERM)  # not the main thread (tid pid)
        assert gateway.proc.wait(30) == 0, gateway.tail()
        assert "drained in" in gateway.log_path.read_text(), gateway.tail()
    finally:
        gateway.stop()


def test_a_failed_demo_is_one_line(tiny_model_dir, tmp_path: Path) -> None:
    """The encoder refuses the demo prompt (too long for it): ``epd run --once`` says so in one
    line and exits with status 1, taking the stack down."""
    port, registry_port = free_port(), free_port()
    model = str(tiny_model_dir("qwen2_vl"))
    proc = _epd("run", "--once", "--model-path", model, "--gateway-port", str(port),
                "--registry-port", str(registry_port), "--log-dir", str(tmp_path),
                env={"EPD_ENCODER_MAX_PROMPT_TOKENS": "16"})  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    failed = [line for line in out.splitlines() if "demo request failed" in line]
    assert len(failed) == 1 and "INVALID_ARGUMENT" in failed[0], out[-3000:]
    assert _wait_gone(lambda: _services_of(port, registry_port), 30) == []
