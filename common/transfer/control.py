"""ZMQ control channel: one PULL socket bound per side, one PUSH socket per peer.

Messages are one-way; a reply goes to the ``from_endpoint`` of the envelope. Sends never block
(``NOBLOCK``; a full or unreachable peer drops the message and the room's timeouts take over)
and are serialised by a lock so any thread may send. Only the owner's loop thread receives.
"""

from __future__ import annotations

import threading

import zmq

from protos.epd.v1 import transfer_pb2


class ControlChannel:
    def __init__(self, host: str, port: int) -> None:
        self._ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
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
        self._poller = zmq.Poller()
        self._poller.register(self._pull, zmq.POLLIN)
        self._push: dict[str, zmq.Socket] = {}
        self._send_lock = threading.Lock()
        self.num_dropped_sends = 0

    def send(self, endpoint: str, message: transfer_pb2.TransferEnvelope) -> bool:
        return self.send_raw(endpoint, message.SerializeToString())

    def send_raw(self, endpoint: str, frame: bytes) -> bool:
        with self._send_lock:
            sock = self._push.get(endpoint)
            if sock is None:
                sock = self._ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDHWM, 10000)
                sock.connect(endpoint)
                self._push[endpoint] = sock
            try:
                sock.send(frame, zmq.NOBLOCK)
                return True
            except zmq.Again:
                self.num_dropped_sends += 1
                return False

    def recv(self, timeout_ms: int) -> list[bytes]:
        """Frames that arrived within ``timeout_ms`` (all that are queued, without waiting more)."""
        frames: list[bytes] = []
        if not self._poller.poll(timeout_ms):
            return frames
        while True:
            try:
                frames.append(self._pull.recv(zmq.NOBLOCK))
            except zmq.Again:
                return frames

    def close(self) -> None:
        with self._send_lock:
            for sock in self._push.values():
                sock.close(0)
            self._push.clear()
            self._pull.close(0)
            self._ctx.term()
