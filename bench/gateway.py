"""The gateway's own latency: one short text request direct, through a bare relay, through it.

Starts a language worker (the test-size checkpoint by default: the smaller the model's share of
each request, the less its noise hides the hop) and a gateway, as processes on 127.0.0.1, plus
a bare relay process: a gRPC server whose only work is to forward the call to the same worker,
bytes in, bytes out (no parsing; ``grpc`` generic handlers with no (de)serializers), on the
same kind of server as the gateway (the sync thread-pool server). The relay is the floor of one
Python gRPC hop on this machine: what any Python gateway costs before it does any work of its
own. A second relay ("relay-st") reads the worker's stream with grpcio's experimental
``SingleThreadedUnaryStream`` channel option (the handler thread polls the call itself: no
channel spin thread, no hand-over per message); ``--aio`` adds an asyncio relay. The CPU each
hop's process spends per request (all its threads, its idle rate subtracted) is reported too:
on a small shared machine it is steadier than latency.

The request: "Say hello.", 4 new tokens, EOS ignored (5 chunks from the worker). Each path is
timed streamed (until the last chunk) and unary (one reply: the gateway's ``GenerateUnary``;
straight to the worker, which has no unary call, the stream is collected by the client; the
relay collects the stream's bytes itself and answers once). The paths alternate request by
request, in a rotating order, over ``--rounds`` rounds, so drift and other load on the machine
favour none of them. Reported: p50/p99 of each, and the p50 each hop adds over going direct:
the relay's (the floor) and the gateway's (goal: <= 1 ms).

``python -m bench.gateway [--json] [--rounds N] [--aio]``; ``python -m bench.gateway relay
--port P --target HOST:PORT [--aio]`` runs a relay alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from concurrent import futures
from pathlib import Path

import grpc
import grpc.experimental
from grpc_health.v1 import health, health_pb2_grpc

from common.channels import create_channel
from common.models.tiny import ensure_tiny_model
from common.procs import (
    PARENT_PID_ENV,
    check_health,
    die_with_parent_from_env,
    free_port,
    runtime_env,
)
from protos.epd.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, language_pb2, language_pb2_grpc
from services.local_stack import start_local_stack

PROMPT = "Say hello."
MAX_TOKENS = 4
ROUNDS = 300
WARMUP_ROUNDS = 20
STARTUP_S = 180.0
IDLE_S = 5.0
GENERATE = "/epd.v1.LanguageService/Generate"
RELAY_UNARY = "/epd.bench.Relay/GenerateUnary"  # the relay's own: the stream, collected
RELAY_THREADS = 16


# ---- the relay (its own process) --------------------------------------------------------------


def _sync_relay(port: int, target: str, single_threaded: bool) -> Callable[[], None]:
    options = [(grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1)]
    channel = grpc.insecure_channel(target, options if single_threaded else None)
    upstream = channel.unary_stream(GENERATE)  # no deserializer: the chunks stay bytes

    def generate(request: bytes, context):
        call = upstream(request, timeout=context.time_remaining())
        context.add_callback(call.cancel)
        yield from call

    def generate_unary(request: bytes, context) -> bytes:
        return b"".join(upstream(request, timeout=context.time_remaining()))

    handler = grpc.method_handlers_generic_handler(
        "epd.v1.LanguageService",
        {"Generate": grpc.unary_stream_rpc_method_handler(generate)},
    )
    unary = grpc.method_handlers_generic_handler(
        "epd.bench.Relay", {"GenerateUnary": grpc.unary_unary_rpc_method_handler(generate_unary)}
    )
    server = grpc.server(
        futures.ThreadPoolExecutor(RELAY_THREADS),
        [handler, unary],
        options=[("grpc.so_reuseport", 0)],
    )
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()

    def wait() -> None:
        with channel:  # held open (a collected channel closes itself) until the server ends
            server.wait_for_termination()

    return wait


async def _aio_relay(port: int, target: str) -> None:
    channel = grpc.aio.insecure_channel(target)
    upstream = channel.unary_stream(GENERATE)

    async def generate(request: bytes, context):
        async for chunk in upstream(request, timeout=context.time_remaining()):
            yield chunk

    async def generate_unary(request: bytes, context) -> bytes:
        return b"".join([c async for c in upstream(request, timeout=context.time_remaining())])

    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "epd.v1.LanguageService",
                {"Generate": grpc.unary_stream_rpc_method_handler(generate)},
            ),
            grpc.method_handlers_generic_handler(
                "epd.bench.Relay",
                {"GenerateUnary": grpc.unary_unary_rpc_method_handler(generate_unary)},
            ),
        )
    )
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def serve_relay(args: argparse.Namespace) -> int:
    die_with_parent_from_env()
    if args.aio:
        asyncio.run(_aio_relay(args.port, args.target))
    else:
        _sync_relay(args.port, args.target, args.single_threaded)()
    return 0


class RelayProcess:
    """A relay child process (dies with this one)."""

    def __init__(
        self, target: str, aio: bool, log_dir: Path, single_threaded: bool = False
    ) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "bench.gateway", "relay", "--port", str(self.port)]
        cmd += ["--target", target, *(["--aio"] if aio else [])]
        cmd += ["--single-threaded"] if single_threaded else []
        self._log = open(log_dir / f"relay-{self.port}.log", "wb")  # noqa: SIM115
        env = runtime_env({PARENT_PID_ENV: str(os.getpid())})
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 30
        while not check_health(self.address, timeout_s=0.5):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"relay did not start: see {self._log.name}")
            time.sleep(0.1)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        self._log.close()


# ---- the paths ----------------------------------------------------------------------------------


def _language_request() -> language_pb2.LanguageGenerateRequest:
    message = common_pb2.ChatMessage(role="user", content=[common_pb2.ContentPart(text=PROMPT)])
    sampling = common_pb2.SamplingParams(max_new_tokens=MAX_TOKENS, ignore_eos=True)
    return language_pb2.LanguageGenerateRequest(
        request_id=uuid.uuid4().hex, messages=[message], sampling=sampling
    )


def _gateway_request() -> gateway_pb2.GenerateRequest:
    message = common_pb2.ChatMessage(role="user", content=[common_pb2.ContentPart(text=PROMPT)])
    sampling = common_pb2.SamplingParams(max_new_tokens=MAX_TOKENS, ignore_eos=True)
    return gateway_pb2.GenerateRequest(messages=[message], sampling=sampling)


class Paths:
    """One call per (path, kind); each returns the number of tokens answered."""

    def __init__(self, worker: str, relays: dict[str, str], gateway: str) -> None:
        self._channels = [create_channel(a) for a in (worker, *relays.values(), gateway)]
        self.calls: dict[str, Callable[[], int]] = {}
        worker_ch, *relay_chs, gateway_ch = self._channels
        self._add_language("direct", worker_ch, None)
        for name, ch in zip(relays, relay_chs, strict=True):
            unary = ch.unary_unary(
                RELAY_UNARY,
                request_serializer=language_pb2.LanguageGenerateRequest.SerializeToString,
                response_deserializer=language_pb2.LanguageGenerateChunk.FromString,
            )
            self._add_language(name, ch, unary)
        stub = gateway_pb2_grpc.GatewayStub(gateway_ch)
        request = _gateway_request()
        self.calls["gateway stream"] = lambda: sum(
            len(c.token_ids) for c in stub.Generate(request, timeout=30)
        )
        self.calls["gateway unary"] = lambda: len(stub.GenerateUnary(request, timeout=30).token_ids)

    def _add_language(self, name: str, channel: grpc.Channel, unary) -> None:
        stub = language_pb2_grpc.LanguageServiceStub(channel)
        self.calls[f"{name} stream"] = lambda: sum(
            len(c.token_ids) for c in stub.Generate(_language_request(), timeout=30)
        )
        if unary is None:  # the worker has no unary call: the client collects the stream
            self.calls[f"{name} unary"] = lambda: len(
                [t for c in stub.Generate(_language_request(), timeout=30) for t in c.token_ids]
            )
        else:
            self.calls[f"{name} unary"] = lambda: len(
                unary(_language_request(), timeout=30).token_ids
            )

    def close(self) -> None:
        for channel in self._channels:
            channel.close()


def measure(paths: Paths, rounds: int) -> dict[str, list[float]]:
    """Seconds per call of every path, alternating call by call in a rotating order."""
    names = list(paths.calls)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for i in range(WARMUP_ROUNDS + rounds):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            num_tokens = paths.calls[name]()
            took = time.perf_counter() - start
            assert num_tokens == MAX_TOKENS, (name, num_tokens)
            if i >= WARMUP_ROUNDS:
                samples[name].append(took)
    return samples


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) process ``pid`` has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def summarize(samples: dict[str, list[float]]) -> dict:
    rows = {
        name: {"p50_ms": statistics.median(v) * 1e3, "p99_ms": percentile(v, 99) * 1e3}
        for name, v in samples.items()
    }
    added = {}
    for name, row in rows.items():
        path, kind = name.split(" ")
        if path != "direct":
            added[name] = row["p50_ms"] - rows[f"direct {kind}"]["p50_ms"]
    return {"rows": rows, "added_p50_ms": added}


# ---- the command --------------------------------------------------------------------------------


def bench(args: argparse.Namespace) -> dict:
    model_dir = args.model_path or ensure_tiny_model("qwen2_5_vl", "test")
    with tempfile.TemporaryDirectory(prefix="epd-bench-gateway-") as tmp:
        log_dir = Path(tmp)
        stack = start_local_stack(
            Path(model_dir), log_dir, num_encoders=0, startup_timeout_s=STARTUP_S
        )
        relays: list[RelayProcess] = []
        with stack.serving():
            try:
                worker = stack.languages[0].address
                relays.append(RelayProcess(worker, False, log_dir))
                names = ["relay"]
                if args.aio:
                    relays.append(RelayProcess(worker, True, log_dir))
                    names.append("relay-aio")
                relays.append(RelayProcess(worker, False, log_dir, single_threaded=True))
                names.append("relay-st")
                paths = Paths(worker, dict(zip(names, (r.address for r in relays), strict=True)),
                              stack.gateway.address)  # fmt: skip
                hops = {name: r.proc.pid for name, r in zip(names, relays, strict=True)}
                hops["gateway"] = stack.gateway.proc.pid
                idle = {name: cpu_s(pid) for name, pid in hops.items()}
                time.sleep(IDLE_S)  # the background work (heartbeats, health polls), to subtract
                cpu_before = {name: cpu_s(pid) for name, pid in hops.items()}
                idle = {name: (cpu_before[name] - idle[name]) / IDLE_S for name in hops}
                start = time.monotonic()
                try:
                    samples = measure(paths, args.rounds)
                finally:
                    paths.close()
                took = time.monotonic() - start
                num_calls = 2 * (WARMUP_ROUNDS + args.rounds)  # through each hop: stream + unary
                cpu_ms = {
                    name: (cpu_s(pid) - cpu_before[name] - idle[name] * took) / num_calls * 1e3
                    for name, pid in hops.items()
                }
            finally:
                for relay in relays:
                    relay.stop()
    return {"model": str(model_dir), "max_new_tokens": MAX_TOKENS, "rounds": args.rounds,
            "cpu_ms_per_request": cpu_ms, **summarize(samples)}  # fmt: skip


def format_table(result: dict) -> str:
    lines = [
        f"one text request, {result['max_new_tokens']} new tokens, {result['rounds']} "
        f"alternating rounds ({result['model']})",
        f"{'path':<20}{'p50':>10}{'p99':>10}{'added p50':>12}",
    ]
    for name, row in result["rows"].items():
        added = result["added_p50_ms"].get(name)
        more = f"{added:+9.2f} ms" if added is not None else ""
        lines.append(f"{name:<20}{row['p50_ms']:>7.2f} ms{row['p99_ms']:>7.2f} ms{more:>12}")
    cpu = ", ".join(f"{name} {ms:.2f} ms" for name, ms in result["cpu_ms_per_request"].items())
    lines.append(f"CPU per request (the hop's process, all threads, idle rate subtracted): {cpu}")
    added = result["added_p50_ms"]
    for kind in ("stream", "unary"):
        floor = added[f"relay {kind}"]
        lines.append(
            f"{kind}: the gateway adds {added[f'gateway {kind}']:+.2f} ms p50 (goal <= 1 ms); "
            f"a bare relay adds {floor:+.2f} ms (the floor of one Python gRPC hop); "
            f"the gateway's own work: {added[f'gateway {kind}'] - floor:+.2f} ms"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.gateway", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--aio", action="store_true", help="also an asyncio relay")
    parser.add_argument("--model-path", type=Path, help="checkpoint (default: generated, test)")
    sub = parser.add_subparsers(dest="command")
    relay = sub.add_parser("relay", help="run a relay alone")
    relay.add_argument("--port", type=int, required=True)
    relay.add_argument("--target", required=True)
    relay.add_argument("--aio", action="store_true")
    relay.add_argument("--single-threaded", action="store_true")
    args = parser.parse_args(argv)
    if args.command == "relay":
        return serve_relay(args)
    result = bench(args)
    print(json.dumps(result) if args.json else format_table(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
