"""The peer benchmark's pieces that need no server: request bodies, the streaming client against
a stand-in server, the statistics, the tables, the installers' fix-ups and the launchers'
command lines. (The client against our real stack: ``tests/http/test_peers_client.py``; nothing
here needs vLLM or aiperf installed.)"""

from __future__ import annotations

import asyncio
import base64
import io
import json

import httpx
import numpy as np
import pytest
from PIL import Image

from bench.peers import aiperf, driver, memory, stats, table, videos, vllm_server, workloads
from bench.peers.client import RequestResult, RunResult, per_token_gaps, run_requests_async
from bench.peers.dtypes import resolve_dtype
from bench.peers.install_vllm import FIXUP_MARK, guard_fake_registrations

MODEL = "some-model"


def images_of(body: dict) -> list[str]:
    content = body["messages"][0]["content"]
    if isinstance(content, str):
        return []
    return [p["image_url"]["url"] for p in content if p["type"] == "image_url"]


def text_of(body: dict) -> str:
    content = body["messages"][0]["content"]
    return content if isinstance(content, str) else content[-1]["text"]


def decode(url: str) -> Image.Image:
    prefix = "data:image/png;base64,"
    assert url.startswith(prefix)
    return Image.open(io.BytesIO(base64.b64decode(url[len(prefix) :])))


def make(name: str, num: int = 2, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    raw = workloads.bodies(workloads.WORKLOADS[name], MODEL, num, rng)
    return [json.loads(b) for b in raw]


# ---- request bodies ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(workloads.WORKLOADS))
def test_body_is_a_streamed_greedy_chat_request(name: str) -> None:
    body = make(name, 1)[0]
    assert body["model"] == MODEL
    assert body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == workloads.MAX_TOKENS == 32
    assert body["temperature"] == 0
    assert body["ignore_eos"] is True
    assert len(body["messages"]) == 1 and body["messages"][0]["role"] == "user"
    assert len(images_of(body)) == workloads.WORKLOADS[name].num_images
    assert text_of(body).startswith("Request ")
    assert 30 <= len(text_of(body).split()) <= 45  # ~40 tokens


def test_text_body_is_a_plain_string() -> None:
    assert isinstance(make("text", 1)[0]["messages"][0]["content"], str)


def test_images_come_first_and_are_448_pngs() -> None:
    content = make("four_images", 1)[0]["messages"][0]["content"]
    assert [p["type"] for p in content] == ["image_url"] * 4 + ["text"]
    for url in images_of({"messages": [{"content": content}]}):
        image = decode(url)
        assert image.format == "PNG" and image.size == (448, 448)


def test_fresh_images_and_prompts_differ_across_requests() -> None:
    first, second = make("image", 2)
    assert images_of(first) != images_of(second)
    assert text_of(first) != text_of(second)
    four = images_of(make("four_images", 1)[0])
    assert len(set(four)) == 4  # no two images of one request alike either
    # and with the OS's randomness (what the benchmark uses), two calls differ too
    a = workloads.bodies(workloads.WORKLOADS["image"], MODEL, 1)[0]
    b = workloads.bodies(workloads.WORKLOADS["image"], MODEL, 1)[0]
    assert a != b


def test_json_schema_asks_for_the_schema_and_only_it_does() -> None:
    (body,) = make("json_schema", 1)
    fmt = body["response_format"]
    assert fmt["type"] == "json_schema" and fmt["json_schema"]["strict"] is True
    assert fmt["json_schema"]["schema"] == workloads.JSON_SCHEMA
    assert isinstance(body["messages"][0]["content"], str)
    assert all("response_format" not in make(n, 1)[0] for n in workloads.WORKLOADS
               if n != "json_schema")  # fmt: skip


def test_repeated_image_is_the_same_with_fresh_text() -> None:
    first, second = make("repeated_image", 2)
    (third,) = make("repeated_image", 1, seed=7)
    assert images_of(first) == images_of(second) == images_of(third)
    assert text_of(first) != text_of(second)
    assert images_of(first) != images_of(make("image", 1)[0])


def videos_of(body: dict) -> list[bytes]:
    prefix = "data:video/mp4;base64,"
    urls = [p["video_url"]["url"] for p in body["messages"][0]["content"]
            if p["type"] == "video_url"]  # fmt: skip
    assert all(u.startswith(prefix) for u in urls)
    return [base64.b64decode(u[len(prefix) :]) for u in urls]


def test_video_workloads_send_one_clip_at_2_fps_and_only_they_do() -> None:
    import av

    for name, seconds in (("video_10s", 10), ("video_60s", 60), ("repeated_video", 60)):
        body = make(name, 1)[0]
        (clip,) = videos_of(body)
        with av.open(io.BytesIO(clip)) as src:
            frames = [f.to_ndarray(format="rgb24") for f in src.decode(video=0)]
            assert float(src.streams.video[0].average_rate) == videos.CLIP_FPS == 2
        assert len(frames) == 2 * seconds and frames[0].shape == (336, 336, 3)
        assert body["messages"][0]["content"][-1]["type"] == "text"
        assert name not in workloads.DEFAULT_WORKLOADS
    for name in ("image", "four_images", "repeated_image"):
        assert not videos_of(make(name, 1)[0])
    first, second = make("video_10s", 2)
    assert videos_of(first) != videos_of(second)  # fresh clips
    again = make("repeated_video", 2) + make("repeated_video", 1, seed=3)
    assert len({videos_of(b)[0] for b in again}) == 1  # one clip, fresh text
    assert len({text_of(b) for b in again}) == 3


# ---- the client against a stand-in server -----------------------------------------------------


def sse(*objects: dict | str) -> bytes:
    out = b""
    for obj in objects:
        data = obj if isinstance(obj, str) else json.dumps(obj)
        out += f"data: {data}\n\n".encode()
    return out


def delta(content: str | None = None, role: str | None = None, finish: str | None = None) -> dict:
    d = {k: v for k, v in (("role", role), ("content", content)) if v is not None}
    return {"choices": [{"index": 0, "delta": d, "finish_reason": finish}]}


USAGE = {"choices": [], "usage": {"prompt_tokens": 50, "completion_tokens": 3}}
GOOD = sse(
    delta("", role="assistant"),
    delta("a"),
    delta("b"),
    delta("c"),
    delta(finish="length"),
    USAGE,
    "[DONE]",
)


def run_against(replies: list[tuple[int, bytes]], concurrency: int = 2) -> RunResult:
    """Run one request per reply against a stand-in server answering them in order."""
    answers = iter(replies)
    seen: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/chat/completions"
        seen.append(json.loads(request.content))
        status, payload = next(answers)
        return httpx.Response(status, content=payload)

    bodies = [json.dumps(make("text", 1)[0]).encode() for _ in replies]
    transport = httpx.MockTransport(handler)
    run = asyncio.run(run_requests_async("http://peer", bodies, concurrency, transport=transport))
    assert len(seen) == len(replies)
    return run


def test_client_times_a_good_stream() -> None:
    run = run_against([(200, GOOD)])
    (result,) = run.results
    assert result.ok, result.error
    assert result.output_tokens == 3 and result.prompt_tokens == 50
    assert 0 < result.ttft_s <= result.e2e_s
    assert len(result.itl_s) == 2  # three text chunks: two gaps
    assert run.wall_s > 0


def test_client_counts_chunks_without_usage() -> None:
    stream = sse(delta("", role="assistant"), delta("a"), delta("b"), "[DONE]")
    (result,) = run_against([(200, stream)]).results
    assert result.ok and result.output_tokens == 2


@pytest.mark.parametrize(
    ("status", "payload", "why"),
    [
        (429, b'{"error": {"message": "queue full"}}', "HTTP 429"),
        (200, sse(delta("a"), {"error": {"message": "worker died"}}), "error event"),
        (200, sse(delta("a"), USAGE), "no [DONE]"),
        (200, sse(delta("", role="assistant"), "[DONE]"), "no tokens"),
        (200, b"data: {not json\n\n", "JSONDecodeError"),
    ],
)
def test_failures_are_kept_with_their_reason(status: int, payload: bytes, why: str) -> None:
    run = run_against([(200, GOOD), (status, payload)])
    good, bad = run.results
    assert good.ok
    assert not bad.ok and why in bad.error
    summary = stats.summarize([run])
    assert summary.requests == 2 and summary.failures == 1
    assert why in summary.errors[0]


def test_concurrency_is_respected() -> None:
    in_flight, peak = 0, 0

    async def handler(request: httpx.Request) -> httpx.Response:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.01)
        in_flight -= 1
        return httpx.Response(200, content=GOOD)

    bodies = [b"{}"] * 12
    transport = httpx.MockTransport(handler)
    run = asyncio.run(run_requests_async("http://peer", bodies, 3, transport=transport))
    assert peak == 3
    assert len(run.results) == 12 and all(r.ok for r in run.results)


# ---- statistics -------------------------------------------------------------------------------


def test_per_token_gaps() -> None:
    assert per_token_gaps([0.0, 1.0, 3.0], 3) == [1.0, 2.0]  # a chunk per token
    # 3 chunks for 5 tokens: each gap stands for 2 tokens on average
    assert per_token_gaps([0.0, 2.0, 6.0], 5) == [1.0, 2.0]
    assert per_token_gaps([0.0], 32) == []
    # a request's mean gap (TPOT) is (last - first) / (tokens - 1) however tokens are grouped
    merged = RequestResult(True, 0.0, 7.0, itl_s=per_token_gaps([0.0, 2.0, 6.0], 5))
    assert merged.tpot_s == pytest.approx(6.0 / 4)


def ok(ttft: float, itls: list[float], tokens: int = 32, e2e: float = 1.0) -> RequestResult:
    return RequestResult(True, 10.0, 10.0 + e2e, ttft_s=ttft, itl_s=itls, output_tokens=tokens)


def test_summarize_pools_runs() -> None:
    runs = [
        RunResult([ok(0.1, [0.01, 0.02]), ok(0.3, [0.03])], wall_s=1.0, concurrency=2),
        RunResult(
            [ok(0.2, [0.04], e2e=3.0), RequestResult(False, 0, 1, error="HTTP 503: x")],
            wall_s=3.0,
            concurrency=2,
        ),
    ]
    s = stats.summarize(runs)
    assert (s.requests, s.failures, s.wall_s) == (4, 1, 4.0)
    assert s.requests_per_s == pytest.approx(3 / 4)
    assert s.output_tokens_per_s == pytest.approx(96 / 4)
    assert s.ttft_p50_ms == pytest.approx(200.0)
    assert s.ttft_p99_ms == pytest.approx(298.0)  # linear interpolation
    assert s.itl_p50_ms == pytest.approx(25.0)
    assert s.tpot_p50_ms == pytest.approx(30.0)  # per request: 15, 30, 40 ms
    assert s.e2e_p50_ms == pytest.approx(1000.0)
    assert s.errors == ["HTTP 503: x"]


def test_summarize_of_only_failures_is_zero_not_an_error() -> None:
    s = stats.summarize([RunResult([RequestResult(False, 0, 1, error="x")], 1.0, 1)])
    assert (s.failures, s.requests_per_s, s.ttft_p50_ms) == (1, 0.0, 0.0)
    assert stats.ratio(1.0, 0.0) == 0.0


# ---- the driver's plan and the tables ---------------------------------------------------------


def test_runs_alternate_abba() -> None:
    assert driver.run_order(0) == ("ours", "vllm", "vllm", "ours")
    assert driver.run_order(1) == ("vllm", "ours", "ours", "vllm")
    assert driver.run_order(0, 3) == ("ours", "vllm", "vllm", "ours", "ours", "vllm")
    assert driver.run_order(1, 1) == ("vllm", "ours")
    assert driver.sequential_order(4) == ("vllm", "ours", "ours", "vllm") * 2
    assert driver.split(33, 2) == [17, 16]


def test_requests_per_cell() -> None:
    args = driver.argparse.Namespace(requests=0, quick=False, repeats=2)
    assert driver.requests_per_cell(args, 1) == 32
    assert driver.requests_per_cell(args, 64) == 128
    args.repeats = 4
    assert driver.requests_per_cell(args, 16) == 64
    args.requests = 10
    assert driver.requests_per_cell(args, 64) == 10
    args.requests = 3
    assert driver.requests_per_cell(args, 64) == 4  # at least one per run


def test_repeats_must_be_positive() -> None:
    parser = driver.argparse.ArgumentParser()
    driver.add_arguments(parser)
    assert parser.parse_args([]).repeats == driver.REPEATS
    assert parser.parse_args(["--repeats", "4"]).repeats == 4
    with pytest.raises(SystemExit):
        parser.parse_args(["--repeats", "0"])


def test_session_result_is_json_with_both_systems_per_cell(tmp_path) -> None:
    args = driver.argparse.Namespace(
        requests=4,
        quick=True,
        workloads=("text", "image"),
        concurrency=(2,),
        dtype="auto",
        repeats=2,
    )
    session = driver.Session(args, tmp_path, "float32", tmp_path, tmp_path / "python")
    for workload, conc in session.cells:
        for system in driver.SYSTEMS:
            for wall_s in (0.5, 1.0 if system == "ours" else 0.5):  # ours' second run slower
                run = RunResult([ok(0.1, [0.01]), ok(0.2, [0.02])], wall_s=wall_s, concurrency=conc)
                session.runs.setdefault((workload, conc, system), []).append(run)
    result = json.loads(json.dumps(session.result(True, "0.32.0", "")))
    assert [(c["workload"], c["concurrency"]) for c in result["cells"]] == [
        ("text", 2),
        ("image", 2),
    ]
    cell = result["cells"][0]
    assert cell["ours"]["requests"] == cell["vllm"]["requests"] == 4
    assert cell["ratios"]["requests_per_s"] == pytest.approx(4 / 1.5 / (4 / 1.0))
    assert cell["paired_requests_ratios"] == pytest.approx([1.0, 0.5])  # run by run
    assert result["settings"]["repeats"] == 2
    assert "aiperf" not in result
    text = table.format_result(result)
    assert "text" in text and "0.50-1.00x" in text


def summary(rps: float, failures: int = 0) -> dict:
    return stats.Summary(
        requests=8,
        failures=failures,
        wall_s=1.0,
        requests_per_s=rps,
        output_tokens_per_s=rps * 32,
        ttft_p50_ms=100.0,
        ttft_p99_ms=200.0,
        itl_p50_ms=10.0,
        itl_p99_ms=20.0,
        tpot_p50_ms=11.0,
        tpot_p99_ms=12.0,
        e2e_p50_ms=500.0,
        output_tokens=int(rps * 32),
        errors=["HTTP 500: boom"] if failures else [],
    ).as_dict()


def test_table_shows_both_systems_and_ratios() -> None:
    result = {
        "settings": {
            "checkpoint": "ckpt",
            "dtype": "float32",
            "max_tokens": 32,
            "requests_per_cell": {"16": 32},
            "repeats": 2,
            "together": True,
            "vllm_version": "0.32.0",
        },
        "cells": [
            {
                "workload": "text",
                "concurrency": 16,
                "ours": summary(8.0),
                "vllm": summary(4.0, failures=1),
                "paired_requests_ratios": [1.8, 2.2],
            }
        ],
        "aiperf": {
            "aiperf": {"ours": aiperf.parse_export(EXPORT).as_dict(), "vllm": None},
            "client": {"ours": summary(3.0), "vllm": summary(1.5)},
            "settings": {
                "version": "0.13.0",
                "concurrency": 8,
                "requests": 48,
                "image_side": 448,
                "prompt_tokens": 40,
            },
        },
    }
    text = table.format_result(result)
    assert "8.00 / 4.00 = 2.00x" in text and "1.80-2.20x" in text
    assert "0/8 / 1/8" in text and "HTTP 500: boom" in text
    assert "aiperf -> ours" in text and "our client: ours/vLLM" in text
    assert "2.00x" in text.splitlines()[-1]


# ---- aiperf, vLLM launcher, installers, memory, dtype -----------------------------------------

EXPORT = {
    "request_count": {"avg": 48.0},
    "request_error_rate": {"avg": 0.0},
    "request_throughput": {"avg": 3.5},
    "output_token_throughput": {"avg": 112.0},
    "time_to_first_token": {"p50": 700.0, "p99": 1400.0},
    "inter_token_latency": {"p50": 20.0, "p99": 60.0},
    "inter_chunk_latency": {"p50": 18.0, "p99": 90.0},
    "error_summary": [],
}


def test_aiperf_export_and_command(tmp_path) -> None:
    r = aiperf.parse_export(EXPORT)
    assert (r.requests, r.requests_per_s, r.ttft_p50_ms) == (48, 3.5, 700.0)
    assert (r.tpot_p99_ms, r.itl_p99_ms) == (60.0, 90.0)
    cmd = aiperf.command(tmp_path / "aiperf", "http://h:1", "m", tmp_path / "ckpt", tmp_path)
    joined = " ".join(cmd)
    for flag in (
        "--streaming",
        "--endpoint-type chat",
        "--extra-inputs ignore_eos:true",
        "--image-width-mean 448",
        "--output-tokens-mean 32",
        "--concurrency 8",
        f"--tokenizer {tmp_path / 'ckpt'}",
        "--use-server-token-count",
    ):
        assert flag in joined
    text = " ".join(aiperf.command(tmp_path / "aiperf", "http://h:1", "m", tmp_path, tmp_path,
                                   endpoint="completions", warmup=1))  # fmt: skip
    assert "--endpoint-type completions" in text and "--warmup-request-count 1" in text
    assert "--image" not in text and "--output-tokens-mean 32" in text
    with pytest.raises(ValueError, match="chat or completions"):
        aiperf.command(tmp_path, "http://h:1", "m", tmp_path, tmp_path, endpoint="embeddings")


def test_vllm_command_line_and_environment(tmp_path) -> None:
    args = vllm_server.server_args(tmp_path / "ckpt", "bfloat16", 1234)
    joined = " ".join(args)
    assert "--dtype bfloat16" in joined and "--max-model-len 16384" in joined
    assert "--skip-mm-profiling" in args and "--host 127.0.0.1 --port 1234" in joined
    limits = json.loads(args[args.index("--limit-mm-per-prompt") + 1])
    assert limits == {"image": 4, "video": 1}
    env = vllm_server.server_env(tmp_path)
    for key in ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "VLLM_RPC_BASE_PATH", "TMPDIR"):
        assert env[key].startswith(str(tmp_path))
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2" and env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"


TORCHVISION_META = """import torch
import torchvision

@torch.library.register_fake("torchvision::nms")
def meta_nms(dets, scores, iou_threshold):
    return dets

@torch.library.register_fake("torchvision::roi_align")
def meta_roi_align(x):
    return x

@torch.library.register_fake("torchvision::qnms")
def meta_qnms(dets, scores, iou_threshold):
    return dets
"""


def test_torchvision_fixup_guards_only_nms_and_is_idempotent() -> None:
    patched = guard_fake_registrations(TORCHVISION_META)
    assert patched.count(FIXUP_MARK) == 4  # an import and a decorator for each of two ops
    assert '@torch.library.register_fake("torchvision::roi_align")' in patched
    assert guard_fake_registrations(patched) == patched
    compile(patched, "_meta_registrations.py", "exec")


def test_checkpoint_params(tmp_path) -> None:
    import torch
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(3, 4), "b": torch.zeros(5)}, tmp_path / "model.safetensors")
    assert memory.checkpoint_params(tmp_path) == 17


def test_explicit_dtype_passes_through() -> None:
    assert resolve_dtype("bfloat16")[0] == "bfloat16"
    assert resolve_dtype("auto")[0] in ("float32", "bfloat16")
    with pytest.raises(ValueError):
        resolve_dtype("float16")
