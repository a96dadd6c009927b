"""Decode steps replayed as CUDA graphs: one captured graph per (batch, keys) shape.

On a GPU a decode step of a small batch is bound by its launches, not its work: the bench
checkpoint's step (4 layers) launches ~190 kernels holding ~0.25 ms of GPU time inside a 4-8 ms
step (H100, torch profiler), the rest is Python and ``cudaLaunchKernel``. A CUDA graph captured
once replays every kernel of the step with one launch.

A graph fixes its shapes, so a step is fitted to one:

* rows: the step's decode requests, rounded up to a batch bucket (1, 2, 4, then multiples of 8
  up to ``max_batch``); the extra rows are pads;
* keys: every row attends to ``keys`` slots, the longest request's KV length rounded up to a
  power of two (at least ``MIN_KEYS``); a row's slots past its own length are pads, masked by a
  key bias the graph computes from each row's length.

A pad row writes its K/V to the pool's scratch slot (``KVPool.scratch_slot``) and attends to it
alone; a pad key of a real row is the scratch slot, masked out. No slot a request owns is read
for another or written by a pad. A step whose padded keys (batch bucket x key bucket) exceed
``max_keys``, or that holds a prefill chunk, runs eagerly (``ModelRunner``'s grouped path).

A step's inputs reach the device in one copy: token ids, positions, output slots, lengths and
the padded key slots, packed into a pinned host buffer in the layout the graph of that shape
reads from one static device buffer (``_Views``).

The first step of each shape captures its graph (logged with its time); all graphs share one
memory pool. NOTE: each captured graph keeps its own logits tensor ``[batch, vocab]`` alive in
that pool, outside the KV pool's budget (its ``kv_cache_reserve_mb`` covers it): a few hundred
MB in bf16 if every shape up to the default limits is met; one shared output buffer would
bound it to one ``[max_batch, vocab]``.

A capture that fails turns graphs off for the process, says why in the log, and the step runs
eagerly. ``capture=False`` runs the same padded static path without capturing: how the CPU
tests check the packing, padding and masking against transformers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.language.engine.scheduler import ScheduledChunk
from services.language.kvcache.pool import KVPool
from services.language.model.batch import DecodeGroup, ForwardBatch
from services.language.model.qwen import QwenTextModel

logger = logging.getLogger(__name__)

MIN_KEYS = 256  # the smallest key bucket
SMALL_BATCHES = (1, 2, 4)  # batch buckets below 8; multiples of 8 above


def batch_bucket(num_rows: int, max_batch: int) -> int | None:
    """The graph batch that holds ``num_rows`` decode rows, or None above ``max_batch``."""
    if num_rows > max_batch:
        return None
    for size in SMALL_BATCHES:
        if num_rows <= size:
            return size
    return min(max_batch, -(-num_rows // 8) * 8)


def key_bucket(num_keys: int) -> int:
    """The graph key length that holds ``num_keys`` keys: a power of two, at least MIN_KEYS."""
    return max(MIN_KEYS, 1 << (num_keys - 1).bit_length())


@dataclass
class _Views:
    """The inputs of one (batch, keys) shape as views of a flat long buffer (host or device):
    ``[ids | positions | out_slots | lengths]`` (``batch`` each), then ``batch x keys`` slots."""

    ids: torch.Tensor
    positions: torch.Tensor
    out_slots: torch.Tensor
    lengths: torch.Tensor
    kv_slots: torch.Tensor  # [batch, keys]

    @classmethod
    def of(cls, flat: torch.Tensor, batch: int, keys: int) -> _Views:
        head = flat[: 4 * batch].view(4, batch)
        kv = flat[4 * batch : 4 * batch + batch * keys].view(batch, keys)
        return cls(head[0], head[1], head[2], head[3], kv)


def packed_size(batch: int, keys: int) -> int:
    return 4 * batch + batch * keys


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph | None  # None: run eagerly (``capture=False``)
    logits: torch.Tensor | None  # the captured step's output, [batch, vocab]


class DecodeGraphs:
    """Runs pure decode steps through captured graphs (see the module doc)."""

    def __init__(
        self,
        model: QwenTextModel,
        kv_pool: KVPool,
        device: torch.device,
        max_batch: int,
        max_keys: int,
        capture: bool = True,
    ) -> None:
        self.model, self.kv_pool, self.device = model, kv_pool, device
        self.max_batch, self.max_keys, self.capture = max_batch, max_keys, capture
        self.dtype = next(model.parameters()).dtype
        size = 4 * max_batch + max_keys
        self._device_inputs = torch.zeros(size, dtype=torch.long, device=device)
        self._host_inputs = torch.zeros(size, dtype=torch.long, pin_memory=device.type == "cuda")
        # the last host -> device copy: the host buffer is refilled only after it has finished
        self._copied = torch.cuda.Event() if device.type == "cuda" else None
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._pool = None  # the graphs' shared memory pool, made by the first capture
        self.enabled = True
        self.num_steps = 0  # steps run on the static inputs (replayed, or eager without capture)

    @property
    def num_graphs(self) -> int:
        """Shapes captured (or, without capture, seen) so far."""
        return len(self._graphs)

    def shape(self, chunks: Sequence[ScheduledChunk]) -> tuple[int, int] | None:
        """(batch, keys) of the graph for these decode chunks, or None: run them eagerly."""
        if not self.enabled or not chunks:
            return None
        batch = batch_bucket(len(chunks), self.max_batch)
        if batch is None:
            return None
        keys = key_bucket(max(chunk.end for chunk in chunks))
        return (batch, keys) if batch * keys <= self.max_keys else None

    def run(self, chunks: Sequence[ScheduledChunk], shape: tuple[int, int]) -> torch.Tensor | None:
        """Logits [len(chunks), vocab] of the decode ``chunks`` (rows in their order), or None
        when the shape's graph could not be captured (graphs are then off; run eagerly)."""
        graph = self._graphs.get(shape) or self._capture(shape)
        if graph is None:
            return None
        batch, keys = shape
        self._load(chunks, batch, keys)
        self.num_steps += 1
        if graph.graph is None:
            return self._forward(batch, keys)[: len(chunks)]
        graph.graph.replay()
        # a copy: the graph's output is overwritten by its next replay
        return graph.logits[: len(chunks)].clone()

    def _load(self, chunks: Sequence[ScheduledChunk], batch: int, keys: int) -> None:
        """Pack the chunks' inputs (pads after them) and copy them to the device in one go."""
        scratch = self.kv_pool.scratch_slot
        ids, positions, out_slots, lengths = [], [], [], []
        host = self._host_views(batch, keys)
        host.kv_slots.fill_(scratch)
        for row, chunk in enumerate(chunks):
            req = chunk.req
            ids.append(req.output_ids[chunk.start - req.prompt_len])
            positions.append(chunk.start + req.inputs.mrope_delta)
            out_slots.append(int(req.slots[chunk.start]))
            lengths.append(chunk.end)
            host.kv_slots[row, : chunk.end] = req.slots[: chunk.end]
        pads = batch - len(chunks)
        head = [
            ids + [0] * pads,
            positions + [0] * pads,
            out_slots + [scratch] * pads,
            lengths + [1] * pads,
        ]
        self._host_inputs[: 4 * batch].copy_(torch.tensor(head, dtype=torch.long).view(-1))
        self._copy_in(packed_size(batch, keys))

    def _load_pads(self, batch: int, keys: int) -> None:
        """Every row a pad (what the warm-up and the capture run on: they write the scratch
        slot alone)."""
        host = self._host_views(batch, keys)
        host.ids.zero_()
        host.positions.zero_()
        host.out_slots.fill_(self.kv_pool.scratch_slot)
        host.lengths.fill_(1)
        host.kv_slots.fill_(self.kv_pool.scratch_slot)
        self._copy_in(packed_size(batch, keys))

    def _host_views(self, batch: int, keys: int) -> _Views:
        """The host buffer as the inputs of (batch, keys), once the last copy from it ended."""
        if self._copied is not None:
            self._copied.synchronize()
        return _Views.of(self._host_inputs, batch, keys)

    def _copy_in(self, size: int) -> None:
        self._device_inputs[:size].copy_(self._host_inputs[:size], non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    def _forward(self, batch: int, keys: int) -> torch.Tensor:
        """The step on the static inputs of shape (batch, keys): logits [batch, vocab]."""
        inputs = _Views.of(self._device_inputs, batch, keys)
        pad_key = torch.arange(keys, device=self.device)[None, :] >= inputs.lengths[:, None]
        bias = torch.zeros((batch, keys), dtype=self.dtype, device=self.device)
        bias.masked_fill_(pad_key, float("-inf"))
        step = ForwardBatch(
            fill_ids=inputs.ids,
            positions=inputs.positions.expand(3, -1),
            image_rows=None,
            out_slots=inputs.out_slots,
            extends=[],
            decode_groups=[DecodeGroup(0, inputs.kv_slots, bias[:, None, None, :])],
            logit_rows=torch.arange(batch, device=self.device),
        )
        return self.model.head(self.model.hidden_states(step, self.kv_pool))

    def _capture(self, shape: tuple[int, int]) -> _Graph | None:
        batch, keys = shape
        self._load_pads(batch, keys)
        if not self.capture:
            graph = self._graphs[shape] = _Graph(None, None)
            return graph
        began = time.perf_counter()
        try:
            # NOTE: one eager run first, on a side stream: kernels' first-call set-up (cuBLAS
            # workspaces, autotuning) must not happen inside the capture
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self._forward(batch, keys)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                logits = self._forward(batch, keys)
        except Exception:
            logger.exception(
                "capturing the decode step (batch %d, %d keys) as a CUDA graph failed: CUDA "
                "graphs are off, decode steps run eagerly",
                batch,
                keys,
            )
            self.enabled = False
            return None
        logger.info(
            "captured the decode step as a CUDA graph: batch %d, %d keys, %.0f ms",
            batch,
            keys,
            1e3 * (time.perf_counter() - began),
        )
        captured = self._graphs[shape] = _Graph(graph, logits)
        return captured
