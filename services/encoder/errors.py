"""Errors the encoder reports to its callers (mapped to gRPC status codes by the servicer)."""

from __future__ import annotations


class InvalidInput(ValueError):
    """The request is wrong (bad image, forbidden source, over a limit): INVALID_ARGUMENT.

    ``item`` is the index of the offending image (or video: ``kind``) in the request, when one
    is to blame.
    """

    def __init__(self, message: str, item: int | None = None, kind: str = "image") -> None:
        prefix = f"{kind} {item}: " if item is not None else ""
        super().__init__(prefix + message)
        self.item = item
        self.kind = kind


class Overloaded(RuntimeError):
    """The encoder's queue is full: RESOURCE_EXHAUSTED (the gateway retries elsewhere)."""


class UnknownRoom(KeyError):
    """No request with this room id is known (never accepted, or forgotten after its TTL)."""


class RoomInUse(ValueError):
    """The room id is already live on this encoder: ALREADY_EXISTS."""


class DeadlineExpired(RuntimeError):
    """The request's deadline passed before its work was done; the room is failed."""


class RequestCancelled(RuntimeError):
    """``Encoder.Cancel`` named the room while its ``Encode`` was still being accepted (its
    video decoding): the work stopped there and the room is failed: CANCELLED."""
