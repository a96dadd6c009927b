"""Decode requests split by KV length into padded groups, one SDPA call per group and layer.

A decode step attends each request's one new token to all its cached keys. Requests of one
group are padded to the group's longest (see ``pad_decode_group``), so one long request among
short ones would pad every short one to its length: a 60 s video's 8,700 keys beside fifteen
chats of 100 made the step gather and attend 16 x 8,700 keys where 10,200 are real.

The rule (``group_by_kv_len``): requests sorted by KV length, ascending; the next request joins
the current group unless that would make the group's padded keys exceed its real keys both by
more than ``MAX_PAD_FACTOR`` times and by more than ``PAD_SLACK_KEYS`` keys. Similar lengths
stay one group, so the common step is still one call; each further call costs about as much as
attending a few hundred keys (measured on 2 cores: sixteen requests of 128 keys took the same
time in one call as in two of eight).

The groups are contiguous row ranges of the flat batch, in this order: the runner puts its
decode requests in the sorted order before it builds the batch, and its result lists the
chunks in batch order, so sampling follows the rows without a gather.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.language.model.batch import DecodeGroup, slot_run

MAX_PAD_FACTOR = 1.25  # padded keys / real keys a group may reach
PAD_SLACK_KEYS = 256  # padding a group may hold whatever the factor: less than a call costs


def group_by_kv_len(kv_lens: Sequence[int]) -> list[list[int]]:
    """Indices into ``kv_lens``, grouped: ascending by length (ties in input order), a new
    group where joining the current one would pad too much (see the module doc)."""
    order = sorted(range(len(kv_lens)), key=kv_lens.__getitem__)
    groups: list[list[int]] = []
    real = 0  # the current group's real keys
    for i in order:
        kv_len = kv_lens[i]
        if groups:
            padded = (len(groups[-1]) + 1) * kv_len  # ascending: ``kv_len`` is the longest
            waste = padded - (real + kv_len)
            if padded <= MAX_PAD_FACTOR * (real + kv_len) or waste <= PAD_SLACK_KEYS:
                groups[-1].append(i)
                real += kv_len
                continue
        groups.append([i])
        real = kv_len
    return groups


def pad_decode_group(
    row_start: int, slots: list[torch.Tensor], dtype: torch.dtype, device: torch.device
) -> DecodeGroup:
    """The group of the requests whose KV slots are ``slots`` (rows ``row_start`` on), padded
    on the left to the longest: a pad repeats the request's own first slot (always written,
    masked out), never a slot another request or nobody wrote. Left padding keeps each
    request's newest slot, the one this step writes, in the last column. A group whose requests
    are all of one length (one request alone, a long one's usual case) has no pads and no mask."""
    if all(s.shape[0] == slots[0].shape[0] for s in slots):
        run = slot_run(slots[0]) if len(slots) == 1 else None
        return DecodeGroup(row_start, torch.stack(slots).to(device), kv_run=run)
    lens = torch.tensor([s.shape[0] for s in slots])
    max_len = int(lens.max())
    flat = torch.cat(slots)
    firsts = flat[lens.cumsum(0) - lens]
    padded = firsts[:, None].expand(-1, max_len).clone()
    real = torch.arange(max_len)[None, :] >= (max_len - lens)[:, None]
    padded[real] = flat  # the row-major order of ``real`` is the order of ``flat``
    bias = torch.zeros(real.shape, dtype=dtype).masked_fill_(~real, float("-inf"))
    return DecodeGroup(
        row_start=row_start,
        kv_slots=padded.to(device),
        kv_bias=bias[:, None, None, :].to(device),
    )
