"""Embedding transfer plane: 128-token block buffers, continuation protocol, Mooncake/shm.

The encoder holds an ``EmbeddingSender``, the language worker an ``EmbeddingReceiver``; both
are configured by ``TransferConfig`` and share a ``BufferLayout`` row format. See
``sender.py``/``receiver.py`` for the room flows and ``protos/epd/v1/transfer.proto`` for the
control messages.
"""

from __future__ import annotations

from .allocator import Allocation, AllocatorError, BlockAllocator
from .config import TransferConfig
from .layout import BufferLayout, layout_for
from .receiver import EmbeddingReceiver
from .sender import EmbeddingSender
from .types import (
    AuxInfo,
    FailureKind,
    ReceivedEmbeddings,
    RoomState,
    TransferError,
    TransferWriteError,
)

__all__ = [
    "Allocation",
    "AllocatorError",
    "AuxInfo",
    "BlockAllocator",
    "BufferLayout",
    "EmbeddingReceiver",
    "EmbeddingSender",
    "FailureKind",
    "ReceivedEmbeddings",
    "RoomState",
    "TransferConfig",
    "TransferError",
    "TransferWriteError",
    "layout_for",
]
