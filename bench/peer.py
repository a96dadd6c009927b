"""A sender or receiver hosted in its own process, driven by commands over a pipe.

Used by the integration tests and the benchmark to put the two ends in separate processes
(``multiprocessing`` spawn). The child answers each ``(command, *args)`` with
``("ok", value)`` or ``("error", repr)``; ``"kill"`` exits at once without cleanup (a crash).
With ``netns`` the child first moves into that network namespace (``ip netns add NAME``; root
only): the peer is then on another "host" (``tests/hosts``).
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import os
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import torch

from bench.synthetic import RequestSpec, make_request, matches
from common.procs import runtime_env
from common.transfer.config import TransferConfig
from common.transfer.layout import BufferLayout

CLONE_NEWNET = 0x40000000


def enter_netns(name: str) -> None:
    """Move this process into the named network namespace (before it opens any socket)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns({name}) failed")
    finally:
        os.close(fd)


def _serve(
    conn: Connection, role: str, config: TransferConfig, layout: BufferLayout, netns: str = ""
) -> None:
    if netns:
        enter_netns(netns)
    os.environ.setdefault("GLOG_minloglevel", "2")
    from common.transfer.receiver import EmbeddingReceiver
    from common.transfer.sender import EmbeddingSender

    side = (EmbeddingSender if role == "sender" else EmbeddingReceiver)(config, layout)
    handler = _Handler(side)
    conn.send(("ok", side.endpoint))
    while True:
        try:
            command, *args = conn.recv()
        except EOFError:
            command, args = "close", []
        if command == "kill":
            os._exit(1)
        try:
            conn.send(("ok", getattr(handler, command)(*args)))
        except Exception as exc:  # reported to the parent, the peer keeps serving
            conn.send(("error", repr(exc)))
        if command == "close":
            return


class _Handler:
    def __init__(self, side: Any) -> None:
        self.side = side

    def submit(self, spec: RequestSpec, timeout_s: float = 0.0) -> bool:
        """Submit a synthetic request; retry while blocks are short for up to ``timeout_s``."""
        req = make_request(spec, self.side.layout)
        deadline = time.monotonic() + timeout_s
        while True:
            args = (req.fill_ids, req.positions, req.image_rows, req.aux, req.image_mask)
            if self.side.submit(spec.seed, *args):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)

    def begin(self, spec: RequestSpec, num_rows: int) -> bool:
        """Begin a synthetic request with its first ``num_rows`` image rows (``add_rows`` the
        rest), the way an encoder ships image by image."""
        req = make_request(spec, self.side.layout)
        args = (req.fill_ids, req.positions, req.aux, req.image_mask)
        return self.side.begin(spec.seed, *args, image_rows=req.image_rows[:num_rows])

    def add_rows(self, spec: RequestSpec, start: int, end: int) -> None:
        """Rows ``[start, end)`` of a begun synthetic request."""
        req = make_request(spec, self.side.layout)
        self.side.add_rows(spec.seed, req.image_rows[start:end])

    def submit_all(self, specs: list[RequestSpec]) -> bool:
        return all(self.submit(spec, 10.0) for spec in specs)

    def call(self, method: str, *args: Any) -> Any:
        value = getattr(self.side, method)(*args)
        return int(value) if method == "poll" else value

    def wait_idle(self, timeout_s: float) -> dict:
        """Stats once no blocks are used and no room is active (or at the timeout)."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats = self.side.stats()
            if (not stats["rooms_active"] and stats["num_used_blocks"] == 0) or (
                time.monotonic() >= deadline
            ):
                return stats
            time.sleep(0.01)

    def receive(self, specs: list[RequestSpec], sender: str, timeout_s: float) -> dict:
        """Add rooms, wait for all of them; per room "ok", "mismatch" or the failure reason."""
        start = time.perf_counter()
        for spec in specs:
            self.side.add_room(spec.seed, sender)
        results = self._collect({s.seed for s in specs}, timeout_s)
        elapsed = time.perf_counter() - start
        outcome: dict[int, Any] = {}
        for spec in specs:
            got = results.get(spec.seed)
            if got is None:
                outcome[spec.seed] = "missing"
            elif isinstance(got, Exception):
                outcome[spec.seed] = got.reason
            elif matches(got, make_request(spec, self.side.layout)):
                outcome[spec.seed] = ("ok", got.num_transfers)
            else:
                outcome[spec.seed] = "mismatch"
            self.side.release(spec.seed)
        return {"elapsed_s": elapsed, "rooms": outcome}

    def pop_outcomes(self, timeout_s: float) -> list[tuple[int, str]]:
        """Rooms that ended since the last call: ``(room, "ok" | failure reason)``."""
        done = self.side.pop_done(timeout_s=timeout_s)
        return [(room, getattr(result, "reason", "ok")) for room, result in done]

    def _collect(self, rooms: set[int], timeout_s: float) -> dict:
        results: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        while len(results) < len(rooms) and time.monotonic() < deadline:
            for room, result in self.side.pop_done(timeout_s=0.05):
                results[room] = result
        return results

    def raw_write(self, session: str, dst_addr: int, nbytes: int, repeats: int) -> list[float]:
        """Times (s) of a plain single-region write of ``nbytes`` from our rows region.

        Before each write the source bytes are replaced by fresh ones, copied in the way
        ``submit`` copies a request in: the baseline moves newly produced data, as the protocol
        does, not the same cache-hot bytes again and again.
        """
        src = self.side.buffers.base("rows")
        region = self.side.buffers.regions["rows"].data
        times = []
        for _ in range(repeats):
            fresh = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
            ctypes.memmove(region.data_ptr(), fresh.data_ptr(), nbytes)
            start = time.perf_counter()
            if session.startswith("shm:"):
                self.side.shm.write(session[4:], [src], [dst_addr], [nbytes])
            else:
                self.side.mooncake.write_one(session, src, dst_addr, nbytes)
            times.append(time.perf_counter() - start)
        return times

    def raw_target(self) -> dict:
        region = self.side.buffers.regions["rows"]
        session = self.side.mooncake.session_id if self.side.mooncake else ""
        return {
            "session": session,
            "base": region.base,
            "nbytes": region.nbytes,
            "shm_name": region.shm_name,
        }

    def close(self) -> bool:
        self.side.close()
        return True


@contextlib.contextmanager
def _environment(env: dict[str, str]) -> Iterator[None]:
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


class Peer:
    """Parent-side handle of a peer process (started with the serving ``runtime_env``)."""

    def __init__(
        self, role: str, config: TransferConfig, layout: BufferLayout, netns: str = ""
    ) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        args = (child, role, config, layout, netns)
        self.process = ctx.Process(target=_serve, args=args, daemon=True)
        with _environment(runtime_env()):  # a spawned child takes our environment at start
            self.process.start()
        child.close()
        self.endpoint: str = self._reply(120.0)

    def _reply(self, timeout_s: float) -> Any:
        if not self._conn.poll(timeout_s):
            raise TimeoutError("peer process did not answer")
        status, value = self._conn.recv()
        if status != "ok":
            raise RuntimeError(f"peer command failed: {value}")
        return value

    def ask(self, command: str, *args: Any, timeout_s: float = 120.0) -> Any:
        self._conn.send((command, *args))
        return self._reply(timeout_s)

    def kill(self) -> None:
        self._conn.send(("kill",))
        self.process.join(10)

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self.ask("close", timeout_s=30.0)
            except (TimeoutError, OSError, EOFError, RuntimeError):
                pass
            self.process.join(10)
            if self.process.is_alive():
                self.process.kill()
        self._conn.close()
