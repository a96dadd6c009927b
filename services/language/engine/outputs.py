"""What the engine reports: a request's ``RequestOutput`` and the engine's ``EngineLoad``."""

from __future__ import annotations

import time
from dataclasses import dataclass

from services.language.engine.request import ErrorKind, Request, RequestOutput


@dataclass(frozen=True)
class EngineLoad:
    num_running: int
    num_waiting: int
    num_receiving: int
    num_kv_slots_used: int
    num_kv_slots_total: int
    num_radix_hit_tokens: int
    num_radix_tokens: int
    num_radix_locked_tokens: int = 0  # held by requests in flight: not evictable
    num_evicted_tokens: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0


def _span(start: float, end: float) -> float:
    """Seconds from ``start`` to ``end``; 0 while either has not happened (or, for a prompt
    prefilled while it still arrived, when ``end`` came first)."""
    return max(0.0, end - start) if start and end else 0.0


def request_output(
    req: Request,
    token_ids: list[int],
    text: str,
    error: str = "",
    error_kind: ErrorKind = ErrorKind.NONE,
) -> RequestOutput:
    """``req``'s output of this step (its finish reason and usage as they are now)."""
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
        error_kind=error_kind,
        index=req.index,
    )
