"""The Grafana dashboard: loads, is in sync with its generator, every panel queries the
``${datasource}`` Prometheus, and every query uses only the metric names the services export
(``METRICS`` below: renaming a metric in a service fails here until the dashboard follows)."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import pytest

GRAFANA = Path(__file__).resolve().parents[2] / "deploy" / "grafana"
DASHBOARD = GRAFANA / "epd-dashboard.json"

# The metrics contract: name -> Prometheus type.
METRICS = {
    # gateway
    "epd_gateway_requests_total": "counter",
    "epd_gateway_time_to_first_token_seconds": "histogram",
    "epd_gateway_inter_token_latency_seconds": "histogram",
    "epd_gateway_e2e_request_latency_seconds": "histogram",
    "epd_gateway_queue_time_seconds": "histogram",
    "epd_gateway_worker_in_flight": "gauge",
    "epd_gateway_routing_decisions_total": "counter",
    "epd_gateway_workers": "gauge",
    # encoder
    "epd_encoder_queue_depth": "gauge",
    "epd_encoder_images_in_flight": "gauge",
    "epd_encoder_batch_size": "histogram",
    "epd_encoder_preprocess_seconds": "histogram",
    "epd_encoder_vit_seconds": "histogram",
    "epd_encoder_cache_hits_total": "counter",
    "epd_encoder_cache_misses_total": "counter",
    "epd_encoder_cache_evictions_total": "counter",
    "epd_encoder_cache_bytes": "gauge",
    "epd_encoder_video_frames_total": "counter",
    "epd_encoder_video_decode_seconds": "histogram",
    # transfer (label side="sender"|"receiver")
    "epd_transfer_bytes_total": "counter",
    "epd_transfer_seconds": "histogram",
    "epd_transfer_continuations_per_room": "histogram",
    "epd_transfer_failed_rooms_total": "counter",
    "epd_transfer_rooms": "gauge",
    "epd_transfer_blocks_free": "gauge",
    "epd_transfer_blocks_used": "gauge",
    "epd_transfer_blocks_lent": "gauge",
    # language
    "epd_language_num_running_reqs": "gauge",
    "epd_language_num_waiting_reqs": "gauge",
    "epd_language_num_receiving_reqs": "gauge",
    "epd_language_kv_slots_used": "gauge",
    "epd_language_kv_slots_total": "gauge",
    "epd_language_radix_hit_tokens_total": "counter",
    "epd_language_evicted_tokens_total": "counter",
    "epd_language_prefill_tokens_total": "counter",
    "epd_language_decode_tokens_total": "counter",
}
HISTOGRAM_SERIES = ("_bucket", "_sum", "_count")
FUNCTIONS = {
    "sum", "avg", "max", "min", "count", "rate", "increase", "irate", "histogram_quantile",
    "clamp_min", "clamp_max", "vector", "scalar", "abs", "topk", "bottomk",
}  # fmt: skip
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or"}
KEYWORDS |= {"unless", "bool", "offset", "inf", "nan"}
GRAFANA_VARIABLES = {"$__rate_interval"}


def load() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def query_panels() -> list[dict[str, Any]]:
    return [p for p in load()["panels"] if p["type"] != "row"]


def all_exprs() -> list[str]:
    return [t["expr"] for p in query_panels() for t in p["targets"]]


def series_names(expr: str) -> list[str]:
    """Metric (series) names an expression reads: identifiers that are not functions, keywords,
    label names or durations."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    text = re.sub(r"\{[^{}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\[\]]*\]", "", text)  # range selectors
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", " ", text)
    names = []
    for match in re.finditer(r"(?<![\w.])([A-Za-z_:][A-Za-z0-9_:]*)\b(\s*\()?", text):
        word, call = match.group(1), match.group(2)
        if call:
            assert word in FUNCTIONS, f"unknown function {word} in {expr}"
        elif word.lower() not in KEYWORDS:
            names.append(word)
    return names


def base_metric(series: str) -> str:
    if series in METRICS:
        return series
    for suffix in HISTOGRAM_SERIES:
        base = series.removesuffix(suffix)
        if series.endswith(suffix) and METRICS.get(base) == "histogram":
            return base
    raise AssertionError(f"{series} is not an exported metric (or histogram series)")


def test_dashboard_is_generated() -> None:
    spec = importlib.util.spec_from_file_location("build_dashboard", GRAFANA / "build_dashboard.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert load() == json.loads(module.render()), "run python deploy/grafana/build_dashboard.py"
    plain = module.queries("1m")
    assert len(plain) == len(all_exprs()) and not any("$" in q for _, q in plain)


def test_dashboard_shape() -> None:
    dashboard = load()
    assert dashboard["schemaVersion"] >= 39
    assert dashboard["uid"] and dashboard["title"]
    (variable,) = [v for v in dashboard["templating"]["list"] if v["name"] == "datasource"]
    assert variable["type"] == "datasource" and variable["query"] == "prometheus"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in dashboard["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24 and pos["h"] > 0, panel["title"]


def test_every_panel_queries_the_datasource() -> None:
    panels = query_panels()
    assert len(panels) >= 25
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], f"{panel['title']} has no query"
        ref_ids = [t.get("refId", "") for t in panel["targets"]]
        assert len(set(ref_ids)) == len(ref_ids), f"{panel['title']}: duplicate refIds"
        for t in panel["targets"]:
            assert t["expr"].strip(), panel["title"]
            assert t["datasource"] == panel["datasource"], panel["title"]


@pytest.mark.parametrize("expr", all_exprs())
def test_expr_uses_known_metrics(expr: str) -> None:
    assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}")
    assert set(re.findall(r"\$\w+", expr)) <= GRAFANA_VARIABLES, expr
    names = series_names(expr)
    assert names, f"no metric in {expr}"
    for series in names:
        kind = METRICS[base_metric(series)]
        if f"rate({series}[" in expr or f"increase({series}[" in expr:
            assert kind != "gauge", f"rate() of gauge {series}"
        if kind == "histogram" and series.endswith("_bucket"):
            assert "histogram_quantile(" in expr and "by (le" in expr, expr


def test_every_metric_has_a_panel() -> None:
    used = {base_metric(s) for expr in all_exprs() for s in series_names(expr)}
    assert used == set(METRICS), f"metrics without a panel: {set(METRICS) - used}"


def test_absent_by_default_series_fall_back_to_zero() -> None:
    """A labelled counter nobody incremented yet has no series: its panel must not go empty."""
    (failed,) = [e for e in all_exprs() if "epd_transfer_failed_rooms_total" in e]
    assert failed.endswith("or on() vector(0)")
