"""The source of an image or a video part at the gateway: one of data, base64, path or url,
set, not empty, and within its size bound (nothing is fetched or decoded here)."""

from __future__ import annotations

import math
from collections.abc import Callable

DATA_URL_PREFIX_CHARS = 256  # room for "data:image/png;base64," and the like


def base64_chars(num_bytes: int) -> int:
    """The base64 text of ``num_bytes`` bytes, with MIME line breaks (2 characters per 76) and a
    data-URL prefix."""
    chars = 4 * math.ceil(num_bytes / 3)
    return chars + 2 * math.ceil(chars / 76) + DATA_URL_PREFIX_CHARS


def validate_source(
    media, where: str, max_bytes: int, max_ref_chars: int, invalid: Callable[[str], Exception]
) -> None:
    """Raise ``invalid(msg)`` naming ``where`` when ``media`` (an ``ImageSource``) has no source,
    an empty one, one longer than its bound (``max_bytes`` of data, their base64 text, or
    ``max_ref_chars`` of path or URL), or a NUL in a path or URL."""
    source = media.WhichOneof("source")
    if source is None:
        raise invalid(f"{where} has no source (set data, base64, path or url)")
    value = getattr(media, source)
    if not value:
        raise invalid(f"{where}.{source} is empty")
    if source == "data":
        bound, unit = max_bytes, "bytes"
    elif source == "base64":
        bound, unit = base64_chars(max_bytes), "characters"
    else:
        bound, unit = max_ref_chars, "characters"
        if "\x00" in value:
            raise invalid(f"{where}.{source} must not contain NUL characters")
    if len(value) > bound:
        raise invalid(
            f"{where}.{source} is {len(value)} {unit}, more than the limit of {bound} {unit}"
        )
