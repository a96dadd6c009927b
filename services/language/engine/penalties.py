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
check per row and returns the input itself. Otherwise the logits are copied once (as float32)
and every control is one gather/scatter over flat ``(row, token)`` index tensors that hold the
entries of all the rows that use it: the work grows with the tokens a control touches (bias
entries, stop ids, distinct tokens seen), never with rows times the vocabulary, and no Python
loop goes over the vocabulary.

The penalties read a request's ``TokenHistory``: its distinct tokens seen (prompt and output) and
its distinct generated tokens with their counts, built at its first sampled step and then updated
with each new token only. Image placeholder tokens (fill ids at or above the vocabulary) are not
tokens the model can emit and are not counted.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from services.language.engine.request import Request


@dataclass
class TokenHistory:
    """One request's tokens as the penalties see them (tensors on the logits' device)."""

    seen_ids: torch.Tensor  # long [n]: the distinct tokens of the prompt and the output
    output_ids: torch.Tensor  # long [m]: the distinct generated tokens, in order of first use
    output_counts: torch.Tensor  # float32 [m]: times each of them was generated
    seen: set[int] = field(default_factory=set)  # seen_ids as a set
    output_index: dict[int, int] = field(default_factory=dict)  # token -> its place in output_ids
    num_counted: int = 0  # generated tokens counted so far

    @classmethod
    def create(
        cls, prompt_ids: torch.Tensor, vocab_size: int, device: torch.device
    ) -> TokenHistory:
        """The history of a prompt (fill ids; image placeholders are left out)."""
        text = prompt_ids[(prompt_ids >= 0) & (prompt_ids < vocab_size)].unique()
        long = dict(dtype=torch.long, device=device)
        return cls(
            seen_ids=text.to(device),
            output_ids=torch.zeros(0, **long),
            output_counts=torch.zeros(0, dtype=torch.float32, device=device),
            seen=set(text.tolist()),
        )

    def update(self, output_ids: Sequence[int]) -> None:
        """Count the tokens of ``output_ids`` (all generated so far) not counted yet."""
        new = output_ids[self.num_counted :]
        if not new:
            return
        new_seen, new_outputs, places = [], [], []
        for token in new:
            if token not in self.seen:
                self.seen.add(token)
                new_seen.append(token)
            if token not in self.output_index:
                self.output_index[token] = len(self.output_index)
                new_outputs.append(token)
            places.append(self.output_index[token])
        device = self.output_counts.device
        if new_seen:
            added = torch.tensor(new_seen, dtype=torch.long, device=device)
            self.seen_ids = torch.cat([self.seen_ids, added])
        if new_outputs:
            added = torch.tensor(new_outputs, dtype=torch.long, device=device)
            self.output_ids = torch.cat([self.output_ids, added])
            zeros = torch.zeros(len(new_outputs), dtype=torch.float32, device=device)
            self.output_counts = torch.cat([self.output_counts, zeros])
        index = torch.tensor(places, dtype=torch.long, device=device)
        self.output_counts.index_put_((index,), torch.ones(len(places), device=device), True)
        self.num_counted = len(output_ids)


def process_logits(
    logits: torch.Tensor, requests: Sequence[Request], eos_token_ids: Iterable[int]
) -> torch.Tensor:
    """The logits to sample from for ``requests`` (row ``i`` is ``requests[i]``'s): ``logits``
    itself when no request uses a control, else a float32 copy with the controls applied to
    the rows of the requests that use one. ``logits`` is never written."""
    if not any(req.params.uses_logits_controls for req in requests):
        return logits
    out = logits.to(torch.float32, copy=True)
    _apply_logit_bias(out, requests)
    _apply_min_tokens(out, requests, tuple(eos_token_ids))
    _apply_penalties(out, requests)
    return out


def _apply_logit_bias(logits: torch.Tensor, requests: Sequence[Request]) -> None:
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
    logits: torch.Tensor, requests: Sequence[Request], eos_token_ids: tuple[int, ...]
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


def _apply_penalties(logits: torch.Tensor, requests: Sequence[Request]) -> None:
    """Repetition, then frequency and presence penalties, each over the flat ``(row, token)``
    entries of all the rows that use it."""
    vocab_size, device = logits.shape[1], logits.device
    repeated = [i for i, req in enumerate(requests) if req.params.repetition_penalty != 1]
    counted = [
        i
        for i, req in enumerate(requests)
        if req.params.frequency_penalty != 0 or req.params.presence_penalty != 0
    ]
    histories = {i: token_history(requests[i], vocab_size, device) for i in {*repeated, *counted}}
    if repeated:
        tokens = [histories[i].seen_ids for i in repeated]
        rows, per_entry = _entries(repeated, tokens, device)
        penalty = per_entry([requests[i].params.repetition_penalty for i in repeated])
        index = (rows, torch.cat(tokens))
        values = logits[index]
        logits[index] = torch.where(values > 0, values / penalty, values * penalty)
    if counted:
        tokens = [histories[i].output_ids for i in counted]
        rows, per_entry = _entries(counted, tokens, device)
        frequency = per_entry([requests[i].params.frequency_penalty for i in counted])
        presence = per_entry([requests[i].params.presence_penalty for i in counted])
        counts = torch.cat([histories[i].output_counts for i in counted])
        # the (row, token) pairs are distinct: accumulate adds each penalty once
        index = (rows, torch.cat(tokens))
        logits.index_put_(index, -(frequency * counts + presence), accumulate=True)


def _entries(rows: list[int], tokens: list[torch.Tensor], device: torch.device):
    """The row of each entry of ``tokens`` (one tensor per row of ``rows``), and a function that
    spreads one value per row over that row's entries."""
    lengths = torch.tensor([t.shape[0] for t in tokens], device=device)

    def per_entry(values: list[float]) -> torch.Tensor:
        per_row = torch.tensor(values, dtype=torch.float32, device=device)
        return per_row.repeat_interleave(lengths)

    return torch.tensor(rows, device=device).repeat_interleave(lengths), per_entry


def token_history(req: Request, vocab_size: int, device: torch.device) -> TokenHistory:
    """``req``'s history, built at its first use (its prompt is complete by then) and brought up
    to date with the tokens generated since the last."""
    if req.token_history is None:
        req.token_history = TokenHistory.create(req.inputs.fill_ids, vocab_size, device)
    req.token_history.update(req.output_ids)
    return req.token_history
