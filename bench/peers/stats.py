"""Aggregation of the client's per-request timings into one row per system and cell.

Several runs of one cell (the A B B A repeats) pool into one ``Summary``: rates are successful
requests (and their output tokens) over the runs' summed wall time; percentiles are over every
successful request's TTFT, mean inter-token latency (TPOT) and end-to-end time, and over every
inter-token gap (ITL: a server that sends tokens in bursts has a low ITL p50 and a high p99,
while its TPOT is the same). Failures are
counted and their first distinct reasons kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from bench.peers.client import RunResult

MAX_ERRORS = 3


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (linear interpolation); 0.0 for no values."""
    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else 0.0


@dataclass
class Summary:
    requests: int  # sent
    failures: int
    wall_s: float
    requests_per_s: float
    output_tokens_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    e2e_p50_ms: float
    output_tokens: int
    errors: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def summarize(runs: Sequence[RunResult]) -> Summary:
    """One summary of ``runs`` (one or more runs of the same cell against one system)."""
    results = [r for run in runs for r in run.results]
    ok = [r for r in results if r.ok]
    wall = sum(run.wall_s for run in runs)
    tokens = sum(r.output_tokens for r in ok)
    errors: list[str] = []
    for r in results:
        if not r.ok and r.error not in errors and len(errors) < MAX_ERRORS:
            errors.append(r.error)
    return Summary(
        requests=len(results),
        failures=len(results) - len(ok),
        wall_s=wall,
        requests_per_s=len(ok) / wall if wall > 0 else 0.0,
        output_tokens_per_s=tokens / wall if wall > 0 else 0.0,
        ttft_p50_ms=percentile([r.ttft_s for r in ok], 50) * 1e3,
        ttft_p99_ms=percentile([r.ttft_s for r in ok], 99) * 1e3,
        itl_p50_ms=percentile([g for r in ok for g in r.itl_s], 50) * 1e3,
        itl_p99_ms=percentile([g for r in ok for g in r.itl_s], 99) * 1e3,
        tpot_p50_ms=percentile([r.tpot_s for r in ok if r.itl_s], 50) * 1e3,
        tpot_p99_ms=percentile([r.tpot_s for r in ok if r.itl_s], 99) * 1e3,
        e2e_p50_ms=percentile([r.e2e_s for r in ok], 50) * 1e3,
        output_tokens=tokens,
        errors=errors,
    )


def ratio(ours: float, theirs: float) -> float:
    """ours / theirs; 0.0 when there is nothing to divide by."""
    return ours / theirs if theirs else 0.0
