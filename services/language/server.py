"""``epd serve language``: the language worker's gRPC server.

``serve(config)`` starts everything in-process and returns a handle; ``run(args)`` is the CLI
entry point (blocks until SIGINT/SIGTERM). On SIGTERM the worker drains
(``common.worker.drain_worker``): it leaves every gateway, refuses new ``Generate`` calls with
``UNAVAILABLE`` and serves the ones in flight (and the rooms they receive) to their end, up to
``--drain-timeout-s``; then it stops.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from dataclasses import dataclass

from grpc_health.v1 import health

from common.allocator import allocator_line, release_free_memory
from common.cli_config import add_cli_args, from_cli_args
from common.compute import set_compute_threads
from common.grpc_server import (
    Running,
    Server,
    create_server,
    serve_until_terminated,
    start_server,
)
from common.internal import server_security
from common.stream_capacity import StreamCapacity
from common.transfer.layout import dtype_name, parse_dtype
from common.worker import WorkerRuntime, add_worker_arguments, drain_worker, worker_configs
from protos.epd.v1 import language_pb2_grpc
from services.language.config import ENV_PREFIX, LanguageConfig
from services.language.engine.engine import LanguageEngine
from services.language.engine_thread import EngineThread
from services.language.kvcache.sizing import MIB
from services.language.metrics import create_registry
from services.language.servicer import LanguageServicer, load_reply

logger = logging.getLogger(__name__)
SERVICE_NAME = "epd.v1.LanguageService"


@dataclass
class LanguageServer:
    """A running server: ``port`` is the bound port; ``stop()`` shuts everything down."""

    server: Server
    engine_thread: EngineThread
    health: health.HealthServicer
    port: int
    embedding_source: object | None = None

    def stop(self, grace_s: float = 2.0) -> None:
        self.health.enter_graceful_shutdown()
        self.server.stop(grace_s).wait()
        self.engine_thread.stop()
        if self.embedding_source is not None:
            self.embedding_source.close()


def serve(config: LanguageConfig, embedding_source=None) -> LanguageServer:
    """Load the model, start the engine thread and the gRPC server on ``config.host:port``.

    ``embedding_source`` (see ``receiving.py``) is where rooms' embeddings come from; without
    one, requests with a room fail and text-only requests work.
    """
    num_threads = set_compute_threads(config.worker.compute_threads)
    engine = LanguageEngine(config, embedding_source)
    release_free_memory()  # what loading and prepacking freed (common/allocator.py)
    engine_thread = EngineThread(engine, config.max_waiting_requests)
    engine_thread.start()
    generate, submit = f"/{SERVICE_NAME}/Generate", f"/{SERVICE_NAME}/Submit"
    long_methods = (generate, f"/{SERVICE_NAME}/Open")  # a session's stream holds a thread too
    capacity = StreamCapacity(config.grpc_workers, long_methods, who="language worker")
    server = create_server(
        "epd-language",
        config.grpc_max_message_mb,
        capacity,
        server_security(config.worker.internal),
        work_methods=(generate, submit),
        keepalive=config.worker.keepalive,
    )
    servicer = LanguageServicer(
        engine_thread, embedding_source, config.grpc_workers, capacity.refusal
    )
    language_pb2_grpc.add_LanguageServiceServicer_to_server(servicer, server)
    port, health_servicer = start_server(
        server, config.host, config.port, (SERVICE_NAME,), config.worker.health_port
    )
    logger.info(
        "language worker on %s:%d: %s, %d compute threads",
        config.host, port, describe(engine), num_threads,
    )  # fmt: skip
    return LanguageServer(server, engine_thread, health_servicer, port, embedding_source)


def describe(engine: LanguageEngine) -> str:
    """The start-up line: where it computes, in which dtypes, and how much it holds."""
    plan, config = engine.kv_plan, engine.config
    return (
        f"device {engine.device}, compute dtype {dtype_name(engine.dtype)}, "
        f"wire dtype {dtype_name(parse_dtype(config.transfer.dtype))}, "
        f"KV pool {plan.num_slots} tokens, {plan.pool_bytes / MIB:.0f} MiB, set by {plan.reason}, "
        f"max_seq_len {engine.max_seq_len}, linear kernel {engine.linear_kernel}, "
        f"CPU kernels {engine.cpu_kernels}"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_cli_args(parser, LanguageConfig, ENV_PREFIX)
    add_worker_arguments(parser, ENV_PREFIX)


def config_from_args(args: argparse.Namespace) -> LanguageConfig:
    return from_cli_args(LanguageConfig, args, ENV_PREFIX, **worker_configs(args, ENV_PREFIX))


def serve_with_receiver(config: LanguageConfig) -> LanguageServer:
    """``serve`` with the transfer plane's receiver as the embedding source."""
    from services.language.model.config import TextModelConfig
    from services.language.receiving import create_receiver_source

    model_config = TextModelConfig.from_pretrained(config.model_path)
    # the receiver refuses, at the sender's announcement, a room longer than any request here
    longest = config.max_seq_len or model_config.max_position_embeddings
    transfer = config.transfer
    if longest:
        transfer = dataclasses.replace(
            transfer, max_room_tokens=min(transfer.max_room_tokens, longest)
        )
    source = create_receiver_source(model_config, transfer, config.prefill_while_receiving)
    return serve(config, source)


def start_runtime(config: LanguageConfig, handle: LanguageServer) -> WorkerRuntime:
    """Registration with the gateway and the metrics endpoint of a serving worker."""
    return WorkerRuntime(
        config.worker,
        "language",
        config.host,
        handle.port,
        lambda: load_reply(handle.engine_thread, handle.embedding_source),
        registry=create_registry(handle),
    )


def start(args: argparse.Namespace) -> Running:
    """Serve, register with the gateway, expose metrics (``epd serve language`` and Ray)."""
    config = config_from_args(args)
    logger.info(allocator_line())
    if not config.model_path:
        raise SystemExit("--model-path is required")
    handle = serve_with_receiver(config)
    runtime = start_runtime(config, handle)

    def stop() -> None:
        runtime.stop()
        handle.stop()

    return Running(
        handle.port,
        f"language worker listening on {config.host}:{handle.port}",
        stop,
        drain=lambda deadline: drain_worker(
            handle.server, runtime, deadline, handle.engine_thread.wait_idle
        ),
        drain_timeout_s=config.worker.drain_timeout_s,
    )


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    return serve_until_terminated(lambda: start(args))


def main() -> int:
    parser = argparse.ArgumentParser(prog="epd-language")
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
