"""The ``extra`` JSON of a room's transfer aux record: what the language side learns per image.

``{"hashes": ["<32 hex>", ...], "tokens": [n, ...], "hits": k, "encode_s": s}`` (no spaces):

* ``hashes``: each image's full cache key (xxh3-128 over pixels, preprocessing and model
  revision: 32 hex digits), in prompt order. The language worker keys its radix cache with them,
  so they are never shortened or dropped;
* ``tokens``: the image tokens of each image, in prompt order;
* ``hits``: images served from the embedding cache; ``encode_s``: ViT seconds (at most
  ``MAX_ENCODE_S``, 6 decimals).

The record holds ``MAX_EXTRA_BYTES``; ``max_images_that_fit`` is how many images' worth always
fits, and the encoder's config refuses a ``max_images`` beyond it, so every admitted request's
record is complete.
"""

from __future__ import annotations

import json

from common.transfer.types import MAX_EXTRA_BYTES

HASH_HEX_DIGITS = 32
MAX_ENCODE_S = 999_999.999999


def encode_extra(hashes: list[str], tokens: list[int], hits: int, encode_s: float) -> bytes:
    """The record's ``extra`` bytes; ``ValueError`` if they would not fit (config validation
    keeps that from happening)."""
    info = {
        "hashes": hashes,
        "tokens": tokens,
        "hits": hits,
        "encode_s": round(min(max(encode_s, 0.0), MAX_ENCODE_S), 6),
    }
    data = json.dumps(info, separators=(",", ":")).encode()
    if len(data) > MAX_EXTRA_BYTES:
        raise ValueError(
            f"aux extra of {len(hashes)} images is {len(data)} bytes, more than {MAX_EXTRA_BYTES}"
        )
    return data


def extra_size_bound(num_images: int, max_tokens: int) -> int:
    """The longest ``extra`` of ``num_images`` images of at most ``max_tokens`` tokens each."""
    info = {
        "hashes": ["0" * HASH_HEX_DIGITS] * num_images,
        "tokens": [max_tokens] * num_images,
        "hits": num_images,
        "encode_s": MAX_ENCODE_S,
    }
    return len(json.dumps(info, separators=(",", ":")).encode())


def max_images_that_fit(max_tokens: int) -> int:
    """The most images whose ``extra`` always fits ``MAX_EXTRA_BYTES``."""
    num = 0
    while extra_size_bound(num + 1, max_tokens) <= MAX_EXTRA_BYTES:
        num += 1
    return num
