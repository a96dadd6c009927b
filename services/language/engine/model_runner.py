"""Turns scheduled chunks into a ``ForwardBatch``, runs the decoder and returns logits.

Decode tokens (one generated token each) come first in the flat batch and are gathered for all
requests at once from plain Python values: per-request tensor work is what dominates a decode
step of a small model. They come as groups of similar KV length, shortest first (see
``decode_groups.py``): ``RunResult.chunks`` lists them in that row order, which is the order of
their logits, not the order the scheduler gave. Prefill chunks follow; each one's inputs are
gathered on its own, and a chunk whose inputs cannot be built (a bad prompt) is left out of the
batch and reported in ``RunResult.failed``, so it fails its request alone. An exception from the
forward itself (device, model) propagates: the whole batch failed.

On CUDA a step of decode tokens alone runs through a captured graph when one fits it
(``decode_graphs.py``; ``decode_graphs`` is None elsewhere): one launch instead of a few hundred,
its rows in the scheduler's order.

A prefill chunk of a request that asks for prompt log-probabilities needs the logits of its
prompt rows, not only of its last: the forward then returns every row's hidden states, and the
LM head and log-softmax run over those rows ``PROMPT_LOGPROB_ROWS`` at a time, so memory stays
``[PROMPT_LOGPROB_ROWS, vocab]`` however long the chunk. Row ``s`` of the sequence gives the
log-probability of prompt token ``s + 1``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from common.native_kernels import NativeKernels
from services.language.engine.decode_graphs import DecodeGraphs
from services.language.engine.decode_groups import group_by_kv_len, pad_decode_group
from services.language.engine.request import Request
from services.language.engine.sampling import PROMPT_LOGPROB_ROWS, TokenLogprob, token_logprobs
from services.language.engine.scheduler import ScheduledChunk
from services.language.kvcache.pool import KVPool
from services.language.model.batch import DecodeRows, ExtendSegment, ForwardBatch
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
    # [number of sampled chunks among them, vocab], in the model's dtype, on its device: the
    # sampler moves to the CPU only what it needs (token ids when greedy). None when every
    # sampled chunk's request takes its logits' maximum alone and the head found it (``maxima``)
    logits: torch.Tensor | None
    failed: list[tuple[ScheduledChunk, Exception]] = field(default_factory=list)
    # (largest logit, first token holding it) per sampled chunk, instead of ``logits``
    maxima: tuple[torch.Tensor, torch.Tensor] | None = None
    # the next prompt log-probabilities of requests that asked for them (see the module doc)
    prompt_logprobs: list[tuple[Request, list[TokenLogprob]]] = field(default_factory=list)


def is_decode(chunk: ScheduledChunk) -> bool:
    """One generated token (its K/V not computed yet): no image rows, a 1-D position."""
    return chunk.end - chunk.start == 1 and chunk.start >= chunk.req.prompt_len


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
        self.decode_graphs: DecodeGraphs | None = None  # set by the engine on CUDA
        # set by the engine on a CPU where the native decode attention is the faster path
        self.decode_kernels: NativeKernels | None = None
        # set by the engine on a CPU where the native prefill attention runs (bf16, AVX-512 BF16)
        self.prefill_kernels: NativeKernels | None = None

    def build_batch(
        self, decode_groups: list[list[ScheduledChunk]], parts: list[ChunkInputs]
    ) -> ForwardBatch:
        """Flat rows: the decode tokens group by group, then the chunks; logits of the decode
        rows and of the chunks with ``sample``, in that order."""
        ids, pos, groups, decode_slots = [], [], [], []
        for members in decode_groups:
            kv_slots = []
            for chunk in members:
                req = chunk.req
                ids.append(req.output_ids[chunk.start - req.prompt_len])
                pos.append(chunk.start + req.inputs.mrope_delta)
                kv_slots.append(req.slots[: chunk.end])
            decode_slots += kv_slots
            if self.decode_kernels is None:
                start = len(ids) - len(members)
                groups.append(pad_decode_group(start, kv_slots, self.dtype, self.device))
        rows = None
        if self.decode_kernels is not None and decode_slots:
            lens = [int(s.shape[0]) for s in decode_slots]
            offsets = torch.tensor([0, *lens], dtype=torch.long).cumsum_(0)
            rows = DecodeRows(self.decode_kernels, torch.cat(decode_slots), offsets, max(lens))
        extends, logit_rows = [], list(range(len(ids)))
        row = len(ids)
        for part in parts:
            num = part.chunk.end - part.chunk.start
            kv_slots = part.kv_slots.to(self.device)
            extends.append(
                ExtendSegment.causal(row, kv_slots, num, self.dtype, self.prefill_kernels)
            )
            if part.chunk.sample:
                logit_rows.append(row + num - 1)
            row += num
        fill_ids = [torch.tensor(ids, dtype=torch.long)] + [p.fill_ids for p in parts]
        positions = [torch.tensor(pos, dtype=torch.long).expand(3, -1)]
        positions += [p.positions for p in parts]
        out_slots = [g.kv_slots[:, -1] for g in groups]  # see pad_decode_group (on the device)
        if rows is not None:
            out_slots.append(rows.slots[rows.offsets[1:] - 1])  # each request's newest slot
        out_slots += [p.out_slots.to(self.device) for p in parts]
        # NOTE: received rows are in the wire dtype (bf16 by default): cast to the model's here.
        image_rows = [p.image_rows.to(self.dtype) for p in parts if p.image_rows.shape[0]]
        return ForwardBatch(
            fill_ids=torch.cat(fill_ids).to(self.device),
            positions=torch.cat(positions, dim=1).to(self.device),
            image_rows=torch.cat(image_rows).to(self.device) if image_rows else None,
            out_slots=torch.cat(out_slots),
            extends=extends,
            decode_groups=groups,
            logit_rows=torch.tensor(logit_rows, dtype=torch.long, device=self.device),
            decode_rows=rows,
        )

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk]) -> RunResult:
        """Gather the inputs (a failure drops that chunk), then one forward."""
        decodes, parts, failed = [], [], []
        for chunk in chunks:
            if is_decode(chunk):
                decodes.append(chunk)
                continue
            try:
                parts.append(gather_inputs(chunk))
            except Exception as exc:  # this request's inputs are bad; the others go on
                failed.append((chunk, exc))
        if not decodes and not parts:
            return RunResult([], torch.zeros(0, 0), failed)
        if not parts and self.decode_graphs is not None:
            shape = self.decode_graphs.shape(decodes)
            logits = self.decode_graphs.run(decodes, shape) if shape else None
            if logits is not None:
                return RunResult(decodes, logits, failed)
        decode_groups = [
            [decodes[i] for i in group] for group in group_by_kv_len([c.end for c in decodes])
        ]
        decodes = [chunk for group in decode_groups for chunk in group]  # in row order
        batch = self.build_batch(decode_groups, parts)
        chunks = decodes + [p.chunk for p in parts]
        if not any(p.chunk.req.wants_prompt_logprobs for p in parts):
            if self.model.has_head_maxima and all(
                c.req.takes_row_maximum for c in chunks if c.sample
            ):
                return RunResult(chunks, None, failed, self.model.maxima(batch, self.kv_pool))
            return RunResult(chunks, self.model(batch, self.kv_pool), failed)
        hidden = self.model.hidden_states(batch, self.kv_pool)
        result = RunResult(chunks, self.model.head(hidden[batch.logit_rows]), failed)
        row = len(decodes)
        for part in parts:
            chunk = part.chunk
            if chunk.req.wants_prompt_logprobs:
                rows = hidden[row : row + chunk.end - chunk.start]
                result.prompt_logprobs.append((chunk.req, self._prompt_logprobs(chunk, rows)))
            row += chunk.end - chunk.start
        return result

    def _prompt_logprobs(self, chunk: ScheduledChunk, hidden: torch.Tensor) -> list[TokenLogprob]:
        """Log-probabilities of the prompt tokens that ``chunk``'s rows ``hidden`` predict and
        the request has not gathered yet (a recomputed chunk adds nothing twice)."""
        req = chunk.req
        first = max(chunk.start, len(req.prompt_logprobs))  # sequence row predicting token +1
        last = min(chunk.end, req.prompt_len - 1)
        targets = req.inputs.fill_ids[first + 1 : last + 1].tolist()
        out: list[TokenLogprob] = []
        for at in range(0, len(targets), PROMPT_LOGPROB_ROWS):
            some = targets[at : at + PROMPT_LOGPROB_ROWS]
            lo = first - chunk.start + at
            logits = self.model.head(hidden[lo : lo + len(some)])
            out += token_logprobs(logits, some, req.params.prompt_logprobs)
        return out
