"""Accepted message shapes -> domain ``ChatMessage`` objects plus the media in order."""

from __future__ import annotations

from collections.abc import Sequence

from .errors import InvalidInput
from .types import ChatMessage, ContentPart, ImageSource, VideoInput

ROLES = ("system", "user", "assistant")


def normalize_messages(messages: Sequence, images: Sequence = ()) -> tuple[list[ChatMessage], list]:
    """(messages, the image or ``VideoInput`` of every image and video part in order).

    Image parts of ``ChatMessage`` objects carry their image; dict image parts carry
    ``"image"`` or take the next of ``images``. Every entry of ``images`` must be used. Video
    parts carry their ``VideoInput`` (dicts: ``{"type": "video", "video": x}``).
    """
    if not messages:
        raise InvalidInput("request has no messages")
    spare = list(images)
    out: list[ChatMessage] = []
    found: list = []
    for message in messages:
        if isinstance(message, dict):
            message = _from_dict(message, spare)
        if message.role not in ROLES:
            raise InvalidInput(f"unknown role {message.role!r}; expected one of {ROLES}")
        for part in message.content:
            if part.image is not None:
                found.append(part.image)
            elif part.video is not None:
                found.append(part.video)
        out.append(message)
    if spare:
        raise InvalidInput(f"{len(spare)} images were given without an image part to place them")
    return out, found


def _from_dict(message: dict, spare: list) -> ChatMessage:
    content = message.get("content", "")
    if isinstance(content, str):
        content = [{"type": "text", "text": content}]
    parts = []
    for part in content:
        kind = part.get("type")
        if kind == "text":
            parts.append(ContentPart(text=str(part.get("text", ""))))
        elif kind == "image":
            if "image" in part:
                item = part["image"]
            elif spare:
                item = spare.pop(0)
            else:
                raise InvalidInput("more image parts than images")
            parts.append(ContentPart(image=_wrap(item)))
        elif kind == "video":
            item = part.get("video")
            if item is None:
                raise InvalidInput("video part without a video")
            if not isinstance(item, VideoInput):
                item = VideoInput(_wrap(item))
            parts.append(ContentPart(video=item))
        else:
            raise InvalidInput(f"unsupported content part type {kind!r}")
    return ChatMessage(str(message.get("role", "")), tuple(parts))


def _wrap(item):
    """Strings name their source by shape (data URL, http(s) URL, else a path)."""
    if isinstance(item, str):
        if item.startswith("data:"):
            return ImageSource("base64", item)
        if item.startswith(("http://", "https://")):
            return ImageSource("url", item)
        return ImageSource("path", item)
    return item
