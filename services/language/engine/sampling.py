"""Sampling parameters and the sampler (greedy, temperature, min-p, top-k, top-p, per-request
seed). The logits controls that come before the sampler (logit_bias, min_tokens, penalties) are
``penalties.py``'s; structured output's token masks are ``grammar.py``'s.

``SamplingParams`` refuses values the sampler cannot use (a ValueError naming the field and its
bound), so a bad request is turned away at admission instead of failing inside a batch. The
sampler itself isolates rows: ``sample`` returns, per row, either a token or the exception that
row raised, and a row with a NaN or +inf logit (or nothing but -inf) is an error for that request
alone; a -inf logit among finite ones is a token of probability 0.

NOTE: temperatures in (0, ``MIN_TEMPERATURE``) are sampled at ``MIN_TEMPERATURE``: dividing
logits by a tiny temperature overflows float32 to inf (and softmax to NaN); at 1e-2 the
distribution is already as good as greedy for any realistic logit gap.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import numpy as np
import torch

from common.native_kernels import NativeKernels
from common.sampling_bounds import (
    MAX_ABS_LOGIT_BIAS,
    MAX_ABS_PENALTY,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_N,
    MAX_REPETITION_PENALTY,
)

MAX_TEMPERATURE = 100.0
MIN_TEMPERATURE = 1e-2  # sampling temperatures below this are clamped up to it
MAX_TOP_LOGPROBS = 20  # most likely tokens reported per step, at most (as other APIs)
STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 1 << 16  # a schema, regex or grammar longer than this is refused
MAX_CHOICES = 256  # strings a choice may list


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's output must be. ``spec``: the JSON schema text, the regex, the grammar,
    or (``choice``) the JSON list of the strings; "" for ``json_object``."""

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        """Checks the kind and the size; whether ``spec`` is a usable language is the
        grammar engine's to say (``grammar.py``)."""
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(
                f"structured_output must be one of {', '.join(STRUCTURED_KINDS)}, got {self.kind!r}"
            )
        if len(self.spec) > MAX_SPEC_CHARS:
            raise ValueError(
                f"structured_output.{self.kind} has {len(self.spec)} characters, more than "
                f"the limit of {MAX_SPEC_CHARS}"
            )

    @classmethod
    def choice(cls, choices: list[str]) -> StructuredOutput:
        return cls("choice", json.dumps(list(choices)))


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling settings.

    ``max_new_tokens`` None means the worker's default, shortened to fit ``max_seq_len``.
    """

    max_new_tokens: int | None = 16
    temperature: float = 0.0  # 0 = greedy; finite, in [0, 100]
    top_p: float = 1.0  # 1 = off; finite, in (0, 1]
    top_k: int = 0  # 0 = off
    seed: int | None = None  # reproducible sampling when set
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings, cut from the output
    ignore_eos: bool = False
    logprobs: bool = False  # report each token's log-probability (see ``token_logprob``)
    top_logprobs: int = 0  # and the step's most likely tokens; > 0 implies logprobs
    # logits controls (``penalties.py``), each off at its default
    frequency_penalty: float = 0.0  # [-2, 2], times each generated token's count
    presence_penalty: float = 0.0  # [-2, 2], once for each token generated so far
    repetition_penalty: float = 1.0  # (0, 10], over the prompt's and the generated tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]), ids unique
    min_p: float = 0.0  # [0, 1]: drop tokens below min_p times the most likely one's probability
    min_tokens: int = 0  # no EOS, stop id or stop string ends it before this many tokens
    structured: StructuredOutput | None = None  # the language the output must be in
    # each prompt token's log-probability and this many most likely tokens at its position;
    # None = none (see ``Request.wants_prompt_logprobs``)
    prompt_logprobs: int | None = None
    # choices of the request, each its own sequence over one shared prefill (``engine.py``);
    # with a seed, choice i samples with seed + i
    n: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], got {self.n}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not (math.isfinite(self.temperature) and 0 <= self.temperature <= MAX_TEMPERATURE):
            raise ValueError(
                f"temperature must be a finite number in [0, {MAX_TEMPERATURE:g}], "
                f"got {self.temperature}"
            )
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be a finite number in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        bad = [t for t in self.stop_token_ids if t < 0]
        if bad:
            raise ValueError(f"stop_token_ids must be >= 0, got {bad[0]}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(
                f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}"
            )
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(
                f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs}"
            )
        self._check_controls()

    def _check_controls(self) -> None:
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not (-MAX_ABS_PENALTY <= value <= MAX_ABS_PENALTY):  # NaN fails too
                raise ValueError(
                    f"{name} must be a finite number in [{-MAX_ABS_PENALTY:g}, "
                    f"{MAX_ABS_PENALTY:g}], got {value}"
                )
        if not (0 < self.repetition_penalty <= MAX_REPETITION_PENALTY):
            raise ValueError(
                f"repetition_penalty must be a finite number in (0, {MAX_REPETITION_PENALTY:g}] "
                f"(1 = off), got {self.repetition_penalty}"
            )
        if not (0 <= self.min_p <= 1):
            raise ValueError(f"min_p must be a finite number in [0, 1], got {self.min_p}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_new_tokens is not None and self.min_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_tokens must be at most max_new_tokens ({self.max_new_tokens}), "
                f"got {self.min_tokens}"
            )
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(
                f"logit_bias has {len(self.logit_bias)} entries, more than the limit of "
                f"{MAX_LOGIT_BIAS_ENTRIES}"
            )
        seen: set[int] = set()
        for token_id, bias in self.logit_bias:
            if token_id < 0:
                raise ValueError(f"logit_bias token ids must be >= 0, got {token_id}")
            if token_id in seen:
                raise ValueError(f"logit_bias has token id {token_id} twice")
            seen.add(token_id)
            if not (-MAX_ABS_LOGIT_BIAS <= bias <= MAX_ABS_LOGIT_BIAS):
                raise ValueError(
                    f"logit_bias values must be finite numbers in [{-MAX_ABS_LOGIT_BIAS:g}, "
                    f"{MAX_ABS_LOGIT_BIAS:g}], got {bias} for token {token_id}"
                )

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs or self.top_logprobs > 0

    @property
    def uses_penalties(self) -> bool:
        """Whether the repetition, frequency or presence penalty is on (they need the
        request's token history)."""
        return (
            self.frequency_penalty != 0
            or self.presence_penalty != 0
            or self.repetition_penalty != 1
        )

    @property
    def uses_logits_controls(self) -> bool:
        """Whether ``penalties.process_logits`` changes this request's logits at some step."""
        return bool(self.logit_bias) or self.min_tokens > 0 or self.uses_penalties


@dataclass
class SamplerState:
    """Per-request random state: seeded requests draw from their own generator."""

    params: SamplingParams
    generator: torch.Generator | None = field(default=None)

    @classmethod
    def create(cls, params: SamplingParams) -> SamplerState:
        gen = None
        if params.seed is not None and params.temperature > 0:
            gen = torch.Generator().manual_seed(int(params.seed) & (2**63 - 1))
        return cls(params, gen)

    def uniform(self) -> float:
        """The next uniform draw of this request's generator (``next_uniform``)."""
        return next_uniform(self.generator)

    def sample(self, row: torch.Tensor) -> int:
        """One token from ``row`` [vocab] (float32, CPU, finite): temperature, then min-p,
        top-k and top-p (vLLM's order), then a draw."""
        p = self.params
        if p.temperature == 0:
            return int(row.argmax())
        row = row / max(p.temperature, MIN_TEMPERATURE)
        if p.min_p > 0:
            probs = torch.softmax(row, dim=-1)
            row = row.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
        if 0 < p.top_k < row.shape[0]:
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            probs = nucleus(probs, p.top_p)
        return draw(probs, self.generator)


NUCLEUS_FIRST = 1024  # most likely tokens ``nucleus`` looks at before sorting the whole row


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """``probs`` [vocab] with only the smallest set of most likely tokens whose mass reaches
    ``top_p`` kept, the rest 0. NOTE: the most likely ``NUCLEUS_FIRST`` first (``topk``, ~0.3
    ms); the whole row sorted (~15 ms at 152k on a CPU) only when they fall short of
    ``top_p``, as a flat distribution's do."""
    values, order = torch.topk(probs, min(NUCLEUS_FIRST, probs.shape[0]))  # most likely first
    cumulative = values.cumsum(0)
    if values.shape[0] < probs.shape[0] and cumulative[-1] <= top_p:  # the next may be kept
        values, order = probs.sort(descending=True)
        cumulative = values.cumsum(0)
    keep = cumulative - values <= top_p  # the mass before a kept token is within top_p
    return torch.zeros_like(probs).index_put_((order[keep],), values[keep])


def next_uniform(generator: torch.Generator | None) -> float:
    """The next uniform draw in [0, 1) of ``generator`` (None: torch's global one), float64:
    the one number each sampled token takes, on either sampler, so a seed draws the same
    tokens on both."""
    return float(torch.rand(1, generator=generator, dtype=torch.float64))


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One index of ``probs`` [vocab] (non-negative, not all 0) drawn with probability
    ``probs[i] / probs.sum()``: the inverse of its float64 cumulative sum at one uniform draw.
    NOTE: ``torch.multinomial`` on one CPU row of 152k took ~3 ms, this ~0.2 ms."""
    cumulative = probs.double().cumsum(0)
    u = next_uniform(generator) * cumulative[-1]
    index = int(torch.searchsorted(cumulative, u, right=True))  # first cumulative above u
    if index >= probs.shape[0]:  # u rounded up to the total: the last token with mass
        index = int(probs.nonzero()[-1, 0])
    return index


BLOCK = 256  # columns ``row_max`` reduces at once


def row_max(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits.max(dim=-1)`` of ``logits`` [S, vocab]: each row's maximum and its first index
    (as argmax on ties; a NaN anywhere in a row is its max, as is a +inf).

    NOTE: a max with indices over a whole 152k-wide row is a scalar loop on the CPU (~0.65 ms
    for 16 fp32 rows, 0.85 ms in bf16); the vectorised ``amax`` of ``BLOCK``-wide blocks, then
    the index inside each row's winning block, gives the same answer in a third of the time. A
    vocabulary that is not a multiple of ``BLOCK`` has its last ``vocab % BLOCK`` columns
    reduced on their own and compared after (the earlier columns win ties).
    """
    num_rows, vocab = logits.shape
    body = vocab - vocab % BLOCK
    if body == 0:
        return logits.max(dim=-1)
    blocks = logits[:, :body].view(num_rows, body // BLOCK, BLOCK)
    block_max = blocks.amax(dim=-1)  # [S, body / BLOCK]; NaN propagates
    best_block = block_max.argmax(dim=-1)  # the first block holding the max (NaN counts as max)
    rows = torch.arange(num_rows, device=logits.device)
    within = blocks[rows, best_block].argmax(dim=-1)
    values, indices = block_max[rows, best_block], best_block * BLOCK + within
    if body == vocab:
        return values, indices
    tail_values, tail_indices = logits[:, body:].max(dim=-1)
    tail_wins = (tail_values > values) | (tail_values.isnan() & ~values.isnan())
    return torch.where(tail_wins, tail_values, values), torch.where(
        tail_wins, tail_indices + body, indices
    )


def top_k_rows(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest values of each row of ``x`` [S, vocab] (most likely first) and their
    indices, as ``torch.topk`` (which of equal values is taken may differ, as topk's may).

    NOTE: ``torch.topk`` of 5 over 16 rows of 152k took ~1.5 ms on the CPU. The ``k`` blocks
    of ``BLOCK`` columns with the largest maxima hold a row's ``k`` largest values (any other
    block's values are at most the k-th largest maximum, each of which is a value already
    held), so topk runs over those blocks' columns alone after one vectorised ``amax``."""
    num_rows, vocab = x.shape
    body = vocab - vocab % BLOCK
    if k * BLOCK * 4 > body:
        return torch.topk(x, k, dim=-1)
    blocks = x[:, :body].view(num_rows, body // BLOCK, BLOCK)
    block_top = torch.topk(blocks.amax(dim=-1), k, dim=-1).indices  # [S, k]
    rows = torch.arange(num_rows, device=x.device)[:, None]
    columns = (block_top[:, :, None] * BLOCK + torch.arange(BLOCK, device=x.device)).flatten(1)
    if body < vocab:  # the last vocab % BLOCK columns are candidates too
        tail = torch.arange(body, vocab, device=x.device).expand(num_rows, -1)
        columns = torch.cat([columns, tail], dim=1)
    values, at = torch.topk(x[rows, columns], k, dim=-1)
    return values, columns.gather(1, at)


class NonFiniteLogitsError(ValueError):
    """The model produced NaN or +inf logits for one request (e.g. from its image rows)."""

    def __init__(self) -> None:
        super().__init__("the model produced non-finite logits (NaN or +inf)")


def greedy_tokens(values: torch.Tensor, indices: torch.Tensor) -> list[int | Exception]:
    """Greedy rows' tokens from their logits' maxima ``values`` and first indices ``indices``
    (``row_max``'s, or the LM head's own): a row whose maximum is not finite fails alone."""
    # NOTE: in Python: a few rows' torch.isfinite costs ~80 us here, its dispatch and not its work
    return [
        token if math.isfinite(value) else NonFiniteLogitsError()
        for value, token in zip(values.tolist(), indices.tolist(), strict=True)
    ]


class Constraint(Protocol):
    """What a row's next token must satisfy (structured output's ``grammar.Guide``)."""

    def allows(self, token: int) -> bool: ...

    def allowed(self, vocab: int) -> torch.Tensor:
        """bool ``[vocab]`` (CPU): True where the token may come next."""
        ...

    def packed(self) -> bytes:
        """The same, packed: bit ``t % 8`` of byte ``t // 8`` is set where token ``t`` may
        come next (tokens past its end may not)."""
        ...


class NoAllowedTokenError(ValueError):
    """Every token the row's constraint allows has a logit of -inf."""


def sample(
    logits: torch.Tensor,
    states: list[SamplerState],
    constraints: Sequence[Constraint | None] | None = None,
    kernels: NativeKernels | None = None,
) -> list[int | Exception]:
    """One token per row of ``logits`` [S, vocab] (any float dtype, any device), or the
    exception that row raised; ``constraints[i]`` (when given) limits row ``i``'s tokens.

    Greedy rows need only the row maxima: one reduction on the logits' device, and only
    ``[S]`` values move to the CPU; a constrained greedy row keeps its maximum when the
    constraint allows it (the first maximum of the whole row is then the first of the allowed
    ones); the greedy rows whose maximum their constraint forbids take the maximum of the
    allowed tokens, all such rows in one masked reduction. A row is copied over (as float32)
    only to be sampled. A row's failure (a NaN or +inf logit, no allowed token, a sampler
    error) is that request's alone: the other rows are sampled as usual.

    With ``kernels`` (CPU logits), the sampled rows without a constraint are drawn together by
    the native sampler (``NativeKernels.sample_rows``: no sort, rows in parallel). NOTE: per
    row in torch, a 152k row took ~0.3 ms at temperature 1 and ~10 ms with a top_p its 1,024
    most likely tokens fall short of (the whole row sorted); 16 rows natively, 0.84 and 2.6 ms.
    """
    together = kernels is not None and NativeKernels.supports(logits)
    if together and not any(constraints or ()) and all(s.params.temperature for s in states):
        return _draw_rows(logits, list(range(len(states))), states, kernels)  # no greedy row
    greedy = greedy_tokens(*row_max(logits))
    out: list[int | Exception | None] = []  # None: a greedy row whose maximum is forbidden
    drawn: list[int] = []  # rows the native sampler draws (their place in out is held)
    for i, (state, token) in enumerate(zip(states, greedy, strict=True)):
        constraint = constraints[i] if constraints else None
        if isinstance(token, Exception):
            out.append(token)
        elif state.params.temperature == 0 and (constraint is None or constraint.allows(token)):
            out.append(token)
        elif state.params.temperature == 0:
            out.append(None)
        elif together and constraint is None:
            drawn.append(i)
            out.append(0)
        else:
            try:
                out.append(_draw(logits[i].float().cpu(), state, constraint))
            except Exception as exc:  # isolated to this request
                out.append(exc)
    if drawn:
        for i, token in zip(drawn, _draw_rows(logits, drawn, states, kernels), strict=True):
            out[i] = token
    forbidden_max = [i for i, token in enumerate(out) if token is None]
    if forbidden_max:
        row_constraints = [constraints[i] for i in forbidden_max]
        maxima = [greedy[i] for i in forbidden_max]
        tokens = _allowed_max(logits, forbidden_max, maxima, row_constraints)
        for i, token in zip(forbidden_max, tokens, strict=True):
            out[i] = token
    return out


NO_ALLOWED_TOKEN = "no token the structured output allows has a finite logit"
NEXT_MAXIMA = 3  # rounds of "forbid the maximum, take the next one" before the masked reduction


def _allowed_max(
    logits: torch.Tensor, rows: list[int], forbidden: list[int], constraints: list[Constraint]
) -> list[int | Exception]:
    """The first maximum among the allowed tokens of each of ``rows`` of ``logits``, whose
    maximum ``forbidden[i]`` its constraint forbids.

    A grammar that forbids a row's maximum mostly allows nearly everything else (inside a JSON
    string every token without a quote or a control character), so first a few rounds over a
    copy of those rows: the forbidden maximum goes to -inf and the next first maximum is asked
    about (one bit of the mask). Removing forbidden maxima one by one leaves the first maximum
    of the allowed tokens on top, ties in index order included. Rows still without a token
    after ``NEXT_MAXIMA`` rounds (or whose next maximum is -inf) take the masked reduction
    over their whole mask (``_masked_max``)."""
    out: list[int | Exception | None] = [None] * len(rows)
    forbidden = list(forbidden)  # each row's latest forbidden maximum (the caller's list stays)
    pending = list(range(len(rows)))
    copy = logits.index_select(0, torch.tensor(rows, device=logits.device))
    for _ in range(NEXT_MAXIMA):
        index = torch.tensor(pending, device=logits.device)
        drop = torch.tensor([forbidden[j] for j in pending], device=logits.device)
        copy.index_put_((index, drop), torch.tensor(float("-inf"), dtype=copy.dtype))
        values, tokens = row_max(copy if len(pending) == len(rows) else copy[index])
        still = []
        for j, value, token in zip(pending, values.tolist(), tokens.tolist(), strict=True):
            if value == float("-inf"):
                still.append(j)  # nothing finite left but forbidden tokens, perhaps: exactly below
            elif constraints[j].allows(token):
                out[j] = token
            else:
                forbidden[j] = token
                still.append(j)
        pending = still
        if not pending:
            return out  # type: ignore[return-value]
    tokens = _masked_max(
        logits, [rows[j] for j in pending], [constraints[j].packed() for j in pending]
    )
    for j, token in zip(pending, tokens, strict=True):
        out[j] = token
    return out  # type: ignore[return-value]


def _masked_max(
    logits: torch.Tensor, rows: list[int], packed: list[bytes]
) -> list[int | Exception]:
    """The first maximum among the allowed tokens (``packed`` masks, see ``Constraint``) of
    each of ``rows`` of ``logits``, in one reduction (``NoAllowedTokenError`` for a row whose
    allowed logits are all -inf).

    The rows get a penalty added: 0 at allowed tokens (their logits unchanged, so ties and
    maxima are the plain row's), minus the dtype's largest value at forbidden ones. NOTE: an
    add, not ``masked_fill``: filling by a bool mask as irregular as a grammar's branches per
    element (~9 ms for 16 rows of a 152k vocabulary here, ~0.5 ms for the add). These rows'
    logits are finite (``sample`` checked), so a forbidden token never outranks an allowed
    finite one, and a maximum at or below minus half that value means none allowed is finite.
    """
    vocab = logits.shape[-1]
    width = (vocab + 7) // 8
    masks = np.zeros((len(rows), width), dtype=np.uint8)
    for i, mask in enumerate(packed):
        n = min(len(mask), width)
        masks[i, :n] = np.frombuffer(mask, dtype=np.uint8, count=n)
    big = torch.finfo(logits.dtype).max  # a forbidden token's penalty is -big
    # the 8 penalties of each mask byte, looked up (one pass, not unpack + convert + scale)
    byte_bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
    by_byte = byte_bits.to(logits.dtype).sub_(1).mul_(big).to(logits.device)
    mask_bytes = torch.from_numpy(masks).view(-1).to(device=logits.device, dtype=torch.long)
    penalty = by_byte.index_select(0, mask_bytes).view(len(rows), width * 8)[:, :vocab]
    index = torch.tensor(rows, device=logits.device)
    values, tokens = row_max(logits.index_select(0, index).add_(penalty))
    return [
        token if value > -big / 2 else NoAllowedTokenError(NO_ALLOWED_TOKEN)
        for value, token in zip(values.tolist(), tokens.tolist(), strict=True)
    ]


def _draw_rows(
    logits: torch.Tensor, rows: list[int], states: list[SamplerState], kernels: NativeKernels
) -> list[int | Exception]:
    """The tokens of ``rows`` of ``logits``, drawn by the native sampler with each row's
    settings and the next uniform of its generator (``NonFiniteLogitsError`` for a row with a
    NaN or +inf logit or nothing finite); a row whose draw fails fails alone, a failure of the
    kernel fails these rows."""
    out: list[int | Exception] = []
    uniform: list[float] = []
    for i in rows:
        try:
            uniform.append(states[i].uniform())
            out.append(0)
        except Exception as exc:  # isolated to this request
            out.append(exc)
    ok = [i for i, token in zip(rows, out, strict=True) if not isinstance(token, Exception)]
    if not ok:
        return out
    params = [states[i].params for i in ok]
    try:
        tokens = iter(
            kernels.sample_rows(
                logits if len(ok) == logits.shape[0] else logits[ok],
                [max(p.temperature, MIN_TEMPERATURE) for p in params],
                [p.top_k for p in params],
                [p.top_p for p in params],
                [p.min_p for p in params],
                torch.tensor(uniform, dtype=torch.float64),
            )
        )
    except Exception as exc:  # isolated to these requests
        return [exc] * len(rows)
    return [
        token if isinstance(token, Exception) else _token_or_error(next(tokens)) for token in out
    ]


def _token_or_error(token: int) -> int | Exception:
    return token if token >= 0 else NonFiniteLogitsError()


def _draw(row: torch.Tensor, state: SamplerState, constraint: Constraint | None) -> int:
    if constraint is not None:
        row = row.masked_fill(~constraint.allowed(row.shape[0]), float("-inf"))
        if row.max() == float("-inf"):
            raise NoAllowedTokenError(NO_ALLOWED_TOKEN)
    return state.sample(row)


class TopLogprob(NamedTuple):
    """One of a step's most likely tokens."""

    token_id: int
    logprob: float
    token: str = ""  # its text and bytes (``token_text.py``), filled in by the engine
    token_bytes: bytes = b""


class TokenLogprob(NamedTuple):
    """A token's log-probability and its step's ``top`` most likely tokens."""

    token_id: int
    logprob: float  # NaN for a prompt's first token (nothing precedes it)
    top: list[TopLogprob]  # most likely first
    token: str = ""  # its text and bytes (``token_text.py``), filled in by the engine
    token_bytes: bytes = b""


def token_logprob(row: torch.Tensor, token: int, num_top: int) -> TokenLogprob:
    """Log-probabilities of the model's distribution at one step (log-softmax of the logits in
    float32, before temperature, top-k and top-p: what was computed, not how it was drawn)."""
    return token_logprobs(row[None], [token], num_top)[0]


PROMPT_LOGPROB_ROWS = 64  # rows log-softmaxed at once: [64, vocab] float32 (39 MB at 152k)


def token_logprobs(logits: torch.Tensor, tokens: list[int], num_top: int) -> list[TokenLogprob]:
    """``token_logprob`` of each row of ``logits`` [n, vocab] and its token ``tokens[i]``,
    ``PROMPT_LOGPROB_ROWS`` rows at a time so that memory stays bounded for a long prompt."""
    out: list[TokenLogprob] = []
    num_top = min(num_top, logits.shape[-1])
    for start in range(0, len(tokens), PROMPT_LOGPROB_ROWS):
        rows = logits[start : start + PROMPT_LOGPROB_ROWS]
        ids = torch.tensor(tokens[start : start + PROMPT_LOGPROB_ROWS], device=rows.device)
        logprobs = torch.log_softmax(rows.float(), dim=-1)
        chosen = logprobs.gather(1, ids[:, None])[:, 0].cpu().tolist()
        if num_top:
            values, top_ids = top_k_rows(logprobs, num_top)
            tops = zip(top_ids.cpu().tolist(), values.cpu().tolist(), strict=True)
        else:
            tops = [([], [])] * len(chosen)
        for token, logprob, (top_row, value_row) in zip(
            tokens[start : start + PROMPT_LOGPROB_ROWS], chosen, tops, strict=True
        ):
            top = [TopLogprob(t, v) for t, v in zip(top_row, value_row, strict=True)]
            out.append(TokenLogprob(token, logprob, top))
    return out
