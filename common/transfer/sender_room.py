"""Book-keeping of one room on the sender (encoder) side.

A room is created by whichever comes first: the encoder's ``expect`` (announcing the request's
deadline), its ``submit`` (the data) or the receiver's init. ``deadline`` bounds the current
state (see the table in docs/protocol.md); ``request_deadline`` bounds every state of an
announced room.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from protos.epd.v1 import transfer_pb2

from .allocator import Allocation
from .types import AuxInfo, FailureKind, RoomState, advance


@dataclass
class SenderRoom:
    room: int
    state: RoomState = RoomState.BOOTSTRAPPING
    deadline: float = math.inf  # timeout of the current state (monotonic seconds)
    request_deadline: float = math.inf  # from expect(): data or failure comes before it
    allocation: Allocation | None = None  # our blocks holding the request (after submit)
    aux: AuxInfo | None = None
    row_prefix: np.ndarray | None = None  # image rows before each token, length total + 1
    init: transfer_pb2.TransferInit | None = None  # the init being served (None: none held)
    init_written: int = 0  # tokens of ``init`` written so far (several chunks: minor 4)
    next_init: transfer_pb2.TransferInit | None = None  # a continuation that came ahead
    num_rows_ready: int = 0  # image rows in our blocks (the encoder ships image by image)
    held_at: int = -1  # sent_tokens when we last told the receiver we hold its init
    receiver_endpoint: str = ""
    receiver_incarnation: int = 0  # of the receiver process that sent the first init
    sent_tokens: int = 0
    num_transfers: int = 0
    writing: bool = False  # a write job owns the room (queued or running)
    write_started: bool = False  # the job left the queue: the transport may read our blocks
    ack_pending: bool = False  # tell the receiver once the in-flight write has returned
    reason: str = ""
    kind: FailureKind = FailureKind.UNSPECIFIED

    @property
    def has_data(self) -> bool:
        return self.allocation is not None

    @property
    def ready_tokens(self) -> int:
        """Tokens from the start whose image rows are all in our blocks."""
        if self.row_prefix is None:
            return 0
        return int(np.searchsorted(self.row_prefix, self.num_rows_ready, side="right")) - 1

    @property
    def expected(self) -> bool:
        """The encoder announced the room's deadline (``EmbeddingSender.expect``)."""
        return math.isfinite(self.request_deadline)

    def move(self, state: RoomState) -> None:
        self.state = advance(self.state, state)

    def fail(self, kind: FailureKind, reason: str) -> bool:
        """Mark FAILED; False when the room already ended."""
        if self.state.is_final:
            return False
        self.state = RoomState.FAILED
        self.kind = kind
        self.reason = reason
        return True


def image_row_prefix(mask: np.ndarray) -> np.ndarray:
    prefix = np.zeros(len(mask) + 1, dtype=np.int64)
    np.cumsum(mask, out=prefix[1:])
    return prefix
