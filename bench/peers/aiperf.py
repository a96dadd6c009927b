"""A run of NVIDIA's ``aiperf`` against one server: a second opinion from a client not ours.

``aiperf profile`` in chat mode, streaming, one synthetic 448x448 noise image per request
(fresh each time: no cache hits), ~40 prompt tokens, 32 output tokens with EOS ignored,
concurrency 8, 48 requests after 4 warm-up ones, counting tokens from the server's usage. It
gets the checkpoint directory as ``--tokenizer`` and no ``HF_HUB_OFFLINE`` (its offline path
only reads the Hub cache). Its artifacts go to the given folder; the figures are read back from
its ``profile_export_aiperf.json``. aiperf's "inter token latency" is each request's mean
gap, (last token - first) / (tokens - 1): ``tpot`` here; its "inter chunk latency" (the gaps
between streamed chunks) is ``itl``, as in our client (one token per chunk from both servers).
``command(..., endpoint="completions")`` drives the legacy endpoint with the same text part and
no image (``tests/slow/test_third_party_clients.py`` runs both against a local stack).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.peers import children
from bench.peers.workloads import IMAGE_SIDE, MAX_TOKENS

CONCURRENCY = 8
REQUESTS = 48
WARMUP = 4
PROMPT_TOKENS = 40
TIMEOUT_S = 900.0
EXPORT = "profile_export_aiperf.json"


@dataclass
class AiperfResult:
    requests: int
    error_rate_pct: float
    requests_per_s: float
    output_tokens_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float  # between chunks: its "inter chunk latency"
    itl_p99_ms: float
    tpot_p50_ms: float  # each request's mean: its "inter token latency"
    tpot_p99_ms: float
    errors: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def command(
    aiperf: Path,
    url: str,
    model: str,
    tokenizer: Path,
    artifact_dir: Path,
    concurrency: int = CONCURRENCY,
    requests: int = REQUESTS,
    endpoint: str = "chat",
    warmup: int = WARMUP,
) -> list[str]:
    """``aiperf profile`` of the workload above; ``endpoint`` "chat" (an image per request) or
    "completions" (the legacy endpoint: text prompts only)."""
    if endpoint not in ("chat", "completions"):
        raise ValueError(f"endpoint must be chat or completions, got {endpoint!r}")
    side = str(IMAGE_SIDE)
    images = ["--image-batch-size", "1", "--image-format", "png",
              "--image-width-mean", side, "--image-width-stddev", "0",
              "--image-height-mean", side, "--image-height-stddev", "0"]  # fmt: skip
    return [str(aiperf), "profile", "--model", model, "--url", url,
            "--endpoint-type", endpoint, "--streaming", "--tokenizer", str(tokenizer),
            "--concurrency", str(concurrency), "--request-count", str(requests),
            "--warmup-request-count", str(warmup),
            *(images if endpoint == "chat" else []),
            "--prompt-input-tokens-mean", str(PROMPT_TOKENS), "--prompt-input-tokens-stddev", "0",
            "--output-tokens-mean", str(MAX_TOKENS), "--output-tokens-stddev", "0",
            "--extra-inputs", "ignore_eos:true", "--use-server-token-count",
            "--artifact-dir", str(artifact_dir), "--ui-type", "none"]  # fmt: skip


def _metric(export: dict, name: str, stat: str = "avg") -> float:
    value = (export.get(name) or {}).get(stat)
    return float(value) if value is not None else 0.0


def parse_export(export: dict) -> AiperfResult:
    """The figures of one ``profile_export_aiperf.json``."""
    errors = [json.dumps(e)[:300] for e in export.get("error_summary") or []]
    return AiperfResult(
        requests=int(_metric(export, "request_count")),
        error_rate_pct=_metric(export, "request_error_rate"),
        requests_per_s=_metric(export, "request_throughput"),
        output_tokens_per_s=_metric(export, "output_token_throughput"),
        ttft_p50_ms=_metric(export, "time_to_first_token", "p50"),
        ttft_p99_ms=_metric(export, "time_to_first_token", "p99"),
        itl_p50_ms=_metric(export, "inter_chunk_latency", "p50"),
        itl_p99_ms=_metric(export, "inter_chunk_latency", "p99"),
        tpot_p50_ms=_metric(export, "inter_token_latency", "p50"),
        tpot_p99_ms=_metric(export, "inter_token_latency", "p99"),
        errors=errors,
    )


def run_aiperf(argv: list[str], artifact_dir: Path, timeout_s: float = TIMEOUT_S) -> AiperfResult:
    """One ``aiperf profile`` (``argv``, as ``command`` builds it for ``artifact_dir``); its
    console output goes to ``aiperf.log`` in ``artifact_dir``. Raises with the log's tail when it
    fails (a run past ``timeout_s`` is stopped, with every process it started)."""
    artifact_dir.mkdir(parents=True, exist_ok=True)
    log = artifact_dir / "aiperf.log"
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "PYTHONPATH")}
    python = Path(argv[0]).parent / "python"  # the aiperf venv's own
    url = argv[argv.index("--url") + 1]
    with open(log, "wb") as out:
        proc = children.spawn(python, argv, out, env, artifact_dir)
        try:
            rc = proc.wait(timeout_s)
        finally:
            children.stop_group(proc, 10.0)  # its services, on a timeout or an interrupt too
    export = artifact_dir / EXPORT
    if rc != 0 or not export.is_file():
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"aiperf failed (exit {rc}) against {url}:\n{tail}")
    return parse_export(json.loads(export.read_text()))
