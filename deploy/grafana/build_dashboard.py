"""Builds ``epd-dashboard.json`` (the Grafana dashboard of an EPD deployment).

The JSON is generated so that panels stay uniform and every query is written once, here:
    python deploy/grafana/build_dashboard.py           # rewrite epd-dashboard.json
    python deploy/grafana/build_dashboard.py --check   # exit 1 when the JSON is stale

Queries use only the ``epd_*`` metric names and Grafana's ``$__rate_interval``; a series that may
legitimately be absent (a labelled counter nobody has incremented yet) ends in ``or on() vector(0)``
so that its panel shows 0 rather than "No data".
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

OUT = Path(__file__).with_name("epd-dashboard.json")
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
RATE = "[$__rate_interval]"
WIDTH = 24


def rate(metric: str) -> str:
    return f"rate({metric}{RATE})"


def target(expr: str, legend: str) -> dict[str, Any]:
    return {"datasource": DATASOURCE, "expr": expr, "legendFormat": legend, "range": True}


def quantiles(histogram: str, by: str = "", qs: tuple[float, ...] = (0.5, 0.9, 0.99)) -> list:
    """p50/p90/p99 of a histogram over the rate window, optionally split by labels ``by``."""
    group = f"le, {by}" if by else "le"
    suffix = "".join(f" {{{{{label.strip()}}}}}" for label in by.split(",") if label.strip())
    return [
        target(
            f"histogram_quantile({q}, sum by ({group}) ({rate(histogram + '_bucket')}))",
            f"p{round(q * 100)}{suffix}",
        )
        for q in qs
    ]


def mean(histogram: str, legend: str = "mean") -> dict[str, Any]:
    return target(
        f"sum({rate(histogram + '_sum')}) / sum({rate(histogram + '_count')})",
        legend,
    )


def timeseries(title: str, targets: list, unit: str, description: str, w: int = 12) -> dict:
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "gridPos": {"h": 8, "w": w},
        "fieldConfig": {
            "defaults": {
                "unit": unit,
                "min": 0,
                "custom": {
                    "drawStyle": "line",
                    "lineWidth": 1,
                    "fillOpacity": 10,
                    "showPoints": "never",
                    "spanNulls": False,
                },
            },
            "overrides": [],
        },
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
        "targets": targets,
    }


def stat(title: str, expr: str, unit: str, description: str) -> dict:
    return {
        "type": "stat",
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "gridPos": {"h": 4, "w": 6},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "value",
            "graphMode": "area",
            "justifyMode": "auto",
            "textMode": "auto",
        },
        "targets": [target(expr, title)],
    }


def row(title: str) -> dict:
    return {"type": "row", "title": title, "collapsed": False, "panels": []}


def healthy(role: str) -> str:
    return f'sum(epd_gateway_workers{{role="{role}", state="healthy"}}) or on() vector(0)'


def panels() -> list[dict]:
    return [
        row("Overview"),
        stat(
            "Requests/s",
            f"sum({rate('epd_gateway_requests_total')})",
            "reqps",
            "Requests finished per second, every outcome.",
        ),
        stat(
            "TTFT p99",
            "histogram_quantile(0.99, sum by (le) "
            f"({rate('epd_gateway_time_to_first_token_seconds_bucket')}))",
            "s",
            "99th percentile time to first token seen by the gateway.",
        ),
        stat("Healthy encoders", healthy("encoder"), "short", "Encoders the gateway routes to."),
        stat(
            "Healthy language workers",
            healthy("language"),
            "short",
            "Language workers the gateway routes to.",
        ),
        row("Requests (gateway)"),
        timeseries(
            "Request throughput by outcome",
            [
                target(
                    f"sum by (outcome) ({rate('epd_gateway_requests_total')})",
                    "{{outcome}}",
                )
            ],
            "reqps",
            "Finished requests per second by outcome.",
        ),
        timeseries(
            "Requests by front door",
            [
                target(f"sum by (api) ({rate('epd_gateway_requests_total')})", "{{api}}"),
                target(
                    "sum by (api) "
                    f"""({rate('epd_gateway_requests_total{outcome!="OK"}')}) or on() vector(0)""",
                    "{{api}} errors",
                ),
            ],
            "reqps",
            "Finished requests per second through the gRPC API and the OpenAI-compatible HTTP "
            "API (api label), and those that did not end OK.",
        ),
        timeseries(
            "Time to first token",
            quantiles("epd_gateway_time_to_first_token_seconds"),
            "s",
            "From request arrival at the gateway to the first streamed token.",
        ),
        timeseries(
            "Inter-token latency",
            quantiles("epd_gateway_inter_token_latency_seconds"),
            "s",
            "Time between consecutive streamed tokens of a request.",
        ),
        timeseries(
            "End-to-end request latency",
            quantiles("epd_gateway_e2e_request_latency_seconds"),
            "s",
            "From arrival to the last token.",
        ),
        timeseries(
            "Gateway queue time",
            quantiles("epd_gateway_queue_time_seconds"),
            "s",
            "Time a request waits for admission before it is routed.",
        ),
        row("Pools and routing"),
        timeseries(
            "Workers by pool and state",
            [target("sum by (role, state) (epd_gateway_workers)", "{{role}} {{state}}")],
            "short",
            "Registered workers per pool, healthy or not (per-pool health).",
            w=8,
        ),
        timeseries(
            "In-flight requests per worker",
            [
                target(
                    "sum by (role, worker) (epd_gateway_worker_in_flight)",
                    "{{role}} {{worker}}",
                )
            ],
            "short",
            "Requests the gateway has outstanding on each worker.",
            w=8,
        ),
        timeseries(
            "Routing decisions",
            [
                target(
                    f"sum by (role, reason) ({rate('epd_gateway_routing_decisions_total')})",
                    "{{role}} {{reason}}",
                )
            ],
            "ops",
            "Why each worker was picked: affinity, load, retry or text_only.",
            w=8,
        ),
        row("Encoder"),
        timeseries(
            "Encoder queue depth",
            [
                target("sum by (instance) (epd_encoder_queue_depth)", "queued {{instance}}"),
                target("sum(epd_encoder_images_in_flight)", "images in flight (all)"),
            ],
            "short",
            "Requests queued per encoder (the encoder HPA's metric) and images being encoded.",
        ),
        timeseries(
            "Encoder batch size",
            [*quantiles("epd_encoder_batch_size", qs=(0.5, 0.99)), mean("epd_encoder_batch_size")],
            "short",
            "Images per ViT forward.",
        ),
        timeseries(
            "Preprocess and ViT time",
            [
                *[
                    {**t, "legendFormat": "preprocess " + t["legendFormat"]}
                    for t in quantiles("epd_encoder_preprocess_seconds", qs=(0.5, 0.99))
                ],
                *[
                    {**t, "legendFormat": "vit " + t["legendFormat"]}
                    for t in quantiles("epd_encoder_vit_seconds", qs=(0.5, 0.99))
                ],
            ],
            "s",
            "Image decode + resize + processor time, and ViT forward time per batch.",
        ),
        timeseries(
            "Embedding cache hit rate",
            [
                target(
                    f"sum({rate('epd_encoder_cache_hits_total')}) / "
                    f"(sum({rate('epd_encoder_cache_hits_total')}) + "
                    f"sum({rate('epd_encoder_cache_misses_total')}))",
                    "hit rate",
                ),
                target(
                    "sum(epd_encoder_cache_hits_total) / clamp_min("
                    "sum(epd_encoder_cache_hits_total) + sum(epd_encoder_cache_misses_total), 1)",
                    "since start",
                ),
            ],
            "percentunit",
            "Images whose embeddings came from the encoder's content-hash cache.",
        ),
        timeseries(
            "Embedding cache bytes",
            [target("sum by (instance) (epd_encoder_cache_bytes)", "{{instance}}")],
            "bytes",
            "Bytes held by each encoder's embedding cache.",
        ),
        timeseries(
            "Embedding cache evictions",
            [target(f"sum({rate('epd_encoder_cache_evictions_total')})", "evictions/s")],
            "ops",
            "Entries evicted from the embedding caches per second.",
        ),
        timeseries(
            "Video frames and videos",
            [
                target(
                    f"sum by (instance) ({rate('epd_encoder_video_frames_total')})",
                    "frames/s {{instance}}",
                ),
                target(f"sum({rate('epd_encoder_video_decode_seconds_count')})", "videos/s (all)"),
            ],
            "short",
            "Video frames sampled and decoded per second by each encoder, and videos per second.",
        ),
        timeseries(
            "Video decode time",
            [
                *quantiles("epd_encoder_video_decode_seconds"),
                mean("epd_encoder_video_decode_seconds"),
            ],
            "s",
            "Seconds per video: probe, decode of the sampled frames, resize and patches.",
        ),
        row("Transfer (Mooncake)"),
        timeseries(
            "Transfer throughput",
            [
                target(
                    f"sum by (side) ({rate('epd_transfer_bytes_total')}) / 1e9",
                    "{{side}}",
                )
            ],
            "GBs",
            "Embedding bytes moved per second, in GB/s, by side (sender / receiver).",
        ),
        timeseries(
            "Chunk write time",
            quantiles("epd_transfer_seconds", by="side", qs=(0.5, 0.99)),
            "s",
            "Duration of one batched Mooncake write (one run of destination blocks).",
        ),
        timeseries(
            "Continuations per room",
            [
                *quantiles("epd_transfer_continuations_per_room", qs=(0.5, 0.99)),
                mean("epd_transfer_continuations_per_room"),
            ],
            "short",
            "Extra init rounds a room needed because the prompt outgrew the first allocation.",
            w=8,
        ),
        timeseries(
            "Failed rooms by reason",
            [
                target(
                    "sum by (side, reason) "
                    f"(increase(epd_transfer_failed_rooms_total{RATE})) or on() vector(0)",
                    "{{side}} {{reason}}",
                )
            ],
            "short",
            "Rooms that ended Failed, by side and reason (0 when none failed).",
            w=8,
        ),
        timeseries(
            "Rooms by state",
            [
                target(
                    "sum by (side, state) (epd_transfer_rooms) or on() vector(0)",
                    "{{side}} {{state}}",
                )
            ],
            "short",
            "Live rooms per transfer state and side.",
            w=8,
        ),
        timeseries(
            "Transfer blocks free / used / lent",
            [
                target("sum by (side) (epd_transfer_blocks_free)", "free {{side}}"),
                target("sum by (side) (epd_transfer_blocks_used)", "used {{side}}"),
                target("sum by (side) (epd_transfer_blocks_lent)", "lent {{side}}"),
            ],
            "short",
            "128-token buffer blocks, summed over the pool, by side. Lent blocks hold rows "
            "delivered without a copy, until the language engine finishes the request.",
            w=24,
        ),
        row("Language"),
        timeseries(
            "Language requests",
            [
                target("sum(epd_language_num_running_reqs)", "running"),
                target("sum(epd_language_num_waiting_reqs)", "waiting"),
                target("sum(epd_language_num_receiving_reqs)", "receiving embeddings"),
            ],
            "short",
            "Requests decoding, queued (the language HPA's metric) and waiting for embeddings.",
        ),
        timeseries(
            "KV cache slots",
            [
                target("sum(epd_language_kv_slots_used)", "used"),
                target("sum(epd_language_kv_slots_total)", "total"),
            ],
            "short",
            "KV token slots in use and in total, summed over the pool.",
        ),
        timeseries(
            "KV cache utilization",
            [
                target(
                    "sum by (instance) (epd_language_kv_slots_used) / "
                    "sum by (instance) (epd_language_kv_slots_total)",
                    "{{instance}}",
                )
            ],
            "percentunit",
            "Share of each language worker's KV slots in use.",
            w=8,
        ),
        timeseries(
            "Radix cache",
            [
                target(f"sum({rate('epd_language_radix_hit_tokens_total')})", "hit tokens/s"),
                target(f"sum({rate('epd_language_evicted_tokens_total')})", "evicted tokens/s"),
            ],
            "short",
            "Prompt tokens served from the radix (prefix) cache, and tokens evicted from it.",
            w=8,
        ),
        timeseries(
            "Prefill and decode tokens/s",
            [
                target(f"sum({rate('epd_language_prefill_tokens_total')})", "prefill"),
                target(f"sum({rate('epd_language_decode_tokens_total')})", "decode"),
            ],
            "short",
            "Tokens computed by prefill and generated by decode, per second.",
            w=8,
        ),
    ]


def layout(items: list[dict]) -> list[dict]:
    """Assign ids, query refIds and grid positions: rows span the width, panels fill left to
    right."""
    x = y = line_height = 0
    for panel_id, panel in enumerate(items, start=1):
        panel["id"] = panel_id
        if panel["type"] == "row":
            y += line_height
            panel["gridPos"] = {"h": 1, "w": WIDTH, "x": 0, "y": y}
            x, y, line_height = 0, y + 1, 0
            continue
        for index, query in enumerate(panel["targets"]):
            query["refId"] = chr(ord("A") + index)
        pos = panel["gridPos"]
        if x + pos["w"] > WIDTH:
            x, y, line_height = 0, y + line_height, 0
        pos.update(x=x, y=y)
        x += pos["w"]
        line_height = max(line_height, pos["h"])
    return items


def build() -> dict[str, Any]:
    return {
        "annotations": {
            "list": [
                {
                    "builtIn": 1,
                    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                    "enable": True,
                    "hide": True,
                    "iconColor": "rgba(0, 211, 255, 1)",
                    "name": "Annotations & Alerts",
                    "type": "dashboard",
                }
            ]
        },
        "description": "Disaggregated encode/prefill serving: gateway, encoder pool, "
        "Mooncake transfer plane and language pool.",
        "editable": True,
        "graphTooltip": 1,
        "id": None,
        "links": [],
        "panels": layout(panels()),
        "refresh": "10s",
        "schemaVersion": 39,
        "tags": ["epd", "llm-serving", "multimodal"],
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Data source",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                    "refresh": 1,
                    "regex": "",
                    "options": [],
                }
            ]
        },
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "timezone": "",
        "title": "EPD: disaggregated encode / prefill",
        "uid": "epd-overview",
        "version": 1,
    }


def queries(rate_interval: str = "1m") -> list[tuple[str, str]]:
    """(panel title, plain PromQL) for every target, ``$__rate_interval`` replaced: what a test
    evaluates against a real Prometheus."""
    return [
        (panel["title"], t["expr"].replace("$__rate_interval", rate_interval))
        for panel in build()["panels"]
        for t in panel.get("targets", [])
    ]


def render() -> str:
    return json.dumps(build(), indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the JSON is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        stale = not OUT.exists() or OUT.read_text() != text
        if stale:
            print(f"{OUT} is stale: run python {Path(__file__).as_posix()}", file=sys.stderr)
        return int(stale)
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
