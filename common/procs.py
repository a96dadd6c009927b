"""Starting services as child processes and waiting until they are healthy.

Used by ``epd run``, the Ray-free local launcher, and the integration tests, which all start
real processes on 127.0.0.1. Children get their own process group so that stopping one stops
everything it started, and die with their parent even when it is killed (``PR_SET_PDEATHSIG``):
nothing outlives its owner.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Collection, Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.channels import ChannelSecurity, create_channel
from common.drain import READINESS

# Environment every serving process starts with (the caller's own values win).
# NOTE: torch's OpenMP threads spin for milliseconds after each parallel op by default; on a
# small machine that keeps the transfer control threads off the CPU and a control message's
# latency grows from ~0.3 ms to ~3 ms. Passive waiting puts idle threads to sleep at once.
RUNTIME_ENV = {"OMP_WAIT_POLICY": "PASSIVE", "GLOG_minloglevel": "2"}


def runtime_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a serving child process: ``RUNTIME_ENV`` under ours, then ``extra``."""
    return {**RUNTIME_ENV, **os.environ, **(extra or {})}


PR_SET_PDEATHSIG = 1
# Set by ServiceProcess for its child: the pid it must die with (read once, by ``epd``'s main).
PARENT_PID_ENV = "EPD_DIE_WITH_PARENT"


def die_with_parent(parent_pid: int, sig: int = signal.SIGTERM) -> None:
    """In a child process: receive ``sig`` when the parent dies, however it dies.

    NOTE: the signal fires when the *thread* that started the child ends, so start children
    from a thread that lives as long as they should (the main thread here). The parent may
    already be gone before this call; then the child leaves at once.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), sig)


def die_with_parent_from_env(sig: int = signal.SIGTERM) -> None:
    """At a child's start, before anything else: ``die_with_parent`` for the pid that
    ``PARENT_PID_ENV`` names (taken out of the environment, so the child's own children are
    not bound to it)."""
    parent = os.environ.pop(PARENT_PID_ENV, "")
    if parent:
        die_with_parent(int(parent), sig)


def free_port(host: str = "127.0.0.1", avoid: Collection[int] = ()) -> int:
    """A port that is free right now (the usual bind-to-0 trick), none of ``avoid``: ports
    handed to processes that may not have bound them yet, which the kernel can hand out again."""
    for _ in range(1000):
        with socket.socket() as sock:
            sock.bind((host, 0))
            port = sock.getsockname()[1]
        if port not in avoid:
            return port
    raise RuntimeError(f"no free port on {host} outside the {len(avoid)} already handed out")


def check_health(
    address: str,
    timeout_s: float = 1.0,
    service: str = "",
    security: ChannelSecurity | None = None,
) -> bool:
    """True when ``address`` answers grpc.health.v1 Check with SERVING (over TLS when
    ``security`` says so; health needs no bearer secret)."""
    with create_channel(address, security, keepalive=None) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


class ServiceProcess:
    """One ``epd serve ...`` child process, its log file and its gRPC address."""

    def __init__(
        self,
        name: str,
        args: list[str],
        address: str,
        log_dir: Path,
        env: dict[str, str] | None = None,
        security: ChannelSecurity | None = None,
        wrapper: Sequence[str] = (),
    ) -> None:
        """``security``: how to reach the process's gRPC port for health checks; ``wrapper``:
        a command prefix to run it through (``ip netns exec NS``: another "host"; it must exec
        the command, so that the pid stays the child's)."""
        self.name = name
        self.address = address
        self.security = security
        self.log_path = Path(log_dir) / f"{name}.log"
        # NOTE: no preexec_fn: it makes Popen fork, and a fork while gRPC threads run in this
        # process ran gRPC's fork handlers in the child, which sometimes aborted there before the
        # exec ("epoll_wait error: Bad file descriptor", exit -6). The child binds itself to
        # this process first thing instead (``die_with_parent_from_env`` in ``epd``'s main).
        parent = {PARENT_PID_ENV: str(os.getpid())}
        env = runtime_env({"PYTHONUNBUFFERED": "1", **(env or {}), **parent})
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [*wrapper, sys.executable, "-m", "services.cli", *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_healthy(self, timeout_s: float) -> None:
        """Block until the service is ready (its readiness, ``common.drain.READINESS``, is
        SERVING: a gateway turns ready ``--ready-delay-s`` after it started, later than it
        answers at all); raise with the log tail if it dies or stalls."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}):\n{self.tail()}")
            if check_health(self.address, 0.5, READINESS, self.security):
                return
            time.sleep(0.2)
        raise TimeoutError(f"{self.name} not ready after {timeout_s:.0f}s:\n{self.tail()}")

    def tail(self, num_lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])
        except OSError:
            return ""

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the whole process group (used by fault tests: a worker dies)."""
        if self.alive():
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout_s``; always reaps and closes the log."""
        if self.alive():
            self.kill(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill(signal.SIGKILL)
                self.proc.wait(timeout_s)
        self._log.close()


def wait_first_exit(procs: Sequence[ServiceProcess]) -> ServiceProcess:
    """Block until one of ``procs`` exits and return it. A watcher thread per process waits for
    its exit (each ends with its process); the caller's wait still gives way to a signal handler
    that raises (the launchers' SIGTERM and Ctrl-C)."""
    exited: list[ServiceProcess] = []
    done = threading.Event()

    def watch(proc: ServiceProcess) -> None:
        proc.proc.wait()
        exited.append(proc)
        done.set()

    for proc in procs:
        threading.Thread(
            target=watch, args=(proc,), name=f"epd-watch-{proc.name}", daemon=True
        ).start()
    done.wait()
    return exited[0]
