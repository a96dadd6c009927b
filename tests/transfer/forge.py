"""Hand-made control frames from a socket of the test's own: forged, replayed, mis-signed.

``Forger`` plays a third process on the control plane. It builds envelopes exactly as a peer
would (``messages.envelope`` + the ``ControlChannel`` stamps), signs them with a secret of its
choice (or none), pushes raw frames at an endpoint and can listen for replies on a PULL socket
of its own (``sink``), so a test sees what the endpoint answered, if anything.
"""

from __future__ import annotations

import itertools
import os
import time

import zmq

from common.transfer import messages
from common.transfer.auth import FrameAuth
from protos.epd.v1 import transfer_pb2


class Forger:
    def __init__(self, secret: bytes | None = None) -> None:
        self._ctx = zmq.Context()
        self.sink = self._ctx.socket(zmq.PULL)
        self.sink.setsockopt(zmq.LINGER, 0)
        port = self.sink.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.incarnation = int.from_bytes(os.urandom(8), "little") | 1
        self._seq = itertools.count(1)
        self._auth = FrameAuth(secret, 10.0)
        self._push: dict[str, zmq.Socket] = {}

    def envelope(self, to: str, **stamps) -> transfer_pb2.TransferEnvelope:
        """An envelope from us to ``to``, stamped like a real peer's (override with ``stamps``)."""
        env = messages.envelope(self.endpoint, self.incarnation)
        env.seq = next(self._seq)
        env.sent_at_ms = int(time.time() * 1000)
        env.to_endpoint = to
        for key, value in stamps.items():
            setattr(env, key, value)
        return env

    def seal(self, env: transfer_pb2.TransferEnvelope) -> bytes:
        return self.sign(env.SerializeToString())

    def sign(self, payload: bytes) -> bytes:
        """The frame for envelope bytes: with the MAC trailer when we hold a secret."""
        return self._auth.seal(payload)

    def push(self, endpoint: str, *frames: bytes) -> None:
        sock = self._push.get(endpoint)
        if sock is None:
            sock = self._push[endpoint] = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 2000)
            sock.connect(endpoint)
        for frame in frames:
            sock.send(frame)

    def replies(self, timeout_s: float = 0.5) -> list[transfer_pb2.TransferEnvelope]:
        """Envelopes the sink received, until none came for ``timeout_s`` (a MAC trailer
        parses as the ``mac`` field)."""
        got = []
        while self.sink.poll(int(timeout_s * 1000)):
            decoded = messages.decode(self.sink.recv())
            assert decoded.envelope is not None, decoded.error
            got.append(decoded.envelope)
        return got

    def close(self) -> None:
        for sock in self._push.values():
            sock.close()
        self.sink.close(0)
        self._ctx.term()
