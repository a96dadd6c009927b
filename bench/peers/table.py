"""The peer benchmark's printed tables: one row per (workload, concurrency) cell with both
systems' figures and ours/vLLM ratios, and aiperf's figures beside our client's."""

from __future__ import annotations

from collections.abc import Sequence

from bench.peers.stats import ratio

# (title, key, format): "ours / vLLM = ratio" columns, then "ours / vLLM" columns
RATIO_COLUMNS = (
    ("req/s", "requests_per_s", "{:.2f}"),
    ("tok/s", "output_tokens_per_s", "{:.1f}"),
    ("TTFT p50 ms", "ttft_p50_ms", "{:.0f}"),
    ("ITL p50 ms", "itl_p50_ms", "{:.1f}"),
)
PAIR_COLUMNS = (
    ("TTFT p99 ms", "ttft_p99_ms", "{:.0f}"),
    ("ITL p99 ms", "itl_p99_ms", "{:.1f}"),
    ("TPOT p50 ms", "tpot_p50_ms", "{:.1f}"),
)
AIPERF_COLUMNS = (
    ("req/s", "requests_per_s", "{:.2f}"),
    ("tok/s", "output_tokens_per_s", "{:.1f}"),
    ("TTFT p50 ms", "ttft_p50_ms", "{:.0f}"),
    ("TTFT p99 ms", "ttft_p99_ms", "{:.0f}"),
    ("TPOT p50 ms", "tpot_p50_ms", "{:.1f}"),
    ("TPOT p99 ms", "tpot_p99_ms", "{:.1f}"),
    ("ITL p50 ms", "itl_p50_ms", "{:.1f}"),
    ("ITL p99 ms", "itl_p99_ms", "{:.1f}"),
)


def render(rows: Sequence[Sequence[str]], left: int = 1) -> str:
    """Aligned columns (the first ``left`` to the left, the rest to the right), a rule under
    the header row."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [
            v.ljust(w) if i < left else v.rjust(w)
            for i, (v, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells))
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def cells_table(result: dict) -> str:
    """Each cell: ``ours / vLLM = ratio`` for req/s, tok/s, TTFT p50 and ITL p50, the range
    of the req/s ratios of runs next to each other in time, then ``ours / vLLM`` for the p99s
    and the failures."""
    titles = [c[0] for c in RATIO_COLUMNS + PAIR_COLUMNS]
    rows = [["workload", "conc", titles[0], "req/s pairs", *titles[1:], "failed"]]
    for cell in result["cells"]:
        ours, vllm = cell["ours"], cell["vllm"]
        row = [cell["workload"], str(cell["concurrency"])]
        for _, key, fmt in RATIO_COLUMNS:
            pair = f"{fmt.format(ours[key])} / {fmt.format(vllm[key])}"
            row.append(f"{pair} = {ratio(ours[key], vllm[key]):.2f}x")
            if key == "requests_per_s":
                pairs = cell["paired_requests_ratios"]  # one per run: never empty
                row.append(f"{min(pairs):.2f}-{max(pairs):.2f}x")
        row += [f"{fmt.format(ours[k])} / {fmt.format(vllm[k])}" for _, k, fmt in PAIR_COLUMNS]
        row.append(f"{ours['failures']}/{ours['requests']} / {vllm['failures']}/{vllm['requests']}")
        rows.append(row)
    return render(rows, left=2)


def aiperf_table(result: dict) -> str:
    """aiperf's figures against each server, our client's on the same workload, and the
    ours/vLLM ratio of each."""
    rows = [["client -> server", *(c[0] for c in AIPERF_COLUMNS), "failed"]]
    figures = result["aiperf"]
    for label, key in (("aiperf", "aiperf"), ("our client", "client")):
        for system in ("ours", "vllm"):
            fig = figures[key][system]
            if fig is None:
                continue
            if "failures" in fig:
                failed = f"{fig['failures']}/{fig['requests']}"
            else:
                failed = f"{fig['error_rate_pct']:.1f}%"
            values = [fmt.format(fig[k]) for _, k, fmt in AIPERF_COLUMNS]
            rows.append([f"{label} -> {system}", *values, failed])
    for label, key in (("aiperf", "aiperf"), ("our client", "client")):
        ours, vllm = figures[key]["ours"], figures[key]["vllm"]
        if ours and vllm:
            ratios = [f"{ratio(ours[k], vllm[k]):.2f}x" for _, k, _ in AIPERF_COLUMNS]
            rows.append([f"{label}: ours/vLLM", *ratios, ""])
    return render(rows)


def format_result(result: dict) -> str:
    s = result["settings"]
    per_cell = ", ".join(f"{n} at c={c}" for c, n in s["requests_per_cell"].items())
    together = "resident together" if s["together"] else "one at a time"
    out = [
        f"peer benchmark: ours vs vLLM {s['vllm_version']} (CPU build); checkpoint "
        f"{s['checkpoint']}; dtype {s['dtype']}; {s['max_tokens']} output tokens (EOS ignored); "
        f"requests per system per cell: {per_cell}, in {s['repeats']} runs each, alternating "
        f"A B B A; servers {together}",
        "each figure: ours / vLLM = ratio (req/s, tok/s: higher is better for ours; TTFT, ITL: "
        "lower is better); ITL: every gap between tokens; TPOT: each request's mean gap",
        cells_table(result),
    ]
    for cell in result["cells"]:
        for system in ("ours", "vllm"):
            for error in cell[system]["errors"]:
                where = f"{system}, {cell['workload']} c={cell['concurrency']}"
                out.append(f"  failed ({where}): {error}")
    if result.get("aiperf"):
        a = result["aiperf"]["settings"]
        out += [
            "",
            f"aiperf {a['version']}: chat, streaming, one fresh {a['image_side']}x"
            f"{a['image_side']} image, ~{a['prompt_tokens']} prompt tokens, {s['max_tokens']} "
            f"output tokens, concurrency {a['concurrency']}, {a['requests']} requests; our "
            'client on the same workload (aiperf\'s "inter token latency" is TPOT here, its '
            '"inter chunk latency" ITL)',
            aiperf_table(result),
        ]
    return "\n".join(out)
