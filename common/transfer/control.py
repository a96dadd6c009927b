"""ZMQ control channel: one PULL socket bound per side, a bounded table of PUSH sockets.

Messages are one-way; a reply goes to the ``from_endpoint`` of the envelope. Sends never block
(``NOBLOCK``; a full or unreachable peer drops the message and the room's timeouts take over)
and are serialised by a lock so any thread may send; the lock also keeps each frame's ``seq``
in the order frames enter their socket. Only the owner's loop thread receives.

Bounds: a frame over ``MAX_FRAME_BYTES`` never reaches the owner (``zmq.MAXMSGSIZE``: libzmq
closes the connection that carried it, and a real peer's socket reconnects by itself); at most
``max_peers`` PUSH sockets are open (the least recently used is closed first) and one unused for
``idle_s`` is closed at the next send or ``close_idle``. Sockets are only opened for endpoints
the owner decided to answer, i.e. after the frame naming them was authenticated.

``recv`` sleeps in ``zmq.Poller`` until a frame comes, the timeout passes, another thread
calls ``wake`` (a byte on a pipe the poller also watches) or the alarm goes off: there is no
periodic tick. The alarm (``set_alarm``, Linux: a ``timerfd`` the poller watches) lets any
thread move the owner's next wake-up earlier without waking it now: a room added to a sleeping
loop would otherwise cost a thread switch on the path of every small room, only to re-plan.
Where no timerfd can be made, ``alarm`` is False and the owner wakes the loop instead.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import math
import os
import threading
import time

import zmq

from protos.epd.v1 import transfer_pb2

from .auth import FrameAuth

logger = logging.getLogger(__name__)

MAX_FRAME_BYTES = 64 * 1024  # control frames are small; an init is the largest
MAX_INIT_BLOCKS = 16_000  # block ids one init may list (at most ~48 KiB of them)
MAX_FRAMES_PER_RECV = 1024  # so timers are looked at between bursts
CLOSE_LINGER_MS = 200  # a socket closed for the bound or idleness still sends what it queued


class ControlChannel:
    def __init__(
        self, host: str, port: int, auth: FrameAuth, max_peers: int = 256, idle_s: float = 60.0
    ) -> None:
        self._auth = auth
        self._max_peers = max_peers
        self._idle_s = idle_s
        self._ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        try:
            if port:
                self._pull.bind(f"tcp://{host}:{port}")
                bound_port = port
            else:
                bound_port = self._pull.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError as exc:
            self._pull.close()
            self._ctx.term()
            raise OSError(f"cannot bind transfer control port {host}:{port}: {exc}") from None
        self.endpoint = f"tcp://{host}:{bound_port}"
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poller = zmq.Poller()
        self._poller.register(self._pull, zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)
        self._alarm = _Alarm.create()
        if self._alarm is not None:
            self._poller.register(self._alarm.fd, zmq.POLLIN)
        # endpoint -> (socket, last use), least recently used first
        self._push: collections.OrderedDict[str, tuple[zmq.Socket, float]] = (
            collections.OrderedDict()
        )
        self._send_lock = threading.Lock()
        self._seq = 0
        self.num_dropped_sends = 0
        self.num_sockets_closed = 0

    def send(self, endpoint: str, message: transfer_pb2.TransferEnvelope) -> bool:
        """Stamp (seq, time, destination), seal and queue ``message``; False when dropped."""
        with self._send_lock:
            if self._pull.closed:  # shutting down: a writer's last status goes nowhere
                return False
            now = time.monotonic()
            self._seq += 1
            message.seq = self._seq
            message.sent_at_ms = int(time.time() * 1000)
            message.to_endpoint = endpoint
            frame = self._auth.seal(message.SerializeToString())
            sock = self._socket(endpoint, now)
            try:
                sock.send(frame, zmq.NOBLOCK)
                return True
            except zmq.Again:
                self.num_dropped_sends += 1
                return False

    def _socket(self, endpoint: str, now: float) -> zmq.Socket:
        entry = self._push.pop(endpoint, None)
        self._close_idle(now)
        if entry is None:
            while len(self._push) >= self._max_peers:
                _, (old, _) = self._push.popitem(last=False)
                self._close(old)
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 10000)
            sock.connect(endpoint)
        else:
            sock = entry[0]
        self._push[endpoint] = (sock, now)
        return sock

    def _close_idle(self, now: float) -> None:
        while self._push:
            endpoint, (sock, last_used) = next(iter(self._push.items()))
            if now - last_used < self._idle_s:
                return
            del self._push[endpoint]
            self._close(sock)

    def _close(self, sock: zmq.Socket) -> None:
        sock.close(CLOSE_LINGER_MS)
        self.num_sockets_closed += 1

    def reconnect(self, endpoint: str) -> None:
        """Close the socket to ``endpoint``, so that the next send opens a new connection.

        For a peer that went silent: during a partition the kernel backs off the
        retransmissions of the connection's unacknowledged bytes (0.2 s, 0.4 s, ... doubling),
        so after a cut of a few seconds the link returns long before the old connection
        carries anything again (measured across namespaces: new rooms with the peer failed as
        silent for ~3 s after a 4 s cut); a new connection's handshake goes out at once.
        """
        with self._send_lock:
            entry = self._push.pop(endpoint, None)
            if entry is not None:
                self._close(entry[0])

    def close_idle(self) -> None:
        with self._send_lock:
            self._close_idle(time.monotonic())

    @property
    def num_sockets(self) -> int:
        with self._send_lock:
            return len(self._push)

    def wake(self) -> None:
        """Make a ``recv`` in progress (or the next one) return at once; any thread."""
        try:
            os.write(self._wake_w, b"\0")
        except (BlockingIOError, OSError):
            pass  # the pipe is full (a wake-up is already pending) or closed

    @property
    def alarm(self) -> bool:
        """Whether ``set_alarm`` works (else the owner sleeps with a timeout and ``wake``s)."""
        return self._alarm is not None

    def set_alarm(self, due: float | None) -> None:
        """Make ``recv`` return at ``time.monotonic()`` time ``due`` (None: disarm); it replaces
        the previous alarm. Any thread; the caller serialises calls (the owner's lock)."""
        assert self._alarm is not None
        self._alarm.set(due)

    def recv(self, timeout_ms: int | None) -> list[bytes]:
        """Frames that arrived within ``timeout_ms`` (None: no limit), all that are queued up to
        ``MAX_FRAMES_PER_RECV``; an empty list after a timeout, a ``wake`` or the alarm."""
        events = dict(self._poller.poll(timeout_ms))
        if self._alarm is not None and self._alarm.fd in events:
            self._alarm.clear()
        if self._wake_r in events:
            try:
                while os.read(self._wake_r, 4096):
                    pass
            except BlockingIOError:
                pass
        frames: list[bytes] = []
        if self._pull not in events:
            return frames
        while len(frames) < MAX_FRAMES_PER_RECV:
            try:
                frames.append(self._pull.recv(zmq.NOBLOCK))
            except zmq.Again:
                break
        return frames

    def close(self) -> None:
        """Close every socket and the pipe; a second call does nothing."""
        with self._send_lock:
            if self._pull.closed:
                return
            for sock, _ in self._push.values():
                sock.close(0)
            self._push.clear()
            self._pull.close(0)
            self._ctx.term()
            os.close(self._wake_r)
            os.close(self._wake_w)
            if self._alarm is not None:
                self._alarm.close()


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


class _Alarm:
    """A one-shot ``timerfd`` on CLOCK_MONOTONIC (``time.monotonic()``'s clock on Linux): it
    becomes readable at the time it was set to, absolute, until read."""

    CLOCK_MONOTONIC = 1
    TFD_NONBLOCK = os.O_NONBLOCK
    TFD_CLOEXEC = getattr(os, "O_CLOEXEC", 0o2000000)
    TFD_TIMER_ABSTIME = 1

    def __init__(self, libc: ctypes.CDLL, fd: int) -> None:
        self._libc = libc
        self.fd = fd
        self._spec = _Itimerspec()

    @classmethod
    def create(cls) -> _Alarm | None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = libc.timerfd_create(cls.CLOCK_MONOTONIC, cls.TFD_NONBLOCK | cls.TFD_CLOEXEC)
        except (OSError, AttributeError):  # not Linux
            return None
        if fd < 0:
            errno = ctypes.get_errno()
            logger.info("no timerfd (errno %d): control loops are woken by a pipe", errno)
            return None
        return cls(libc, fd)

    def set(self, due: float | None) -> None:
        value = self._spec.it_value
        if due is None or not math.isfinite(due):
            value.tv_sec = value.tv_nsec = 0  # disarmed
        else:
            ns = max(1, int(due * 1e9))  # all zero would disarm it
            value.tv_sec, value.tv_nsec = divmod(ns, 1_000_000_000)
        spec = ctypes.byref(self._spec)
        if self._libc.timerfd_settime(self.fd, self.TFD_TIMER_ABSTIME, spec, None):
            raise OSError(ctypes.get_errno(), "timerfd_settime failed")

    def clear(self) -> None:
        try:
            os.read(self.fd, 8)
        except BlockingIOError:
            pass

    def close(self) -> None:
        os.close(self.fd)
