"""Structured output: token masks from a grammar engine, applied in the batched sampler.

A request with a ``StructuredOutput`` (a JSON schema, any JSON object, a regex, a choice of
strings, or a Lark / GBNF grammar) gets a ``Guide``: an llguidance matcher over the checkpoint's
tokenizer, advanced by every token the request generates. Before each draw the sampler sets the
logits of every token the language does not allow to -inf (``apply_masks``, one batched
operation over the guided rows), and the request ends with ``STOP`` once the language allows
nothing more.

The mask for a request's next token is computed on the ``Grammars`` worker thread as soon as
the previous token is known (llguidance drops the GIL while it computes), so it overlaps the
next forward instead of adding to the step; ``apply_masks`` only waits for masks not done by
then.

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
        self._executor = executor
        self._mask: torch.Tensor | None = None
        self._pending: Future | None = None
        self._prepare()

    def _prepare(self) -> None:
        self._pending = self._executor.submit(self._matcher.compute_bitmask)

    def mask(self) -> torch.Tensor:
        """[1, bytes] uint8: bit ``t % 8`` of byte ``t // 8`` set where token t is allowed
        next (waits for it to be computed)."""
        if self._pending is not None:
            bits = self._pending.result()
            self._mask = torch.frombuffer(bytearray(bits), dtype=torch.uint8).unsqueeze(0)
            self._pending = None
        return self._mask

    def advance(self, token: int) -> bool:
        """Take the sampled ``token``; returns whether the language is complete (nothing
        more may follow). Raises ValueError when the token is not in the language."""
        self.mask()  # never advance while the mask is being computed
        if not self._matcher.consume_token(token) or self._matcher.is_error():
            raise ValueError(f"token {token} is outside the structured output's language: "
                             f"{self._matcher.get_error()}")  # fmt: skip
        if self._matcher.is_stopped():
            return True
        self._prepare()
        return False


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

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def apply_masks(
    logits: torch.Tensor, rows: list[int], guides: list[Guide], owned: bool = False
) -> torch.Tensor:
    """``logits`` [S, vocab] with the tokens each guided row's language forbids at -inf: a new
    tensor when ``rows`` is not empty (the caller's logits stay the model's, for
    log-probabilities) unless ``owned`` says ``logits`` is already a private copy to write
    into; ``logits`` itself when ``rows`` is empty.

    NOTE: as ``x * allowed + log(allowed)`` in one ``addcmul`` (``log`` written as
    ``(allowed - 1) / allowed``: 0 or -inf): a third of ``masked_fill``'s time on this
    vocabulary, and a NaN or +inf logit anywhere in a row still makes the row non-finite (the
    sampler's check), masked or not.
    """
    if not rows:
        return logits
    masks = torch.cat([g.mask() for g in guides]).numpy()  # [k, bytes] uint8
    vocab = logits.shape[1]
    # token 8 * b + j is bit j of byte b
    bits = np.unpackbits(masks, axis=1, bitorder="little", count=vocab)
    allowed = torch.from_numpy(bits).to(device=logits.device, dtype=logits.dtype)
    index = torch.tensor(rows, device=logits.device)
    out = logits if owned else logits.clone()
    out[index] = torch.addcmul((allowed - 1) / allowed, logits[index], allowed)
    return out
