"""Book-keeping of one room on the sender (encoder) side."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from protos.epd.v1 import transfer_pb2

from .allocator import Allocation
from .types import AuxInfo, RoomState, advance


@dataclass
class SenderRoom:
    room: int
    state: RoomState = RoomState.BOOTSTRAPPING
    deadline: float = 0.0  # timeout of the current state (monotonic seconds)
    allocation: Allocation | None = None  # our blocks holding the request (after submit)
    aux: AuxInfo | None = None
    row_prefix: np.ndarray | None = None  # image rows before each token, length total + 1
    init: transfer_pb2.TransferInit | None = None  # an init not yet served
    receiver_endpoint: str = ""
    sent_tokens: int = 0
    num_transfers: int = 0
    writing: bool = False  # a write job owns the room; blocks are freed when it returns
    ack_pending: bool = False  # tell the receiver once the in-flight write has returned
    reason: str = ""

    @property
    def has_data(self) -> bool:
        return self.allocation is not None

    def move(self, state: RoomState) -> None:
        self.state = advance(self.state, state)

    def fail(self, reason: str) -> bool:
        """Mark FAILED; False when the room already ended."""
        if self.state.is_final:
            return False
        self.state = RoomState.FAILED
        self.reason = reason
        return True


def image_row_prefix(mask: np.ndarray) -> np.ndarray:
    prefix = np.zeros(len(mask) + 1, dtype=np.int64)
    np.cumsum(mask, out=prefix[1:])
    return prefix
