"""Encoding and decoding of control envelopes (``protos/epd/v1/transfer.proto``).

``decode`` never raises on bad input: garbage or truncated frames and envelopes of another major
version come back as ``None`` with the reason, so the caller counts them and carries on.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

from google.protobuf.message import DecodeError

from protos.epd.v1 import transfer_pb2

from .types import RoomState

logger = logging.getLogger(__name__)

TRANSFER_PROTOCOL_VERSION = 1  # major: bumped only on incompatible changes
TRANSFER_PROTOCOL_MINOR = 2  # 1: TransferStatus.write_s; 2: TransferInit.dest_token_offset
MINOR_DEST_OFFSETS = 2  # a sender of at least this minor honours TransferInit.dest_token_offset


class Decoded(NamedTuple):
    envelope: transfer_pb2.TransferEnvelope | None
    error: str  # "" when decoded; else "garbage" | "unknown_version" | "empty"


def envelope(from_endpoint: str) -> transfer_pb2.TransferEnvelope:
    return transfer_pb2.TransferEnvelope(
        version=TRANSFER_PROTOCOL_VERSION,
        minor_version=TRANSFER_PROTOCOL_MINOR,
        from_endpoint=from_endpoint,
    )


def decode(frame: bytes) -> Decoded:
    msg = transfer_pb2.TransferEnvelope()
    try:
        msg.ParseFromString(frame)
    except (DecodeError, ValueError, RuntimeError):
        return Decoded(None, "garbage")
    if msg.version != TRANSFER_PROTOCOL_VERSION:
        logger.error(
            "dropping control message of protocol version %d (this side speaks %d)",
            msg.version,
            TRANSFER_PROTOCOL_VERSION,
        )
        return Decoded(None, "unknown_version")
    if msg.WhichOneof("body") is None:
        return Decoded(None, "empty")
    return Decoded(msg, "")


def state_to_proto(state: RoomState) -> int:
    return int(state)  # TransferState numbers mirror RoomState


def state_from_proto(value: int) -> RoomState:
    return RoomState(value)
