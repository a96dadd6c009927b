"""Picks the work of one step: decode tokens first, then prefill chunks under a token budget.

Policy, in order:
1. Every DECODE request gets one token. When no slot is left even after radix eviction, the
   newest running request not yet scheduled this step is preempted (its slots freed, back to
   the front of the waiting queue with its generated tokens, to be recomputed).
2. PREFILL requests continue, oldest first, while the chunk budget lasts.
3. WAITING requests are admitted (radix match + lock) while the budget, ``max_running`` and
   the slots allow: a request is admitted only if all of its remaining prompt plus the
   remaining prompts of running prefills fit in free + evictable slots, so prefills never
   deadlock each other. Otherwise it stays queued.

A prompt still arriving (its room's chunks land one by one) is prefilled as far as it arrived:
it is admitted once it has a token the radix cache does not cover, and a PREFILL request that
computed everything that arrived waits (scheduling nothing) for its next chunk. A partial prompt
is kept out of a step that would otherwise only decode (``hold_partial``) until a whole chunk
of it is ready or all of it arrived, unless ``partial_prefill_while_decoding``: every step that
carries prefill tokens delays each decoding stream's next token, and a prompt shipped image by
image would otherwise put a piece of itself into several steps instead of one. In a step that
prefills a complete prompt anyway, partial ones ride along in what is left of the budget.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from services.language.engine.cache_manager import CacheManager
from services.language.engine.request import Request, RequestStatus


@dataclass
class ScheduledChunk:
    req: Request
    start: int  # first sequence index computed this step
    end: int  # one past the last; == seq_len means the last row is sampled

    @property
    def sample(self) -> bool:
        return self.end == self.req.seq_len


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.end - c.start for c in self.chunks)


class Scheduler:
    def __init__(
        self,
        cache_manager: CacheManager,
        chunk_size: int,
        max_running: int,
        partial_prefill_while_decoding: bool = False,
    ) -> None:
        self.cm = cache_manager
        self.chunk_size = chunk_size
        self.max_running = max_running
        self.partial_prefill_while_decoding = partial_prefill_while_decoding
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0  # lifetime count

    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    def add_first(self, reqs: list[Request]) -> None:
        """Queue ``reqs`` ahead of the waiting ones, in order (choices of a request already
        admitted, which reuse its prefill: see ``engine.py``)."""
        for req in reversed(reqs):
            req.status = RequestStatus.WAITING
            self.waiting.appendleft(req)

    def remove(self, req: Request) -> None:
        """Drop ``req`` from the queues and free its slots and locks (finish or abort)."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.cm.release(req)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        scheduled: set[int] = set()
        for req in list(self.running):
            if req.status == RequestStatus.DECODE and req in self.running:
                self._schedule_tokens(req, 1, out, scheduled)
        hold_partial = (
            bool(out.chunks)  # the step decodes
            and not self.partial_prefill_while_decoding
            and not self._complete_prompt_pending()
        )
        budget = self.chunk_size
        for req in list(self.running):
            if req.status != RequestStatus.PREFILL or budget <= 0 or req not in self.running:
                continue
            if self._prefill_now(req, hold_partial):
                budget -= self._schedule_tokens(req, budget, out, scheduled)
        for req in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.max_running:
                break
            if not self._prefill_now(req, hold_partial):
                continue  # a partial prompt while others decode: it waits for more of itself
            admitted = self._admit(req)
            if admitted is None:
                continue  # its prompt is still arriving and nothing of it is to compute yet
            if not admitted:
                break
            self.waiting.remove(req)
            self.running.append(req)
            budget -= self._schedule_tokens(req, budget, out, scheduled)
        return out

    def _complete_prompt_pending(self) -> bool:
        """Whether a whole prompt waits for (more) prefill: this step carries prefill tokens."""
        running = (r for r in self.running if r.status == RequestStatus.PREFILL)
        return any(r.prompt_complete for r in running) or any(
            r.prompt_complete for r in self.waiting
        )

    def _prefill_now(self, req: Request, hold_partial: bool) -> bool:
        """Whether to prefill ``req`` in this step: unless ``hold_partial`` (see the module
        doc), or its prompt is complete, or a whole chunk of it is ready."""
        if not hold_partial or req.prompt_complete:
            return True
        return req.num_ready_tokens - req.num_computed >= self.chunk_size

    def _schedule_tokens(
        self, req: Request, max_tokens: int, out: SchedulerOutput, scheduled: set[int]
    ) -> int:
        num = min(max_tokens, req.num_computable - req.num_computed)
        if num <= 0:
            return 0  # waiting for the next chunk of its prompt
        slots = self.cm.allocate(num)
        while slots is None:
            victim = next((r for r in reversed(self.running) if id(r) not in scheduled), None)
            if victim is None:
                return 0
            self._preempt(victim, out)
            if victim is req:
                return 0
            slots = self.cm.allocate(num)
        self.cm.extend(req, slots)
        out.chunks.append(ScheduledChunk(req, req.num_computed, req.num_computed + num))
        scheduled.add(id(req))
        return num

    def _admit(self, req: Request) -> bool | None:
        """Match, lock and reserve; False when the slots do not allow it, None when its prompt
        is still arriving and the cache covers all of it that arrived."""
        reserved = sum(
            r.prompt_len - r.num_computed for r in self.running if r.status == RequestStatus.PREFILL
        )
        self.cm.admit(req)
        if req.num_computed >= req.num_computable:
            self.cm.release(req)
            return None
        if self.cm.num_available < req.seq_len - req.num_computed + reserved:
            self.cm.release(req)
            return False
        req.status = RequestStatus.PREFILL
        if not req.prefill_start_time:  # its first admission (not a preempted one's return)
            req.prefill_start_time = time.monotonic()
            self.cm.count_hit(req)
        return True

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self.cm.release(req)
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        out.preempted.append(req)
        self.num_preemptions += 1
