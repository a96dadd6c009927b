"""Authentication of control frames: an HMAC-SHA256 trailer and a replay guard.

With a secret, a frame is ``E || 0x7A 0x20 || HMAC-SHA256(secret, E)``: ``E`` is the serialized
``TransferEnvelope`` and the trailer is its field 15 (``mac``, 32 bytes) encoded last, so the
MAC covers every byte a parser reads and needs no canonical re-serialization. A frame is acted
on only when

1. its trailer is there and the MAC matches (``hmac.compare_digest``), else ``unauthenticated``;
2. ``to_endpoint`` is this endpoint, else ``misdirected`` (a frame captured on its way to one
   peer is useless at another);
3. ``sent_at_ms`` is within ``window_s`` of our wall clock, else ``stale``;
4. ``(incarnation, seq)`` was not seen before, else ``replayed``. Each sending process numbers
   its frames; ``ReplayGuard`` remembers the highest number per incarnation and which of the
   ``REPLAY_WINDOW`` numbers below it arrived (frames to one peer travel one ordered socket, so
   in practice they only ever move forward).

Only a frame that passed all four may create a control socket, a room or a reply. Without a
secret (development) frames carry no trailer and none of these checks run; a trailer from a peer
that has one is then read as an ignored field.
"""

from __future__ import annotations

import collections
import hmac
import time

from common.secret_files import check_not_placeholder
from protos.epd.v1 import transfer_pb2

MAC_TAG = b"\x7a\x20"  # field 15, length-delimited, 32 bytes
MAC_BYTES = 32
TRAILER_BYTES = len(MAC_TAG) + MAC_BYTES
MIN_SECRET_BYTES = 16
MAX_SECRET_BYTES = 4096
REPLAY_WINDOW = 1024  # sequence numbers below the highest that are still tracked
MAX_INCARNATIONS = 4096  # peers' process lives remembered by the replay guard (LRU)


def load_secret(path: str) -> bytes:
    """The secret held in the file at ``path`` (trailing newlines dropped); ValueError, naming
    the file but never its content, when it cannot be read or is too short or too long."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_SECRET_BYTES + 2)
    except OSError as exc:
        raise ValueError(f"secret_file {path!r} cannot be read: {exc.strerror}") from None
    check_not_placeholder(path, data.decode("utf-8", errors="replace"))
    secret = data.rstrip(b"\r\n")
    if not MIN_SECRET_BYTES <= len(secret) <= MAX_SECRET_BYTES:
        raise ValueError(
            f"secret_file {path!r} holds {len(secret)} bytes; the transfer secret must have "
            f"{MIN_SECRET_BYTES}..{MAX_SECRET_BYTES} bytes"
        )
    return secret


class ReplayGuard:
    """Which ``(incarnation, seq)`` pairs were accepted, within a sliding window per sender."""

    def __init__(self) -> None:
        self._seen: collections.OrderedDict[int, list[int]] = collections.OrderedDict()

    def accept(self, incarnation: int, seq: int) -> bool:
        """True (and remembered) the first time a pair comes; False for a repeat or a number
        more than ``REPLAY_WINDOW`` below the highest seen from that incarnation."""
        if seq <= 0:
            return False
        entry = self._seen.get(incarnation)
        if entry is None:
            self._seen[incarnation] = [seq, 1]
            while len(self._seen) > MAX_INCARNATIONS:
                self._seen.popitem(last=False)
            return True
        self._seen.move_to_end(incarnation)
        highest, mask = entry
        if seq > highest:
            shift = seq - highest
            entry[0] = seq
            entry[1] = (
                ((mask << shift) | 1) & ((1 << REPLAY_WINDOW) - 1) if shift < REPLAY_WINDOW else 1
            )
            return True
        behind = highest - seq
        if behind >= REPLAY_WINDOW or mask >> behind & 1:
            return False
        entry[1] = mask | 1 << behind
        return True


class FrameAuth:
    """Seals outgoing frames and checks incoming ones (see the module docstring)."""

    def __init__(self, secret: bytes | None, window_s: float) -> None:
        self._secret = secret or None
        self._window_ms = window_s * 1000.0
        self._replays = ReplayGuard()

    @property
    def enabled(self) -> bool:
        return self._secret is not None

    def _mac(self, payload: bytes) -> bytes:
        assert self._secret is not None
        return hmac.digest(self._secret, payload, "sha256")  # one-shot, in OpenSSL

    def seal(self, payload: bytes) -> bytes:
        """The frame for a serialized envelope: itself, plus the MAC trailer with a secret."""
        if self._secret is None:
            return payload
        return payload + MAC_TAG + self._mac(payload)

    def open(self, frame: bytes) -> bytes | None:
        """The envelope bytes of an authentic frame (every frame without a secret), else None."""
        if self._secret is None:
            return frame
        if len(frame) < TRAILER_BYTES or frame[-TRAILER_BYTES:-MAC_BYTES] != MAC_TAG:
            return None
        payload = frame[:-TRAILER_BYTES]
        if not hmac.compare_digest(self._mac(payload), frame[-MAC_BYTES:]):
            return None
        return payload

    def check(self, envelope: transfer_pb2.TransferEnvelope, own_endpoint: str) -> str:
        """Why an authentic envelope must still be dropped ("" when it is fresh); the caller
        holds the lock that serialises receiving."""
        if self._secret is None:
            return ""
        if envelope.to_endpoint != own_endpoint:
            return "misdirected"
        if abs(time.time() * 1000.0 - envelope.sent_at_ms) > self._window_ms:
            return "stale"
        if not self._replays.accept(envelope.incarnation, envelope.seq):
            return "replayed"
        return ""
