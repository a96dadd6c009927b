"""The one place the language engine touches the transfer plane.

The engine sees an ``EmbeddingSource``. Per request: ``add_room`` with the encoder's endpoint
and the request's deadline; the source calls the listener it was given (``listen``) as soon as a
room's outcome is ready, and the engine thread, woken by it, collects finished rooms with
``pop_done`` as ``PromptInputs`` (or an exception) — and, from a source that reports progress,
each chunk of a room still in flight as a ``PromptChunk`` before it, so the engine prefills a
prompt's first tokens while the rest is encoded or on the wire; ``release`` ends a delivered
room (its image rows may be views of transfer blocks until then) and ``abort`` drops one still
in flight.
Nothing polls: between a room's start and its end the engine thread sleeps.
``ReceiverSource`` adapts ``common.transfer.receiver.EmbeddingReceiver`` to it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from common.transfer.types import ReceivedChunk
from services.language.inputs import PromptChunk, PromptInputs
from services.language.model.config import TextModelConfig

logger = logging.getLogger(__name__)


class EmbeddingSource(Protocol):
    def listen(self, on_ready: Callable[[], None]) -> None:
        """Call ``on_ready`` whenever a room's outcome becomes available to ``pop_done``; it
        runs on the source's own thread and must not block."""
        ...

    def add_room(self, room: int, encoder_endpoint: str, deadline: float | None = None) -> None:
        """Start receiving ``room``; it fails once ``deadline`` (``time.monotonic``) passes."""
        ...

    def pop_done(self) -> list[tuple[int, PromptInputs | PromptChunk | Exception]]:
        """Rooms that ended since the last call, and chunks of rooms in flight (never blocks)."""
        ...

    def abort(self, room: int) -> None: ...

    def release(self, room: int) -> None:
        """The engine is done with delivered ``room``'s inputs (called once per delivery)."""
        ...

    def block_stats(self) -> dict[str, int]:
        """``num_free_blocks``, ``num_used_blocks``, ``num_lent_blocks``, ``num_rooms_lent``."""
        ...


class ReceiverSource:
    """``EmbeddingSource`` over the transfer plane's receiver."""

    def __init__(self, receiver, num_deepstack: int) -> None:
        self.receiver = receiver
        self.num_deepstack = num_deepstack

    def listen(self, on_ready: Callable[[], None]) -> None:
        self.receiver.on_done = on_ready

    def add_room(self, room: int, encoder_endpoint: str, deadline: float | None = None) -> None:
        self.receiver.add_room(room, encoder_endpoint, deadline)

    def pop_done(self) -> list[tuple[int, PromptInputs | PromptChunk | Exception]]:
        done: list[tuple[int, PromptInputs | PromptChunk | Exception]] = []
        for room, result in self.receiver.pop_done():
            if isinstance(result, Exception):
                done.append((room, result))
                continue
            if isinstance(result, ReceivedChunk):
                try:
                    inputs = PromptInputs.from_received(result, self.num_deepstack)
                except Exception as exc:  # malformed: the room's outcome will tell
                    logger.warning("room %d: a chunk could not be taken: %s", room, exc)
                    continue
                done.append((room, PromptChunk(result.start, inputs, result.aux.total_tokens)))
                continue
            try:
                done.append((room, PromptInputs.from_received(result, self.num_deepstack)))
            except Exception as exc:  # a malformed room fails alone
                self.receiver.release(room)
                done.append((room, exc))
        return done

    def abort(self, room: int) -> None:
        self.receiver.abort(room)

    def release(self, room: int) -> None:
        self.receiver.release(room)

    def block_stats(self) -> dict[str, int]:
        stats = self.receiver.stats()
        keys = ("num_free_blocks", "num_used_blocks", "num_lent_blocks", "num_rooms_lent")
        return {key: int(stats[key]) for key in keys}

    def close(self) -> None:
        self.receiver.close()


def create_receiver_source(
    model_config: TextModelConfig, transfer_config=None, prefill_while_receiving: bool = True
) -> ReceiverSource:
    """A receiver for the model's rows in the wire dtype (cast to the model dtype on use);
    with ``prefill_while_receiving`` it reports each chunk of a room as it lands."""
    from common.transfer.config import TransferConfig
    from common.transfer.layout import layout_for
    from common.transfer.receiver import EmbeddingReceiver

    config = transfer_config or TransferConfig()
    layout = layout_for(config, model_config.hidden_size, model_config.num_deepstack)
    receiver = EmbeddingReceiver(config, layout, report_progress=prefill_while_receiving)
    return ReceiverSource(receiver, model_config.num_deepstack)
