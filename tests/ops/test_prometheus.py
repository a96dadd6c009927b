"""A real Prometheus scrapes a running stack; key series and every dashboard query have data."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import httpx
import pytest

from common.procs import free_port
from tests.e2e.conftest import noise_image, png_bytes
from tests.media import make_video

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = shutil.which("prometheus")
pytestmark = pytest.mark.skipif(PROMETHEUS is None, reason="prometheus not installed (make setup)")


def dashboard_queries() -> list[tuple[str, str]]:
    spec = importlib.util.spec_from_file_location(
        "build_dashboard", ROOT / "deploy" / "grafana" / "build_dashboard.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.queries("1m")


class Prometheus:
    def __init__(self, targets: dict[str, int], workdir: Path) -> None:
        scrape = [
            {"job_name": name, "scrape_interval": "1s",
             "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}
            for name, port in targets.items()
        ]  # fmt: skip
        config = workdir / "prometheus.yml"
        config.write_text(
            json.dumps({"global": {"scrape_interval": "1s"}, "scrape_configs": scrape})
        )
        self.port = free_port()
        self.log = open(workdir / "prometheus.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self.log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=1)
                return
            except OSError:
                time.sleep(0.2)
        raise TimeoutError("prometheus did not become ready")

    def query(self, expr: str) -> list[dict]:
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode(
            {"query": expr}
        )
        with urllib.request.urlopen(url, timeout=5) as reply:
            body = json.load(reply)
        assert body["status"] == "success", (expr, body)
        return body["data"]["result"]

    def value(self, expr: str) -> float:
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else float("nan")

    def wait_for(self, expr: str, predicate, timeout_s: float = 20.0) -> float:
        deadline = time.monotonic() + timeout_s
        value = self.value(expr)
        while not predicate(value) and time.monotonic() < deadline:
            time.sleep(0.5)
            value = self.value(expr)
        return value

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        self.log.close()


@pytest.fixture
def scraped_stack(tiny_model_dir, stack_factory, tmp_path):
    stack = stack_factory(
        tiny_model_dir("qwen2_5_vl"),
        metrics=True,
        http_port=0,
        env={"EPD_TRANSFER_DEFAULT_TOKENS": "128"},
    )
    prom = Prometheus(stack.metrics_ports, tmp_path)
    yield stack, prom
    prom.stop()


def test_series_and_dashboard_queries_after_traffic(scraped_stack) -> None:
    stack, prom = scraped_stack
    # let Prometheus take a baseline scrape before the traffic, so rates have two points
    prom.wait_for("count(up == 1)", lambda v: v == len(stack.metrics_ports))
    image = png_bytes(noise_image(3, 224))
    with stack.client() as client:
        for _ in range(2):
            client.generate("Describe the image.", [image], max_tokens=6, timeout=60)
        client.generate("What is this?", [png_bytes(noise_image(4, 112))], max_tokens=6, timeout=60)
        client.generate("Hello", max_tokens=6, timeout=60)
        clip = make_video(num_frames=8, fps=4)  # 2 s at the default 2 fps: 4 frames
        client.generate("What happens?", videos=[clip], max_tokens=6, timeout=60)
    hello = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 6}
    reply = httpx.post(stack.http_url + "/v1/chat/completions", json=hello, timeout=60)
    assert reply.status_code == 200, reply.text
    ok = prom.wait_for('sum(epd_gateway_requests_total{outcome="OK"})', lambda v: v == 6)
    assert ok == 6
    time.sleep(2.5)  # two more scrapes: every rate() window now holds the traffic

    assert prom.value('sum(epd_gateway_requests_total{api="grpc"})') == 5
    assert prom.value('sum(epd_gateway_requests_total{api="http"})') == 1
    assert prom.value("sum(epd_gateway_time_to_first_token_seconds_count)") == 6
    assert prom.value('sum(epd_gateway_workers{state="healthy"})') == 2
    assert prom.value("epd_encoder_cache_hits_total") == 1
    assert prom.value("epd_encoder_cache_misses_total") == 2 + 2  # the images, the video's groups
    assert prom.value("sum(epd_encoder_batch_size_count)") >= 2
    assert prom.value("epd_encoder_video_frames_total") == 4
    assert prom.value("epd_encoder_video_decode_seconds_count") == 1
    sent = prom.value('epd_transfer_bytes_total{side="sender"}')
    received = prom.value('epd_transfer_bytes_total{side="receiver"}')
    assert received > 0 and sent >= received  # the sender also counts the aux records
    assert prom.value("sum(epd_transfer_blocks_used)") == 0
    assert prom.value("epd_language_prefill_tokens_total") > 0
    assert prom.value("epd_language_decode_tokens_total") > 0
    assert prom.value("epd_language_radix_hit_tokens_total") > 0
    assert prom.value("epd_language_num_running_reqs") == 0

    empty = []
    for title, expr in dashboard_queries():
        if not prom.query(expr):
            empty.append(f"{title}: {expr}")
    assert empty == [], "dashboard queries with no data after traffic:\n" + "\n".join(empty)
