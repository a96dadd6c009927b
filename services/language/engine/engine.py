"""``LanguageEngine``: requests in, streamed ``RequestOutput`` s out; one ``step()`` at a time.

Not thread-safe: one thread owns the engine (see ``engine_thread.py``).

Failures stay with the request that caused them: a prompt that does not fit, inputs that cannot
be gathered, a sampling error or non-finite logits finish that request alone with
``FinishReason.ERROR``; only an exception from the model forward fails the requests of that
batch (their K/V may be partly written), and the engine goes on with the next step.

A request with ``n`` choices is ``n`` sequences (``Request`` s with one ``request_id``, choice
``index`` each), all made when it is added. Choice 0 receives the prompt and prefills it; the
others wait (``WAITING_FOR_FIRST_CHOICE``) until its prefill completes and its prompt is in the
radix cache, then take its inputs and are queued first: each matches all of the prompt but its
last token, so the prompt and its images are computed once. Each choice samples on its own
(its sampler, seed + index with a seed, grammar guide, penalty history) and streams outputs
with its ``index``. The request ends when every choice finished: its last output has
``ends_request``, and its room (the image rows are views of its transfer blocks) is given back
then. An abort or a failure of any choice finishes every choice still going. Which requests are
in flight, and how each ends, is ``request_table.RequestTable``'s.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from common.compute import prepare_device, resolve_compute
from services.language.config import LanguageConfig
from services.language.engine.cache_manager import CacheManager
from services.language.engine.decode_graphs import DecodeGraphs
from services.language.engine.detokenizer import IncrementalDetokenizer
from services.language.engine.grammar import Grammars, Guide
from services.language.engine.intake import (
    Limits,
    attach_prompt,
    check_sampling,
    take_chunk,
    take_whole,
)
from services.language.engine.model_runner import ModelRunner, RunResult
from services.language.engine.outputs import EngineLoad, request_output
from services.language.engine.penalties import process_logits
from services.language.engine.request import (
    ErrorKind,
    FinishReason,
    Request,
    RequestError,
    RequestOutput,
    RequestStatus,
)
from services.language.engine.request_table import RequestTable
from services.language.engine.sampling import (
    SamplingParams,
    TokenLogprob,
    greedy_tokens,
    sample,
    token_logprobs,
)
from services.language.engine.scheduler import ScheduledChunk, Scheduler
from services.language.engine.token_text import TokenTexts
from services.language.inputs import PromptChunk, PromptInputs
from services.language.kvcache.pool import KVPool, SlotAllocator, slot_bytes
from services.language.kvcache.radix_cache import RadixCache
from services.language.kvcache.sizing import plan_kv_pool, resolve_max_seq_len
from services.language.model.attention import prefill_attention_kernels
from services.language.model.weights import load_text_model
from services.language.receiving import EmbeddingSource

logger = logging.getLogger(__name__)


class LanguageEngine:
    def __init__(self, config: LanguageConfig, embedding_source: EmbeddingSource | None = None):
        from transformers import AutoTokenizer

        self.config = config
        compute = resolve_compute(config.device, config.dtype)
        self.device, self.dtype = compute.device, compute.dtype
        logger.info("language model on %s in %s (%s)", self.device, self.dtype, compute.reason)
        prepare_device(self.device)
        self.model = load_text_model(config.model_path, self.device, self.dtype)
        native = self.model.use_cpu_kernels(config.cpu_kernels)  # the LM head first
        self.linear_kernel = self.model.use_linear_kernel(
            config.linear_kernel, native
        )  # before sizing
        self.cpu_kernels = "torch" if native is None else "native"
        self.sampler_kernels = native  # sampled rows drawn together (None: one by one in torch)
        self.model_config = mc = self.model.config
        self.tokenizer = AutoTokenizer.from_pretrained(config.model_path)
        self.grammars = Grammars(self.tokenizer, mc.vocab_size, list(mc.eos_token_ids))
        self.token_texts = TokenTexts(self.tokenizer)  # of the ids logprobs report
        per_slot = slot_bytes(mc.num_layers, mc.num_kv_heads, mc.head_dim, self.dtype)
        self.kv_plan = plan = plan_kv_pool(config, per_slot, self.device)  # after the weights
        kv_pool = KVPool(
            mc.num_layers, plan.num_slots, mc.num_kv_heads, mc.head_dim, self.dtype, self.device
        )
        self.max_seq_len = resolve_max_seq_len(
            config.max_seq_len, plan.num_slots, mc.max_position_embeddings
        )
        self.limits = Limits(
            vocab_size=mc.vocab_size,
            row_width=mc.image_row_width,
            num_deepstack=mc.num_deepstack,
            max_seq_len=self.max_seq_len,
            default_max_new_tokens=config.default_max_new_tokens,
        )
        self.cache_manager = CacheManager(SlotAllocator(plan.num_slots), RadixCache())
        self.scheduler = Scheduler(
            self.cache_manager,
            config.chunk_size,
            config.max_running_requests,
            config.partial_prefill_while_decoding,
        )
        self.runner = ModelRunner(self.model, kv_pool, self.device)
        if native is not None and native.decode_attention_fits(
            self.dtype, mc.num_heads, mc.num_kv_heads, mc.head_dim
        ):
            self.runner.decode_kernels = native
            logger.info("decode attention: the native kernel, keys read in the pool in place")
        self.runner.prefill_kernels = prefill_attention_kernels(
            config.prefill_attention, native, self.device, self.dtype, mc
        )
        if config.cuda_graphs and self.device.type == "cuda":
            max_batch = min(config.cuda_graph_max_batch, config.max_running_requests)
            self.runner.decode_graphs = DecodeGraphs(
                self.model, kv_pool, self.device, max_batch, config.cuda_graph_max_keys
            )
            logger.info(
                "decode steps as CUDA graphs: batch <= %d, <= %d keys with padding",
                max_batch,
                config.cuda_graph_max_keys,
            )
        self.num_prefill_tokens = 0  # prompt tokens computed, lifetime
        self.num_decode_tokens = 0  # tokens computed while decoding, lifetime
        self.num_batches = 0  # steps that ran a batch, lifetime
        self.table = RequestTable(self.scheduler, self.cache_manager, embedding_source)

    @property
    def embedding_source(self) -> EmbeddingSource | None:
        """Where rooms' embeddings come from; its one reference is the table's (which adds,
        aborts and releases rooms)."""
        return self.table.embedding_source

    @embedding_source.setter
    def embedding_source(self, source: EmbeddingSource | None) -> None:
        self.table.embedding_source = source

    @property
    def requests(self) -> dict[str, Request]:
        """Choice 0 of each request in flight (``RequestTable.requests``)."""
        return self.table.requests

    @property
    def choices(self) -> dict[str, list[Request]]:
        """Every choice of each request in flight, by index (``RequestTable.choices``)."""
        return self.table.choices

    @property
    def receiving(self) -> dict[int, Request]:
        """Room -> request waiting for its embeddings (``RequestTable.receiving``)."""
        return self.table.receiving

    # ---- intake -------------------------------------------------------------------------
    def tokenize_messages(self, messages: list[dict]) -> PromptInputs:
        """A text-only chat through the checkpoint's chat template."""
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        ids = self.tokenizer(text).input_ids
        return PromptInputs.from_text_ids(ids, self.model_config.hidden_size)

    def tokenize_prompt(self, text: str) -> PromptInputs:
        """A raw text prompt, tokenized as it is (no chat template)."""
        if not text:
            raise ValueError("prompt_text is empty")
        ids = self.tokenizer(text).input_ids
        return PromptInputs.from_text_ids(ids, self.model_config.hidden_size)

    def prompt_of_ids(self, token_ids: list[int]) -> PromptInputs:
        """A prompt of token ids as they are; each must be in the vocabulary."""
        vocab = self.limits.vocab_size
        for i, token_id in enumerate(token_ids):
            if not 0 <= token_id < vocab:
                raise ValueError(f"prompt_token_ids[{i}] must be in [0, {vocab}), got {token_id}")
        return PromptInputs.from_text_ids(list(token_ids), self.model_config.hidden_size)

    def add_request(
        self,
        request_id: str,
        params: SamplingParams,
        inputs: PromptInputs | None = None,
        room: int = 0,
        encoder_endpoint: str = "",
        deadline: float | None = None,
        guide: Guide | None = None,
    ) -> None:
        """Queue a request with its inputs, or (``inputs=None``) one whose ``room`` is pulled
        from the encoder at ``encoder_endpoint`` until ``deadline`` (``time.monotonic``; the
        room is added to the embedding source when there is one; tests deliver inputs with
        ``deliver_inputs``). A request with structured output takes ``guide`` (made by
        ``self.grammars.guide`` off the engine's thread), or gets one made here. Raises
        RequestError (INVALID_ARGUMENT) for a duplicate id, a ``logit_bias`` id outside the
        vocabulary, a room in use or missing, a prompt that does not fit ``max_seq_len``, or a
        structured output that is no usable language."""
        if request_id in self.requests:
            raise RequestError(ErrorKind.INVALID_ARGUMENT, f"duplicate request id {request_id!r}")
        check_sampling(params, self.limits)
        req = self._new_choice(request_id, params, 0, guide)
        req.room, req.deadline = room, deadline
        others = [self._new_choice(request_id, params, i) for i in range(1, params.n)]
        if inputs is None:
            self.table.wait_for_room(req, room, encoder_endpoint, deadline)
        else:
            attach_prompt(req, inputs, self.limits)
            self.scheduler.add(req)
        self.table.add([req, *others])

    def _new_choice(
        self, request_id: str, params: SamplingParams, index: int, guide: Guide | None = None
    ) -> Request:
        """Choice ``index`` of a request: with a seed it samples with seed + index; with
        structured output it gets its own guide (the compiled grammar is cached)."""
        if index and params.seed is not None:
            params = replace(params, seed=params.seed + index)
        if guide is None and params.structured is not None:
            guide = self.grammars.guide(params.structured)
        req = Request(request_id, params, IncrementalDetokenizer(self.tokenizer, params.stop))
        req.index, req.guide = index, guide
        if index:
            req.status = RequestStatus.WAITING_FOR_FIRST_CHOICE
        return req

    def collect_embeddings(self) -> list[RequestOutput]:
        """Move on the requests whose rooms ended or grew (the embedding source said so)."""
        if self.embedding_source is None:
            return []
        outputs: list[RequestOutput] = []
        for room, result in self.embedding_source.pop_done():
            if isinstance(result, PromptChunk):
                outputs += self.deliver_chunk(room, result)
            else:
                outputs += self.deliver_inputs(room, result)
        return outputs

    def deliver_chunk(self, room: int, chunk: PromptChunk) -> list[RequestOutput]:
        """The next tokens of ``room``'s prompt landed while the rest is in flight: its request
        is queued with what arrived and prefills it (see ``scheduler.py``)."""
        req = self.receiving.get(room)
        if req is None:  # aborted meanwhile
            return []
        return self._take_prompt(req, lambda: take_chunk(req, chunk, self.limits))

    def deliver_inputs(self, room: int, inputs: PromptInputs | Exception) -> list[RequestOutput]:
        """Embeddings of ``room`` arrived (or failed): move its request on."""
        req = self.table.take_room(room)
        if req is None:  # aborted meanwhile
            return []
        if isinstance(inputs, Exception):
            past_deadline = req.deadline is not None and time.monotonic() >= req.deadline
            kind = ErrorKind.DEADLINE_EXCEEDED if past_deadline else ErrorKind.FAILED
            return self.table.fail(req, kind, f"receiving the prompt failed: {inputs}")
        return self._take_prompt(req, lambda: take_whole(req, inputs, self.limits))

    def _take_prompt(self, req: Request, take: Callable[[], bool]) -> list[RequestOutput]:
        """Run ``take`` (it attaches or grows ``req``'s prompt; True: queue ``req``); a failure
        ends ``req`` alone."""
        try:
            if take():
                self.scheduler.add(req)
        except RequestError as exc:
            return self.table.fail(req, exc.kind, str(exc))
        except Exception as exc:  # inputs the checks did not foresee: this request only
            logger.exception("request %s: its prompt could not be taken", req.request_id)
            return self.table.fail(req, ErrorKind.FAILED, f"its prompt could not be taken: {exc}")
        return []

    def abort(self, request_id: str, error: str = "") -> list[RequestOutput]:
        """Abort in any state: frees slots, locks and (via the source) transfer blocks. With
        ``error`` the request finishes as failed (``ERROR``) rather than aborted. One output per
        choice still going (none for an unknown id)."""
        req = self.requests.get(request_id)
        if req is None:
            return []
        if error:
            return self.table.fail(req, ErrorKind.FAILED, error)
        return self.table.end_request(req, FinishReason.ABORT)

    # ---- the loop ----------------------------------------------------------------------
    def has_work(self) -> bool:
        """Whether a step has requests to work on (queued or running). Requests that wait for
        their embeddings are not work: ``collect_embeddings`` moves them on when they arrive."""
        return bool(self.scheduler.waiting or self.scheduler.running)

    def step(self) -> list[RequestOutput]:
        """schedule -> run -> postprocess. Returns the outputs produced this step."""
        batch = self.scheduler.schedule()
        if not batch.chunks:
            return []
        self.num_batches += 1
        try:
            result = self.runner.run(batch.chunks)
        except Exception as exc:  # the device or the model: this batch's requests fail
            logger.exception(
                "model forward failed; failing the %d requests of its batch", len(batch.chunks)
            )
            error = f"model forward failed: {type(exc).__name__}: {exc}"
            return [
                out for c in batch.chunks for out in self.table.fail(c.req, ErrorKind.FAILED, error)
            ]
        for chunk in result.chunks:
            if chunk.req.status == RequestStatus.DECODE:
                self.num_decode_tokens += chunk.end - chunk.start
            else:
                self.num_prefill_tokens += chunk.end - chunk.start
        return self.postprocess(result)

    def postprocess(self, result: RunResult) -> list[RequestOutput]:
        outputs = [
            out
            for c, exc in result.failed
            for out in self.table.fail(
                c.req, ErrorKind.FAILED, f"building its inputs failed: {exc}"
            )
        ]
        for req, entries in result.prompt_logprobs:
            req.prompt_logprobs += entries
        sampled = [c for c in result.chunks if c.sample]
        tokens: list[int | Exception] = []
        if sampled and result.logits is None:  # each row's maximum alone: greedy, nothing else
            tokens = greedy_tokens(*result.maxima)
        elif sampled:
            # the raw ``result.logits`` stay the model's: log-probabilities are taken from them
            eos_ids = self.model_config.eos_token_ids
            logits = process_logits(result.logits, [c.req for c in sampled], eos_ids)
            guides = [c.req.guide for c in sampled]
            states = [c.req.sampler for c in sampled]
            tokens = sample(logits, states, guides, self.sampler_kernels)
        for chunk in result.chunks:
            chunk.req.num_computed = chunk.end
        logprobs = self._token_logprobs(result.logits, sampled, tokens)
        for row, (chunk, token) in enumerate(zip(sampled, tokens, strict=True)):
            req = chunk.req
            if req.status == RequestStatus.FINISHED:  # another choice of its request failed
                continue
            if isinstance(token, Exception):
                outputs += self.table.fail(req, ErrorKind.FAILED, f"sampling failed: {token}")
                continue
            try:
                if req.status == RequestStatus.PREFILL:
                    req.status = RequestStatus.DECODE
                    self.cache_manager.cache_prefix(req)
                    self.table.start_other_choices(req)
                out = self._append_token(req, token)
                if row in logprobs:
                    out.logprobs = [self.token_texts.label(logprobs[row])]
                if len(req.output_ids) == 1 and req.params.prompt_logprobs is not None:
                    out.prompt_logprobs = self._prompt_logprobs(req)
                outputs.append(out)
            except Exception as exc:  # e.g. the tokenizer rejects the token: this request only
                logger.exception("request %s failed after sampling", req.request_id)
                outputs += self.table.fail(req, ErrorKind.FAILED, f"output failed: {exc}")
        self.grammars.prepare_masks(
            [c.req.guide for c in sampled if c.req.guide and c.req.status != RequestStatus.FINISHED]
        )
        return outputs

    def _token_logprobs(
        self,
        logits: torch.Tensor | None,
        sampled: list[ScheduledChunk],
        tokens: list[int | Exception],
    ) -> dict[int, TokenLogprob]:
        """The log-probability entries of the rows whose request asks for them, by row: one
        log-softmax over all of them (NOTE: row by row, 16 demo rows took ~10 ms a step), each
        row's top tokens cut to its request's ``top_logprobs``."""
        rows = [
            row
            for row, (chunk, token) in enumerate(zip(sampled, tokens, strict=True))
            if chunk.req.params.wants_logprobs and not isinstance(token, Exception)
        ]
        if not rows or logits is None:
            return {}
        num_top = max(sampled[row].req.params.top_logprobs for row in rows)
        picked = logits[rows] if len(rows) < logits.shape[0] else logits
        entries = token_logprobs(picked, [tokens[row] for row in rows], num_top)
        return {
            row: lp._replace(top=lp.top[: sampled[row].req.params.top_logprobs])
            for row, lp in zip(rows, entries, strict=True)
        }

    def _prompt_logprobs(self, req: Request) -> list[TokenLogprob]:
        """Every prompt token's entry, the first one's without a logprob (NaN)."""
        first = TokenLogprob(int(req.inputs.fill_ids[0]), float("nan"), [])
        return [self.token_texts.label(lp) for lp in [first, *req.prompt_logprobs]]

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
        elif req.guide is not None and req.guide.advance(token):
            reason = FinishReason.STOP  # the structured output is complete
        elif len(req.output_ids) >= req.max_new_tokens:
            reason = FinishReason.LENGTH
        # as vLLM: stop strings end a request only after its first ``min_tokens`` tokens
        check_stop = len(req.output_ids) > p.min_tokens
        text = req.detokenizer.add(token, reason != FinishReason.NONE, check_stop)
        if req.detokenizer.stopped:
            reason = FinishReason.STOP
        if reason != FinishReason.NONE:
            return self.table.finish(req, reason, [token], text)
        return request_output(req, [token], text)

    def load(self) -> EngineLoad:
        cm = self.cache_manager
        info = cm.cache.size_info()
        return EngineLoad(
            num_running=len(self.scheduler.running),
            # a request queued while its prompt still arrives counts as receiving, not twice
            num_waiting=sum(1 for r in self.scheduler.waiting if r.room not in self.receiving),
            num_receiving=len(self.receiving),
            num_kv_slots_used=cm.num_used,
            num_kv_slots_total=cm.allocator.num_slots,
            num_radix_hit_tokens=cm.num_hit_tokens,
            num_radix_tokens=info.evictable_size + info.protected_size,
            num_radix_locked_tokens=info.protected_size,
            num_evicted_tokens=cm.num_evicted_tokens,
            num_prefill_tokens=self.num_prefill_tokens,
            num_decode_tokens=self.num_decode_tokens,
        )
