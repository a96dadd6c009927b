"""Turns scheduled chunks into a ``ForwardBatch``, runs the decoder and returns logits."""

from __future__ import annotations

import torch

from services.language.engine.scheduler import ScheduledChunk
from services.language.kvcache.pool import KVPool
from services.language.model.batch import DecodeGroup, ExtendSegment, ForwardBatch
from services.language.model.qwen import QwenTextModel


class ModelRunner:
    def __init__(self, model: QwenTextModel, kv_pool: KVPool, device: torch.device) -> None:
        self.model = model
        self.kv_pool = kv_pool
        self.device = device
        self.dtype = next(model.parameters()).dtype

    def build_batch(self, chunks: list[ScheduledChunk]) -> ForwardBatch:
        """Flat rows in chunk order; logits are returned for chunks with ``sample``."""
        fill_ids, positions, image_rows, out_slots = [], [], [], []
        extends, decode_rows, decode_slots, logit_rows = [], [], [], []
        row = 0
        for chunk in chunks:
            req, num = chunk.req, chunk.end - chunk.start
            fill_ids.append(req.seq_fill_ids(chunk.end)[chunk.start :])
            positions.append(req.positions(chunk.start, chunk.end))
            rows = req.image_rows(chunk.start, chunk.end)
            if rows.shape[0]:
                image_rows.append(rows)
            out_slots.append(req.slots[chunk.start : chunk.end])
            kv_slots = req.slots[: chunk.end]
            if num == 1:
                decode_rows.append(row)
                decode_slots.append(kv_slots)
            else:
                extends.append(ExtendSegment(row, num, kv_slots.to(self.device)))
            if chunk.sample:
                logit_rows.append(row + num - 1)
            row += num
        rows = torch.cat(image_rows) if image_rows else None
        return ForwardBatch(
            fill_ids=torch.cat(fill_ids).to(self.device),
            positions=torch.cat(positions, dim=1).to(self.device),
            image_rows=rows.to(self.device, self.dtype) if rows is not None else None,
            out_slots=torch.cat(out_slots).to(self.device),
            extends=extends,
            decode=self._decode_group(decode_rows, decode_slots),
            logit_rows=torch.tensor(logit_rows, dtype=torch.long, device=self.device),
        )

    def _decode_group(self, rows: list[int], slots: list[torch.Tensor]) -> DecodeGroup | None:
        if not rows:
            return None
        lens = torch.tensor([s.shape[0] for s in slots])
        max_len = int(lens.max())
        padded = torch.zeros(len(rows), max_len, dtype=torch.long)
        for i, s in enumerate(slots):
            padded[i, : s.shape[0]] = s
        mask = torch.arange(max_len)[None, :] < lens[:, None]
        return DecodeGroup(
            q_rows=torch.tensor(rows, dtype=torch.long, device=self.device),
            kv_slots=padded.to(self.device),
            kv_mask=mask[:, None, None, :].to(self.device),
        )

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Logits [num sampled chunks, vocab] (float32, on the CPU)."""
        batch = self.build_batch(chunks)
        logits = self.model(batch, self.kv_pool)
        return logits.float().cpu()
