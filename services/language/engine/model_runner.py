"""Turns scheduled chunks into a ``ForwardBatch``, runs the decoder and returns logits.

Each chunk's inputs are gathered on their own: a chunk whose inputs cannot be built (a bad
prompt) is left out of the batch and reported in ``RunResult.failed``, so it fails its request
alone. An exception from the forward itself (device, model) propagates: the whole batch failed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from services.language.engine.scheduler import ScheduledChunk
from services.language.kvcache.pool import KVPool
from services.language.model.batch import DecodeGroup, ExtendSegment, ForwardBatch
from services.language.model.qwen import QwenTextModel


@dataclass
class ChunkInputs:
    """What one chunk contributes to the flat batch (CPU tensors)."""

    chunk: ScheduledChunk
    fill_ids: torch.Tensor  # long [n]
    positions: torch.Tensor  # long [3, n]
    image_rows: torch.Tensor  # [k, row width], k image tokens among the n
    out_slots: torch.Tensor  # long [n]
    kv_slots: torch.Tensor  # long [chunk.end]: every token the chunk attends to


@dataclass
class RunResult:
    chunks: list[ScheduledChunk]  # the chunks that ran, in batch order
    logits: torch.Tensor  # [number of sampled chunks among them, vocab], float32 on the CPU
    failed: list[tuple[ScheduledChunk, Exception]] = field(default_factory=list)


def gather_inputs(chunk: ScheduledChunk) -> ChunkInputs:
    req = chunk.req
    return ChunkInputs(
        chunk=chunk,
        fill_ids=req.seq_fill_ids(chunk.end)[chunk.start :],
        positions=req.positions(chunk.start, chunk.end),
        image_rows=req.image_rows(chunk.start, chunk.end),
        out_slots=req.slots[chunk.start : chunk.end],
        kv_slots=req.slots[: chunk.end],
    )


class ModelRunner:
    def __init__(self, model: QwenTextModel, kv_pool: KVPool, device: torch.device) -> None:
        self.model = model
        self.kv_pool = kv_pool
        self.device = device
        self.dtype = next(model.parameters()).dtype

    def build_batch(self, parts: list[ChunkInputs]) -> ForwardBatch:
        """Flat rows in chunk order; logits are returned for chunks with ``sample``."""
        extends, decode_rows, decode_slots, logit_rows = [], [], [], []
        row = 0
        for part in parts:
            num = part.chunk.end - part.chunk.start
            if num == 1:
                decode_rows.append(row)
                decode_slots.append(part.kv_slots)
            else:
                extends.append(ExtendSegment(row, num, part.kv_slots.to(self.device)))
            if part.chunk.sample:
                logit_rows.append(row + num - 1)
            row += num
        # NOTE: received rows are in the wire dtype (bf16 by default): cast to the model's here.
        image_rows = [p.image_rows.to(self.dtype) for p in parts if p.image_rows.shape[0]]
        rows = torch.cat(image_rows).to(self.device) if image_rows else None
        return ForwardBatch(
            fill_ids=torch.cat([p.fill_ids for p in parts]).to(self.device),
            positions=torch.cat([p.positions for p in parts], dim=1).to(self.device),
            image_rows=rows,
            out_slots=torch.cat([p.out_slots for p in parts]).to(self.device),
            extends=extends,
            decode=self._decode_group(decode_rows, decode_slots),
            logit_rows=torch.tensor(logit_rows, dtype=torch.long, device=self.device),
        )

    def _decode_group(self, rows: list[int], slots: list[torch.Tensor]) -> DecodeGroup | None:
        """Decode requests padded to the longest; a pad repeats the request's own first slot
        (always written, masked out), never a slot another request or nobody wrote."""
        if not rows:
            return None
        lens = torch.tensor([s.shape[0] for s in slots])
        max_len = int(lens.max())
        padded = torch.stack([s[:1].expand(max_len) for s in slots]).clone()
        for i, s in enumerate(slots):
            padded[i, : s.shape[0]] = s
        mask = torch.arange(max_len)[None, :] < lens[:, None]
        return DecodeGroup(
            q_rows=torch.tensor(rows, dtype=torch.long, device=self.device),
            kv_slots=padded.to(self.device),
            kv_mask=mask[:, None, None, :].to(self.device),
        )

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk]) -> RunResult:
        """Gather each chunk's inputs (a failure drops that chunk), then one forward."""
        parts, failed = [], []
        for chunk in chunks:
            try:
                parts.append(gather_inputs(chunk))
            except Exception as exc:  # this request's inputs are bad; the others go on
                failed.append((chunk, exc))
        if not parts:
            return RunResult([], torch.zeros(0, 0), failed)
        logits = self.model(self.build_batch(parts), self.kv_pool)
        return RunResult([p.chunk for p in parts], logits.float().cpu(), failed)
