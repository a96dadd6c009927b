"""``common.procs.wait_first_exit``: the launcher's wait for the first of its services to end."""

from __future__ import annotations

import signal
import time

import pytest

from common.procs import ServiceProcess, free_port, wait_first_exit


def _gateway(tmp_path) -> ServiceProcess:
    port, registry = free_port(), free_port()
    args = ["serve", "gateway", "--port", str(port), "--registry-port", str(registry)]
    return ServiceProcess("gateway", args, f"127.0.0.1:{port}", tmp_path)


def test_the_first_process_to_exit_is_returned(tmp_path):
    gateway = _gateway(tmp_path)
    short = ServiceProcess("short", ["--help"], "", tmp_path)
    try:
        start = time.monotonic()
        assert wait_first_exit([gateway, short]) is short
        assert not short.alive() and gateway.alive()
        assert time.monotonic() - start < 60
    finally:
        gateway.stop()
        short.stop()


class _Stop(Exception):
    pass


def _raise_stop(signum, frame):
    raise _Stop


def test_the_wait_gives_way_to_a_signal_handler_that_raises(tmp_path):
    gateway = _gateway(tmp_path)
    previous = signal.signal(signal.SIGALRM, _raise_stop)
    signal.setitimer(signal.ITIMER_REAL, 0.5)
    try:
        with pytest.raises(_Stop):
            wait_first_exit([gateway])
        assert gateway.alive()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        gateway.stop()


def test_a_stack_never_hands_out_a_port_twice():
    """Bind-to-0 may return a port again before the process given it has bound it (two servers
    on one port: one of them fails to start); a stack's ports are all distinct, and
    ``free_port`` skips the ones it is told to avoid."""
    from services.local_stack import LocalStack

    stack = LocalStack()
    ports = [stack.new_port() for _ in range(300)]
    assert len(set(ports)) == 300 and stack.ports == set(ports)
    taken = set(ports[:50])
    assert all(free_port(avoid=taken) not in taken for _ in range(100))
