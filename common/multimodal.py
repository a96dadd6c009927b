"""Conventions on multimodal token ids shared by the encoder and the language engine.

Each image's placeholder tokens are replaced by a *pad id* derived from the image's content hash:
the same image always gets the same id, different images (almost surely) different ids, and every
pad id is >= the vocabulary size, so it never collides with a real token. The radix cache keys on
these fill ids, so two prompts share a cached prefix through an image only when it is the same
image. The language engine tells image tokens by ``fill_id >= vocab_size``.
"""

from __future__ import annotations

import numpy as np

PAD_ID_RANGE = 1 << 30  # pad ids lie in [vocab_size, vocab_size + 2**30): int32-safe


def pad_id_for(content_hash: bytes, vocab_size: int) -> int:
    """The fill id of every token of the image whose content hash is ``content_hash``."""
    if not content_hash:
        raise ValueError("empty content hash")
    return vocab_size + int.from_bytes(content_hash[:8], "little") % PAD_ID_RANGE


def image_token_mask(fill_ids: np.ndarray, vocab_size: int) -> np.ndarray:
    """Boolean mask of the image tokens among ``fill_ids``."""
    return np.asarray(fill_ids) >= vocab_size
