"""``epd run``: starts the whole stack, answers the demo request, prints a ``curl`` line for
the HTTP API that works as printed, and takes it all down on SIGTERM (nothing it started
outlives it)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from common.procs import free_port


def _services_of(*ports: int) -> list[int]:
    """Pids of live processes started for the stack whose gateway is on ``ports`` (its public
    and registry ports: workers name the registry in ``--gateway``)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "services.cli serve" in cmdline and any(
            f"--port {port}" in cmdline or f"127.0.0.1:{port}" in cmdline for port in ports
        ):
            found.append(int(entry.name))
    return found


class _Output:
    """Everything ``proc`` prints, read line by line by a thread of its own as it comes."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self._lines: list[str] = []
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._pump, args=(proc,), daemon=True)
        self._reader.start()

    def _pump(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            with self._changed:
                self._lines.append(line)
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def until(self, marker: str, timeout_s: float) -> str:
        """What was printed up to the first line with ``marker`` (or the timeout, or its end)."""
        with self._changed:
            self._changed.wait_for(
                lambda: any(marker in line for line in self._lines) or not self._reader.is_alive(),
                timeout_s,
            )
            return "".join(self._lines)

    def all(self, timeout_s: float) -> str:
        """Everything it printed, once its output closed (or the timeout)."""
        self._reader.join(timeout_s)
        with self._changed:
            return "".join(self._lines)


def _read_until(proc: subprocess.Popen, marker: str, timeout_s: float) -> str:
    """What ``proc`` printed up to the first line with ``marker`` (or the timeout, or its end)."""
    return _Output(proc).until(marker, timeout_s)


def test_run_answers_the_demo_and_stops_everything_on_sigterm_even_twice(tmp_path: Path) -> None:
    port, registry_port, http_port = free_port(), free_port(), free_port()
    ports = (port, registry_port)
    epd = Path(sys.executable).parent / "epd"
    command = [str(epd)] if epd.exists() else [sys.executable, "-m", "services.cli"]
    proc = subprocess.Popen(
        [
            *command,
            "run",
            "--gateway-port",
            str(port),
            "--registry-port",
            str(registry_port),
            "--http-port",
            str(http_port),
            "--log-dir",
            str(tmp_path),
        ],  # fmt: skip
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        output = _Output(proc)
        out = output.until("status page:", 240.0)
        assert "answer:" in out and "finish:" in out, out[-3000:]
        assert "serving on" in out, out[-3000:]
        assert f"worker registry on 127.0.0.1:{registry_port}" in out, out[-3000:]
        assert f"status page: http://127.0.0.1:{http_port}/dashboard" in out, out[-3000:]
        # the curl line it prints works as printed
        curl = next(line for line in out.splitlines() if "curl " in line)
        reply = subprocess.run(
            ["sh", "-c", curl[curl.index("curl ") :] + " --silent --max-time 60"],
            capture_output=True,
            text=True,
            timeout=90,
        )
        answer = json.loads(reply.stdout)
        assert answer["object"] == "chat.completion", reply.stdout
        assert answer["choices"][0]["finish_reason"] in ("stop", "length")
        assert answer["usage"]["completion_tokens"] >= 1
        assert len(_services_of(*ports)) == 3  # gateway, encoder, language
        proc.send_signal(signal.SIGTERM)
        proc.send_signal(signal.SIGTERM)  # at once (`timeout` signals the group, make passes it on)
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)  # and one while it stops
        assert proc.wait(timeout=60) == 0
        printed = output.all(30)
        assert "Traceback" not in printed, printed[-3000:]
        deadline = time.monotonic() + 20
        while _services_of(*ports) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _services_of(*ports) == []
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in _services_of(*ports):  # never leave a stack behind, even on failure
            os.kill(pid, signal.SIGKILL)
