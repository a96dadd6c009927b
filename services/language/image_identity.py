"""Which image each image token of a prompt belongs to, for the radix key.

The encoder writes, in the aux record's ``extra`` JSON, one content hash (hex, >= 16 digits) and
one token count per image, in prompt order: ``{"hashes": [...], "tokens": [...], ...}``.
``image_keys`` checks them against the prompt (the next ``tokens`` image tokens carry the pad id
derived from that hash; a video is one item whose tokens may lie in several runs) and gives
every image token its image's 64-bit key.
When the hashes are missing or do not fit the prompt, the prompt's image tokens get a fresh
random key instead: they then match nothing cached before, never a different image's KV.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass

import numpy as np

from common.multimodal import pad_id_for

MIN_HASH_HEX_DIGITS = 16  # 64 bits


@dataclass(frozen=True)
class ImageRef:
    """One image of a prompt: its content hash's first 64 bits and its number of tokens."""

    digest: bytes  # the first 8 bytes of the content hash
    num_tokens: int

    @property
    def key(self) -> int:
        """The image key of its tokens (a signed int64)."""
        return int.from_bytes(self.digest, "little", signed=True)


def images_within(
    images: tuple[ImageRef, ...] | None, num_image_tokens: int
) -> tuple[ImageRef, ...] | None:
    """The images (the last one cut short) whose tokens are the first ``num_image_tokens``
    image tokens of a prompt: what ``image_keys`` needs for a prefix of it."""
    if images is None:
        return None
    out: list[ImageRef] = []
    for ref in images:
        if num_image_tokens <= 0:
            break
        out.append(ImageRef(ref.digest, min(ref.num_tokens, num_image_tokens)))
        num_image_tokens -= ref.num_tokens
    return tuple(out)


def parse_images(extra: bytes) -> tuple[ImageRef, ...] | None:
    """The images described by the encoder's aux ``extra`` JSON; None when absent or malformed."""
    try:
        meta = json.loads(extra) if extra else None
    except ValueError:
        return None
    if not isinstance(meta, dict):
        return None
    hashes, tokens = meta.get("hashes"), meta.get("tokens")
    if not isinstance(hashes, list) or not isinstance(tokens, list) or len(hashes) != len(tokens):
        return None
    refs = []
    for digest_hex, num_tokens in zip(hashes, tokens, strict=True):
        if not isinstance(digest_hex, str) or len(digest_hex) < MIN_HASH_HEX_DIGITS:
            return None
        if not isinstance(num_tokens, int) or num_tokens <= 0:
            return None
        try:
            int(digest_hex, 16)
        except ValueError:
            return None
        refs.append(ImageRef(bytes.fromhex(digest_hex[:MIN_HASH_HEX_DIGITS]), num_tokens))
    return tuple(refs)


def _random_key() -> int:
    return int.from_bytes(secrets.token_bytes(8), "little", signed=True) or 1


def image_keys(
    fill_ids: np.ndarray, vocab_size: int, images: tuple[ImageRef, ...] | None
) -> tuple[np.ndarray, str]:
    """Per token: 0 for text, the image's key for image tokens. Also the reason the images did
    not fit the prompt ("" when they did), in which case image tokens got a fresh random key."""
    fill_ids = np.asarray(fill_ids, dtype=np.int64)
    keys = np.zeros(fill_ids.shape[0], dtype=np.int64)
    where = np.flatnonzero(fill_ids >= vocab_size)
    if where.size == 0:
        return keys, ""
    problem = _assign(keys, fill_ids, where, vocab_size, images)
    if problem:
        keys[where] = _random_key()
    return keys, problem


def _assign(
    keys: np.ndarray,
    fill_ids: np.ndarray,
    where: np.ndarray,
    vocab_size: int,
    images: tuple[ImageRef, ...] | None,
) -> str:
    if images is None:
        return "no image hashes came with the prompt"
    covered = sum(ref.num_tokens for ref in images)
    if covered != where.size:
        return f"image hashes cover {covered} tokens, the prompt has {where.size} image tokens"
    start = 0
    for i, ref in enumerate(images):
        # NOTE: an item's tokens may lie in several runs (a Qwen3-VL video: its frame groups
        # separated by timestamp text); each carries the pad id of the item's hash.
        run = where[start : start + ref.num_tokens]
        if not (fill_ids[run] == pad_id_for(ref.digest, vocab_size)).all():
            return f"the pad id of image {i} does not derive from its hash"
        keys[run] = ref.key
        start += ref.num_tokens
    return ""
