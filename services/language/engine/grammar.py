"""Structured output: token masks from a grammar engine, applied in the batched sampler.

A request with a ``StructuredOutput`` (a JSON schema, any JSON object, a regex, a choice of
strings, or a Lark / GBNF grammar) gets a ``Guide``: an llguidance matcher over the checkpoint's
tokenizer, advanced by every token the request generates. The sampler (``sampling.sample``) asks
it before each draw: a greedy row keeps the batch's row maximum when the language allows that
token (one bit to read: the common case, e.g. inside a JSON string), and otherwise, like every
sampled row, draws from its row with the forbidden tokens at -inf (``Guide.allowed``). The
request ends with ``STOP`` once the language allows nothing more.

The masks of the next tokens are computed on the ``Grammars`` worker thread, one job per step
for every guided request, as soon as the step's tokens are known (llguidance drops the GIL while
it computes), so they overlap the next forward instead of adding to the step; ``apply_masks``
only waits for masks not done by then.

Compiling a grammar (parsing it, building its lexer) is done once per distinct specification:
compiled matchers are kept in an LRU and each request starts from a copy of one.
"""

from __future__ import annotations

import collections
import json
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from services.language.engine.request import ErrorKind, RequestError
from services.language.engine.sampling import MAX_CHOICES, StructuredOutput

COMPILED_CACHE_SIZE = 128  # distinct specifications kept compiled


def to_grammar(structured: StructuredOutput) -> str:
    """The llguidance grammar of ``structured``; raises ValueError naming the problem."""
    import llguidance

    kind, spec = structured.kind, structured.spec
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(
            {"type": "object"}, defaults={"whitespace_flexible": False}
        )
    if kind == "json_schema":
        try:
            schema = json.loads(spec)
        except json.JSONDecodeError as exc:
            raise ValueError(f"is not valid JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"must be a JSON object, got {type(schema).__name__}")
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(
                schema, defaults={"whitespace_flexible": False}
            )
        except Exception as exc:  # llguidance reports an unusable schema by raising
            raise ValueError(str(exc)) from None
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        choices = json.loads(spec)
        if not choices or len(choices) > MAX_CHOICES:
            raise ValueError(f"needs 1 to {MAX_CHOICES} strings, got {len(choices)}")
        if any(not isinstance(c, str) or not c for c in choices):
            raise ValueError("must hold non-empty strings")
        # NOTE: JSON string literals are Lark string literals (the same escapes)
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in choices)
        )
    if "::=" in spec:  # GBNF (as llama.cpp and xgrammar write it)
        from llguidance.gbnf_to_lark import any_to_lark

        try:
            spec = any_to_lark(spec)
        except Exception as exc:
            raise ValueError(f"is not a valid GBNF grammar: {exc}") from None
    return llguidance.LLMatcher.grammar_from_lark(spec)


class Guide:
    """One request's place in its language, and the mask of its next token."""

    def __init__(self, matcher, executor: ThreadPoolExecutor) -> None:
        self._matcher = matcher
        self._bits = b""  # the next token's mask, as llguidance computes it
        self._stale = False  # advanced since: the mask is to be computed (``prepare_masks``)
        self._pending: Future | None = executor.submit(self._compute)

    def _compute(self) -> None:
        self._bits = self._matcher.compute_bitmask()  # drops the GIL while it works

    def _mask(self) -> bytes:
        """The next token's mask: bit ``t % 8`` of byte ``t // 8`` is set where token ``t`` is
        allowed (waits for it to be computed; computes it here if nobody asked for it)."""
        if self._pending is not None:
            self._pending.result()
            self._pending = None
        if self._stale:
            self._compute()
            self._stale = False
        return self._bits

    def allows(self, token: int) -> bool:
        """Whether ``token`` may come next."""
        bits = self._mask()
        return token >> 3 < len(bits) and bool(bits[token >> 3] >> (token & 7) & 1)

    def allowed(self, vocab: int) -> torch.Tensor:
        """Which of the ``vocab`` tokens may come next: bool ``[vocab]`` (CPU)."""
        mask = np.frombuffer(self._mask(), dtype=np.uint8)
        bits = np.unpackbits(mask, bitorder="little", count=vocab)
        return torch.from_numpy(bits.view(np.bool_))

    def packed(self) -> bytes:
        """``allowed`` packed, as llguidance computes it (see ``sampling.Constraint``)."""
        return self._mask()

    def advance(self, token: int) -> bool:
        """Take the sampled ``token``; returns whether the language is complete (nothing
        more may follow). Raises ValueError when the token is not in the language. The next
        mask is computed later, by ``prepare_masks`` (or ``mask``)."""
        if self._pending is not None:  # never advance while the mask is being computed
            self._pending.result()
            self._pending = None
        if not self._matcher.consume_token(token) or self._matcher.is_error():
            raise ValueError(f"token {token} is outside the structured output's language: "
                             f"{self._matcher.get_error()}")  # fmt: skip
        if self._matcher.is_stopped():
            return True
        self._stale = True
        return False


def _compute_all(guides: list[Guide]) -> None:
    for guide in guides:
        guide._compute()


class Grammars:
    """Compiles structured outputs against the checkpoint's tokenizer (once per specification)
    and hands out ``Guide`` s; owns the thread that computes masks."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        self._hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._tokenizer = None  # built at first use (about a second for a 150k vocabulary)
        self._lock = threading.RLock()  # guards the tokenizer and the compiled LRU
        self._compiled: collections.OrderedDict[StructuredOutput, object] = (
            collections.OrderedDict()
        )
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")

    def tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                self._tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self._eos
                )
            return self._tokenizer

    def guide(self, structured: StructuredOutput) -> Guide:
        """A fresh ``Guide`` for one request (any thread); raises RequestError
        (INVALID_ARGUMENT) naming the field when the specification is not a usable language."""
        with self._lock:
            template = self._compile(structured)
            matcher = template.deep_copy()
        return Guide(matcher, self._executor)

    def _compile(self, structured: StructuredOutput):
        import llguidance

        template = self._compiled.get(structured)
        if template is not None:
            self._compiled.move_to_end(structured)
            return template
        field = f"sampling.structured_output.{structured.kind}"
        try:
            grammar = to_grammar(structured)
        except ValueError as exc:
            raise RequestError(ErrorKind.INVALID_ARGUMENT, f"{field} {exc}") from None
        tokenizer = self.tokenizer()
        error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
        if error:
            raise RequestError(ErrorKind.INVALID_ARGUMENT, f"{field} is not usable: {error}")
        template = llguidance.LLMatcher(tokenizer, grammar)
        if template.is_error():
            raise RequestError(
                ErrorKind.INVALID_ARGUMENT, f"{field} is not usable: {template.get_error()}"
            )
        self._compiled[structured] = template
        if len(self._compiled) > COMPILED_CACHE_SIZE:
            self._compiled.popitem(last=False)
        return template

    def prepare_masks(self, guides: list[Guide]) -> None:
        """Start computing the next mask of every guide in ``guides`` that advanced: one job on
        the worker thread for all of them (one hand-off per step), done while the next forward
        runs."""
        stale = [g for g in guides if g._stale]
        if not stale:
            return
        future = self._executor.submit(_compute_all, stale)
        for guide in stale:
            guide._pending, guide._stale = future, False

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
