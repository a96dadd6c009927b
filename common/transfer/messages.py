"""Encoding and decoding of control envelopes (``protos/epd/v1/transfer.proto``).

``decode`` never raises on bad input: garbage or truncated frames and envelopes of another major
version come back as ``None`` with the reason, so the caller counts them and carries on. Frames
are authenticated (``auth.FrameAuth``) before they are decoded.
"""

from __future__ import annotations

import logging
import re
import time
from typing import NamedTuple

from google.protobuf.message import DecodeError

from protos.epd.v1 import transfer_pb2

from .types import RoomState

logger = logging.getLogger(__name__)

TRANSFER_PROTOCOL_VERSION = 1  # major: bumped only on incompatible changes
# 1: TransferStatus.write_s; 2: TransferInit.dest_token_offset; 3: authenticated frames
# (incarnation, seq, sent_at_ms, to_endpoint, mac), error kinds, init acknowledgements;
# 4: partial chunks (TransferInit.accepts_partial, TransferStatus.partial, mid-room acks);
# 5: TransferClaim (a receiver short of blocks claims its room; unclaimed rooms time out);
# 6: a chunk's token fields and aux record inline in its status (TransferInit.accepts_inline)
TRANSFER_PROTOCOL_MINOR = 6
MINOR_DEST_OFFSETS = 2  # a sender of at least this minor honours TransferInit.dest_token_offset
MINOR_ACKS = 3  # a sender of at least this minor acknowledges an init that waits for data
MINOR_PARTIAL = 4  # a sender of at least this minor may fill one init in several chunks
MINOR_INLINE = 6  # a sender of at least this minor may carry token fields in its status

MAX_ENDPOINT_LEN = 255
VERSION_WARNING_INTERVAL_S = 60.0
_last_version_warning = -VERSION_WARNING_INTERVAL_S
_ENDPOINT = re.compile(r"tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9][A-Za-z0-9.\-]*):([0-9]{1,5})")


class Decoded(NamedTuple):
    envelope: transfer_pb2.TransferEnvelope | None
    error: str  # "" when decoded; else "garbage" | "unknown_version" | "empty"


def envelope(from_endpoint: str, incarnation: int = 0) -> transfer_pb2.TransferEnvelope:
    return transfer_pb2.TransferEnvelope(
        version=TRANSFER_PROTOCOL_VERSION,
        minor_version=TRANSFER_PROTOCOL_MINOR,
        from_endpoint=from_endpoint,
        incarnation=incarnation,
    )


def decode(frame: bytes) -> Decoded:
    msg = transfer_pb2.TransferEnvelope()
    try:
        msg.ParseFromString(frame)
    except (DecodeError, ValueError, RuntimeError):
        return Decoded(None, "garbage")
    if msg.version != TRANSFER_PROTOCOL_VERSION:
        _warn_version(msg.version)
        return Decoded(None, "unknown_version")
    if msg.WhichOneof("body") is None:
        return Decoded(None, "empty")
    return Decoded(msg, "")


def _warn_version(version: int) -> None:
    """Log a foreign major version at most once a minute (every frame is counted anyway)."""
    global _last_version_warning
    now = time.monotonic()
    if now - _last_version_warning >= VERSION_WARNING_INTERVAL_S:
        _last_version_warning = now
        logger.warning(
            "dropping control frames of protocol version %d (this side speaks %d): a peer of "
            "another release? see dropped_unknown_version",
            version,
            TRANSFER_PROTOCOL_VERSION,
        )


def valid_endpoint(endpoint: str) -> bool:
    """``tcp://HOST:PORT`` (a name, IPv4 or bracketed IPv6 address, port 1..65535)."""
    if len(endpoint) > MAX_ENDPOINT_LEN:
        return False
    match = _ENDPOINT.fullmatch(endpoint)
    return match is not None and 0 < int(match.group(2)) < 65536


def state_to_proto(state: RoomState) -> int:
    return int(state)  # TransferState numbers mirror RoomState


def state_from_proto(value: int) -> RoomState | None:
    """The state a peer sent; None for a number outside ``TransferState``."""
    return RoomState(value) if 0 <= value <= RoomState.FAILED else None
