"""Value types shared by the sender, the receiver and their callers."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import numpy as np
import torch

MAX_EXTRA_BYTES = 1024


class RoomState(IntEnum):
    """Per-room transfer state on either side.

    Updates only move forward (``BOOTSTRAPPING -> WAITING_FOR_INPUT -> TRANSFERRING -> SUCCESS``);
    ``FAILED`` is reachable from any non-final state and always wins. Sender: BOOTSTRAPPING until
    both the data and the receiver's init are there (WAITING_FOR_INPUT when only the init is).
    Receiver: BOOTSTRAPPING until blocks are allocated and the init is sent, WAITING_FOR_INPUT
    until the first chunk lands, TRANSFERRING while continuations run.
    """

    BOOTSTRAPPING = 0
    WAITING_FOR_INPUT = 1
    TRANSFERRING = 2
    SUCCESS = 3
    FAILED = 4

    @property
    def is_final(self) -> bool:
        return self in (RoomState.SUCCESS, RoomState.FAILED)


def advance(current: RoomState, new: RoomState) -> RoomState:
    """The state after trying to move ``current`` to ``new``: forward only, FAILED wins."""
    if current.is_final:
        return current
    if new == RoomState.FAILED or new > current:
        return new
    return current


class FailureKind(IntEnum):
    """Why a room failed; mirrors ``TransferErrorKind`` in ``transfer.proto`` number for number.

    A failure's text starts with the kind's ``label`` (``"deadline: request deadline passed"``),
    so logs read the same; code reads the kind.
    """

    UNSPECIFIED = 0
    BOOTSTRAP_TIMEOUT = 1
    WAITING_TIMEOUT = 2
    TRANSFER_TIMEOUT = 3
    TIMEOUT = 4
    DEADLINE = 5
    SENDER_DEAD = 6
    RECEIVER_DEAD = 7
    PEER_RESTARTED = 8
    ABORTED = 9
    ENCODE_FAILED = 10
    LAYOUT_MISMATCH = 11
    BAD_INIT = 12
    NO_TRANSPORT = 13
    WRITE_FAILED = 14
    AUX_MISMATCH = 15
    INTERNAL = 16
    CLOSED = 17
    TOO_LARGE = 18

    @property
    def label(self) -> str:
        """The kind's name in ``failed_by_reason`` and at the head of the failure text."""
        return "sender_failed" if self is FailureKind.UNSPECIFIED else self.name.lower()

    def reason(self, detail: str) -> str:
        return f"{self.label}: {detail}"

    @classmethod
    def from_wire(cls, value: int) -> FailureKind:
        """A kind from a peer; numbers this version does not know read as UNSPECIFIED."""
        try:
            return cls(value)
        except ValueError:
            return cls.UNSPECIFIED


@dataclass(frozen=True)
class AuxInfo:
    """Request metadata that travels in the aux record besides the chunk bookkeeping."""

    total_tokens: int  # prompt length
    num_image_rows: int  # image tokens (rows shipped)
    mrope_delta: int = 0
    num_items: int = 0  # images in the request
    extra: bytes = b""  # opaque metadata for the language side, at most MAX_EXTRA_BYTES

    def __post_init__(self) -> None:
        if self.total_tokens <= 0:
            raise ValueError(f"total_tokens must be positive, got {self.total_tokens}")
        if not 0 <= self.num_image_rows <= self.total_tokens:
            raise ValueError(
                f"num_image_rows ({self.num_image_rows}) must be in [0, {self.total_tokens}]"
            )
        if len(self.extra) > MAX_EXTRA_BYTES:
            raise ValueError(f"extra is {len(self.extra)} bytes; at most {MAX_EXTRA_BYTES}")


@dataclass
class ReceivedEmbeddings:
    """A fully assembled request on the language side.

    With ``lent``, ``image_rows`` is a view of the receiver's own blocks (no copy was made):
    it stays valid until the consumer calls ``EmbeddingReceiver.release(room)``. Consumers call
    ``release`` for every delivered room once they are done with it; it is a no-op for a
    copied one.
    """

    fill_ids: np.ndarray  # int32 [total_tokens]
    positions: np.ndarray  # int32 [3, total_tokens] (M-RoPE t/h/w)
    image_rows: torch.Tensor  # [num_image_rows, hidden*(1+num_deepstack)], token order
    aux: AuxInfo
    num_transfers: int  # first + continuations
    lent: bool = False  # image_rows aliases receive blocks until the room is released
    transfer_s: float = 0.0  # first write announced -> last chunk landed (incl. continuations)


@dataclass
class ReceivedChunk:
    """Tokens ``[start, start + len(fill_ids))`` of a room still in flight, copied out of the
    receive blocks as they landed (reported only by a receiver built with ``report_progress``,
    so a consumer can start on a prompt's prefix); the room's outcome is reported after them."""

    start: int
    fill_ids: np.ndarray  # int32 [n]
    positions: np.ndarray  # int32 [3, n]
    image_rows: torch.Tensor  # the image rows of these tokens, in token order
    aux: AuxInfo  # the request's totals (and the sender's metadata so far)


class TransferError(Exception):
    """A room that ended in FAILED: ``kind`` says why, ``reason`` in words (``kind.label: ...``)."""

    def __init__(self, room: int, reason: str, kind: FailureKind = FailureKind.UNSPECIFIED) -> None:
        super().__init__(f"room {room}: {reason}")
        self.room = room
        self.reason = reason
        self.kind = kind


class TransferWriteError(RuntimeError):
    """A transport write returned an error (e.g. a non-zero Mooncake status)."""


class BadDestinationError(TransferWriteError):
    """The destination an init names is not one the transport may write (nothing written)."""
