"""``LanguageEngine``: requests in, streamed ``RequestOutput`` s out; one ``step()`` at a time.

Not thread-safe: one thread owns the engine (see ``engine_thread.py``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from services.language.config import LanguageConfig
from services.language.engine.cache_manager import CacheManager
from services.language.engine.detokenizer import IncrementalDetokenizer
from services.language.engine.model_runner import ModelRunner
from services.language.engine.request import FinishReason, Request, RequestOutput, RequestStatus
from services.language.engine.sampling import SamplingParams, sample
from services.language.engine.scheduler import Scheduler, SchedulerOutput
from services.language.inputs import PromptInputs
from services.language.kvcache.pool import KVPool, SlotAllocator, slot_bytes
from services.language.kvcache.radix_cache import RadixCache
from services.language.model.weights import load_text_model
from services.language.receiving import EmbeddingSource


@dataclass(frozen=True)
class EngineLoad:
    num_running: int
    num_waiting: int
    num_receiving: int
    num_kv_slots_used: int
    num_kv_slots_total: int
    num_radix_hit_tokens: int
    num_radix_tokens: int
    num_evicted_tokens: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0


def _span(start: float, end: float) -> float:
    """Seconds from ``start`` to ``end``; 0 while either has not happened."""
    return end - start if start and end else 0.0


def resolve_device(config: LanguageConfig) -> tuple[torch.device, torch.dtype]:
    name = config.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if config.dtype == "auto":
        return device, torch.bfloat16 if device.type == "cuda" else torch.float32
    return device, getattr(torch, config.dtype)


class LanguageEngine:
    def __init__(self, config: LanguageConfig, embedding_source: EmbeddingSource | None = None):
        from transformers import AutoTokenizer

        self.config = config
        self.device, dtype = resolve_device(config)
        self.model = load_text_model(config.model_path, self.device, dtype)
        self.model_config = mc = self.model.config
        self.tokenizer = AutoTokenizer.from_pretrained(config.model_path)
        num_slots = config.num_kv_slots or (config.kv_cache_memory_mb << 20) // slot_bytes(
            mc.num_layers, mc.num_kv_heads, mc.head_dim, dtype
        )
        kv_pool = KVPool(mc.num_layers, num_slots, mc.num_kv_heads, mc.head_dim, dtype, self.device)
        self.cache_manager = CacheManager(SlotAllocator(num_slots), RadixCache())
        self.scheduler = Scheduler(
            self.cache_manager, config.chunk_size, config.max_running_requests
        )
        self.runner = ModelRunner(self.model, kv_pool, self.device)
        self.num_prefill_tokens = 0  # prompt tokens computed, lifetime
        self.num_decode_tokens = 0  # tokens computed while decoding, lifetime
        self.requests: dict[str, Request] = {}
        self.receiving: dict[int, Request] = {}  # room -> request waiting for embeddings
        self.embedding_source = embedding_source  # where rooms' embeddings come from

    # ---- intake -------------------------------------------------------------------------
    def tokenize_messages(self, messages: list[dict]) -> PromptInputs:
        """A text-only chat through the checkpoint's chat template."""
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        ids = self.tokenizer(text).input_ids
        return PromptInputs.from_text_ids(ids, self.model_config.hidden_size)

    def add_request(
        self,
        request_id: str,
        params: SamplingParams,
        inputs: PromptInputs | None = None,
        room: int = 0,
        encoder_endpoint: str = "",
    ) -> None:
        """Queue a request with its inputs, or (``inputs=None``) one whose ``room`` is pulled
        from the encoder at ``encoder_endpoint`` (the room is added to the embedding source
        when there is one; tests deliver inputs with ``deliver_inputs``). Raises ValueError for
        a duplicate id, a missing room or a prompt that can never fit."""
        if request_id in self.requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        req = Request(request_id, params, IncrementalDetokenizer(self.tokenizer, params.stop))
        req.room = room
        if inputs is None:
            if not room:
                raise ValueError("a request needs inputs or a room")
            if room in self.receiving:
                raise ValueError(f"room {room} is already in use")
            if self.embedding_source is not None:
                self.embedding_source.add_room(room, encoder_endpoint)
            req.status = RequestStatus.WAITING_FOR_EMBEDDINGS
            self.receiving[room] = req
        else:
            self._set_inputs(req, inputs)
            self.scheduler.add(req)
        self.requests[request_id] = req

    def _set_inputs(self, req: Request, inputs: PromptInputs) -> None:
        total = len(inputs) + req.params.max_new_tokens
        if total > self.cache_manager.allocator.num_slots:
            raise ValueError(f"prompt + max_new_tokens = {total} exceeds the KV pool")
        req.set_inputs(inputs, self.model_config.vocab_size)

    def deliver_inputs(self, room: int, inputs: PromptInputs | Exception) -> list[RequestOutput]:
        """Embeddings of ``room`` arrived (or failed): move its request on."""
        req = self.receiving.pop(room, None)
        if req is None:  # aborted meanwhile: nobody will use these inputs
            self._release_room(room)
            return []
        if isinstance(inputs, Exception):
            return [self._finish(req, FinishReason.ERROR, error=str(inputs))]
        try:
            self._set_inputs(req, inputs)
        except ValueError as exc:
            return [self._finish(req, FinishReason.ERROR, error=str(exc))]
        self.scheduler.add(req)
        return []

    def abort(self, request_id: str) -> RequestOutput | None:
        """Abort in any state: frees slots, locks and (via the source) transfer blocks."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        if req.status == RequestStatus.WAITING_FOR_EMBEDDINGS:
            self.receiving.pop(req.room, None)
            if self.embedding_source is not None:
                self.embedding_source.abort(req.room)
        return self._finish(req, FinishReason.ABORT)

    # ---- the loop ----------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running or self.receiving)

    def step(self) -> list[RequestOutput]:
        """schedule -> run -> postprocess. Returns the outputs produced this step."""
        outputs = self._poll_embeddings()
        batch = self.scheduler.schedule()
        if batch.chunks:
            for chunk in batch.chunks:
                if chunk.req.status == RequestStatus.DECODE:
                    self.num_decode_tokens += chunk.end - chunk.start
                else:
                    self.num_prefill_tokens += chunk.end - chunk.start
            logits = self.runner.run(batch.chunks)
            outputs += self.postprocess(batch, logits)
        return outputs

    def _poll_embeddings(self) -> list[RequestOutput]:
        if self.embedding_source is None or not self.receiving:
            return []
        outputs: list[RequestOutput] = []
        for room, result in self.embedding_source.pop_done():
            outputs += self.deliver_inputs(room, result)
        return outputs

    def postprocess(self, batch: SchedulerOutput, logits: torch.Tensor) -> list[RequestOutput]:
        sampled = [c for c in batch.chunks if c.sample]
        tokens = sample(logits, [c.req.sampler for c in sampled]) if sampled else []
        for chunk in batch.chunks:
            chunk.req.num_computed = chunk.end
        outputs = []
        for chunk, token in zip(sampled, tokens, strict=True):
            req = chunk.req
            if req.status == RequestStatus.PREFILL:
                req.status = RequestStatus.DECODE
                self.cache_manager.cache_prefix(req)
            outputs.append(self._append_token(req, token))
        return outputs

    def _append_token(self, req: Request, token: int) -> RequestOutput:
        if not req.first_token_time:
            req.first_token_time = time.monotonic()
        req.output_ids.append(token)
        p = req.params
        reason = FinishReason.NONE
        if token in p.stop_token_ids or (
            not p.ignore_eos and token in self.model_config.eos_token_ids
        ):
            reason = FinishReason.STOP
        elif len(req.output_ids) >= p.max_new_tokens:
            reason = FinishReason.LENGTH
        text = req.detokenizer.add(token, final=reason != FinishReason.NONE)
        if req.detokenizer.stopped:
            reason = FinishReason.STOP
        if reason != FinishReason.NONE:
            return self._finish(req, reason, [token], text)
        return self._output(req, [token], text)

    def _finish(
        self,
        req: Request,
        reason: FinishReason,
        token_ids: list[int] | None = None,
        text: str = "",
        error: str = "",
    ) -> RequestOutput:
        if req.status in (RequestStatus.PREFILL, RequestStatus.DECODE) and reason in (
            FinishReason.STOP,
            FinishReason.LENGTH,
        ):
            self.cache_manager.cache_prefix(req)
        if req.status != RequestStatus.WAITING_FOR_EMBEDDINGS:
            self.scheduler.remove(req)
        req.status, req.finish_reason = RequestStatus.FINISHED, reason
        self.requests.pop(req.request_id, None)
        self._release_room(req.room)
        return self._output(req, token_ids or [], text, error)

    def _release_room(self, room: int) -> None:
        """Give a delivered room's transfer blocks back (its image rows may be views of them)."""
        if room and self.embedding_source is not None:
            self.embedding_source.release(room)

    def _output(
        self, req: Request, token_ids: list[int], text: str, error: str = ""
    ) -> RequestOutput:
        now = time.monotonic()
        return RequestOutput(
            request_id=req.request_id,
            token_ids=token_ids,
            text=text,
            finish_reason=req.finish_reason,
            num_prompt_tokens=req.prompt_len if req.inputs is not None else 0,
            num_cached_tokens=req.num_cached_tokens,
            num_completion_tokens=len(req.output_ids),
            ttft_s=_span(req.arrival_time, req.first_token_time),
            total_s=now - req.arrival_time,
            receive_s=_span(req.arrival_time, req.inputs_time),
            queue_s=_span(req.inputs_time, req.prefill_start_time),
            prefill_s=_span(req.prefill_start_time, req.first_token_time),
            provenance=dict(req.inputs.provenance) if req.inputs is not None else {},
            error=error,
        )

    def load(self) -> EngineLoad:
        cm = self.cache_manager
        info = cm.cache.size_info()
        return EngineLoad(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_receiving=len(self.receiving),
            num_kv_slots_used=cm.num_used,
            num_kv_slots_total=cm.allocator.num_slots,
            num_radix_hit_tokens=cm.num_hit_tokens,
            num_radix_tokens=info.evictable_size + info.protected_size,
            num_evicted_tokens=cm.num_evicted_tokens,
            num_prefill_tokens=self.num_prefill_tokens,
            num_decode_tokens=self.num_decode_tokens,
        )
