"""Radix-cache keys: one ``(fill_id, image_key)`` record per token.

Text tokens are ``(token id, 0)``. Image tokens are ``(pad id, image key)``: the pad id
(``vocab + hash mod 2**30``, see ``common/multimodal.py``) has too few bits to be an image's
identity (a random pair of images collides after ~40k images, and a collision would let one
prompt attend to another image's KV); the image key carries 64 bits of the image's content hash,
so two image tokens match only when both their pad id and their content hash agree.
"""

from __future__ import annotations

import numpy as np

KEY_DTYPE = np.dtype([("fill_id", np.int64), ("image_key", np.int64)])


def make_key(fill_ids, image_keys=None) -> np.ndarray:
    """Records of ``fill_ids`` [L] with their ``image_keys`` [L] (0 everywhere when None)."""
    fill = np.asarray(fill_ids, dtype=np.int64).reshape(-1)
    key = np.zeros(fill.shape[0], dtype=KEY_DTYPE)
    key["fill_id"] = fill
    if image_keys is not None:
        key["image_key"] = np.asarray(image_keys, dtype=np.int64).reshape(-1)
    return key


def check_key(key: np.ndarray) -> np.ndarray:
    """``key`` itself; TypeError unless it is a 1-D array of ``KEY_DTYPE`` records."""
    if not isinstance(key, np.ndarray) or key.dtype != KEY_DTYPE or key.ndim != 1:
        raise TypeError("a radix key is a 1-D array of KEY_DTYPE records (see make_key)")
    return key


def edge_label(record: np.void) -> tuple[int, int]:
    """The hashable label of one record (children are indexed by their first record)."""
    return int(record["fill_id"]), int(record["image_key"])


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    """Number of leading records on which ``a`` and ``b`` agree."""
    n = min(a.shape[0], b.shape[0])
    differ = (a["fill_id"][:n] != b["fill_id"][:n]) | (a["image_key"][:n] != b["image_key"][:n])
    first = np.flatnonzero(differ)
    return int(first[0]) if first.size else n
