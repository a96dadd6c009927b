"""Logits controls applied before the sampler: logit_bias, the min_tokens mask and the
repetition, frequency and presence penalties, in that order (vLLM's).

``process_logits`` takes the batch's logits (one row per sampled request) and returns the
logits the sampler draws from; the greedy rows take their argmax. For a row with controls:

* ``logit_bias``: ``logits[t] += bias[t]``;
* ``min_tokens``: while fewer than ``min_tokens`` tokens were generated, ``logits[t] = -inf``
  for the stop token ids and (unless ``ignore_eos``) the EOS ids;
* ``repetition_penalty`` ``r`` over every token of the prompt and the output:
  ``logits[t] / r`` where ``logits[t] > 0``, else ``logits[t] * r``;
* ``frequency_penalty`` ``f`` and ``presence_penalty`` ``p`` over the generated tokens only:
  ``logits[t] -= f * count[t] + p * (count[t] > 0)``.

Invariants: the input tensor is never written (log-probabilities are taken from it: the model's
distribution, as vLLM reports by default); a batch where no request uses a control costs one
check per row and returns the input itself. Otherwise the logits are copied once (as float32),
and the vocabulary-wide work runs as tensor ops over the rows that use a control, all at once.
Python loops go over rows and over bias entries (at most ``MAX_LOGIT_BIAS_ENTRIES`` each), never
over the vocabulary.

The penalties read a request's ``TokenHistory``: its generated tokens' counts and the set of
tokens seen (prompt and output), built at its first sampled step and then updated with each new
token only. Image placeholder tokens (fill ids at or above the vocabulary) are not tokens the
model can emit and are not counted.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from services.language.engine.request import Request


@dataclass
class TokenHistory:
    """One request's tokens as the penalties see them, on the logits' device."""

    output_counts: torch.Tensor  # float32 [vocab]: times each token was generated
    seen: torch.Tensor  # bool [vocab]: tokens of the prompt or the output
    num_counted: int = 0  # generated tokens counted so far

    @classmethod
    def create(
        cls, prompt_ids: torch.Tensor, vocab_size: int, device: torch.device
    ) -> TokenHistory:
        """The history of a prompt (fill ids; image placeholders are left out)."""
        seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        text = prompt_ids[(prompt_ids >= 0) & (prompt_ids < vocab_size)]
        seen[text.to(device)] = True
        counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        return cls(counts, seen)

    def update(self, output_ids: Sequence[int]) -> None:
        """Count the tokens of ``output_ids`` (all generated so far) not counted yet."""
        if len(output_ids) == self.num_counted:
            return
        new = torch.tensor(output_ids[self.num_counted :], device=self.output_counts.device)
        self.output_counts.index_put_((new,), torch.ones_like(new, dtype=torch.float32), True)
        self.seen[new] = True
        self.num_counted = len(output_ids)


def process_logits(
    logits: torch.Tensor, requests: Sequence[Request], eos_token_ids: Iterable[int]
) -> torch.Tensor:
    """The logits to sample from for ``requests`` (row ``i`` is ``requests[i]``'s): ``logits``
    itself when no request uses a control, else a float32 copy with the controls applied to
    the rows of the requests that use one. ``logits`` is never written."""
    rows = [i for i, req in enumerate(requests) if req.params.uses_logits_controls]
    if not rows:
        return logits
    out = logits.to(torch.float32, copy=True)
    controlled = [requests[i] for i in rows]
    if len(rows) == len(requests):
        _apply_controls(out, controlled, eos_token_ids)
        return out
    index = torch.tensor(rows, device=logits.device)
    part = out.index_select(0, index)
    _apply_controls(part, controlled, eos_token_ids)
    out.index_copy_(0, index, part)
    return out


def _apply_controls(
    logits: torch.Tensor, requests: list[Request], eos_token_ids: Iterable[int]
) -> None:
    """Apply every request's controls to its row of ``logits`` [len(requests), vocab] (float32,
    written in place)."""
    _apply_logit_bias(logits, requests)
    _apply_min_tokens(logits, requests, tuple(eos_token_ids))
    penalized = [i for i, req in enumerate(requests) if req.params.uses_penalties]
    if not penalized:
        return
    if len(penalized) == len(requests):
        _apply_penalties(logits, requests)
        return
    index = torch.tensor(penalized, device=logits.device)
    part = logits.index_select(0, index)
    _apply_penalties(part, [requests[i] for i in penalized])
    logits.index_copy_(0, index, part)


def _apply_logit_bias(logits: torch.Tensor, requests: list[Request]) -> None:
    row_ids: list[int] = []
    token_ids: list[int] = []
    biases: list[float] = []
    for row, req in enumerate(requests):
        for token_id, bias in req.params.logit_bias:
            row_ids.append(row)
            token_ids.append(token_id)
            biases.append(bias)
    if not row_ids:
        return
    device = logits.device
    index = (torch.tensor(row_ids, device=device), torch.tensor(token_ids, device=device))
    # each (row, token) pair occurs once (SamplingParams refuses repeated ids)
    logits.index_put_(index, torch.tensor(biases, device=device), accumulate=True)


def _apply_min_tokens(
    logits: torch.Tensor, requests: list[Request], eos_token_ids: tuple[int, ...]
) -> None:
    vocab_size = logits.shape[1]
    row_ids: list[int] = []
    token_ids: list[int] = []
    for row, req in enumerate(requests):
        p = req.params
        if len(req.output_ids) >= p.min_tokens:
            continue
        stops = set(p.stop_token_ids) if p.ignore_eos else {*p.stop_token_ids, *eos_token_ids}
        masked = [t for t in stops if t < vocab_size]
        row_ids += [row] * len(masked)
        token_ids += masked
    if row_ids:
        device = logits.device
        index = (torch.tensor(row_ids, device=device), torch.tensor(token_ids, device=device))
        logits.index_put_(index, torch.tensor(float("-inf"), device=device))


def _apply_penalties(logits: torch.Tensor, requests: list[Request]) -> None:
    """Repetition, then frequency and presence penalties, over all ``requests``' rows at once."""
    device = logits.device
    histories = [token_history(req, logits.shape[1], device) for req in requests]
    seen = torch.stack([h.seen for h in histories])
    counts = torch.stack([h.output_counts for h in histories])

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device)[:, None]

    repetition = column([req.params.repetition_penalty for req in requests])
    frequency = column([req.params.frequency_penalty for req in requests])
    presence = column([req.params.presence_penalty for req in requests])
    penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits.copy_(torch.where(seen, penalized, logits))
    logits -= frequency * counts + presence * (counts > 0)


def token_history(req: Request, vocab_size: int, device: torch.device) -> TokenHistory:
    """``req``'s history, built at its first use (its prompt is complete by then) and brought up
    to date with the tokens generated since the last."""
    if req.token_history is None:
        req.token_history = TokenHistory.create(req.inputs.fill_ids, vocab_size, device)
    req.token_history.update(req.output_ids)
    return req.token_history
