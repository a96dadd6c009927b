"""``epd serve language``: the language worker's gRPC server.

``serve(config)`` starts everything in-process and returns a handle; ``run(args)`` is the CLI
entry point (blocks until SIGINT/SIGTERM).
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common.cli_config import add_cli_args, from_cli_args
from common.transfer.config import ENV_PREFIX as TRANSFER_ENV_PREFIX
from common.transfer.config import TransferConfig
from common.worker import WorkerConfig, WorkerRuntime
from protos.epd.v1 import language_pb2, language_pb2_grpc
from services.language.config import ENV_PREFIX, LanguageConfig
from services.language.engine.engine import LanguageEngine
from services.language.engine_thread import EngineThread
from services.language.metrics import create_registry
from services.language.servicer import LanguageServicer

logger = logging.getLogger(__name__)
SERVICE_NAME = "epd.v1.LanguageService"


@dataclass
class LanguageServer:
    """A running server: ``port`` is the bound port; ``stop()`` shuts everything down."""

    server: grpc.Server
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
    engine = LanguageEngine(config, embedding_source)
    engine_thread = EngineThread(engine, config.max_waiting_requests)
    engine_thread.start()
    max_bytes = config.grpc_max_message_mb << 20
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=config.grpc_workers),
        options=[
            ("grpc.max_receive_message_length", max_bytes),
            ("grpc.max_send_message_length", max_bytes),
        ],
    )
    servicer = LanguageServicer(engine_thread, config.default_max_new_tokens, embedding_source)
    language_pb2_grpc.add_LanguageServiceServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (
        language_pb2.DESCRIPTOR.services_by_name["LanguageService"].full_name,
        health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
        reflection.SERVICE_NAME,
    )
    reflection.enable_server_reflection(names, server)
    port = server.add_insecure_port(f"{config.host}:{config.port}")
    server.start()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    logger.info("language worker on %s:%d (%s)", config.host, port, engine.device)
    return LanguageServer(server, engine_thread, health_servicer, port, embedding_source)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_cli_args(parser, LanguageConfig, ENV_PREFIX)
    add_cli_args(parser, WorkerConfig, ENV_PREFIX)
    add_cli_args(parser, TransferConfig, TRANSFER_ENV_PREFIX, flag_prefix="transfer")


def config_from_args(args: argparse.Namespace) -> LanguageConfig:
    transfer = from_cli_args(TransferConfig, args, TRANSFER_ENV_PREFIX, flag_prefix="transfer")
    worker = from_cli_args(WorkerConfig, args, ENV_PREFIX)
    return from_cli_args(LanguageConfig, args, ENV_PREFIX, transfer=transfer, worker=worker)


def serve_with_receiver(config: LanguageConfig) -> LanguageServer:
    """``serve`` with the transfer plane's receiver as the embedding source."""
    from services.language.model.config import TextModelConfig
    from services.language.receiving import create_receiver_source

    model_config = TextModelConfig.from_pretrained(config.model_path)
    return serve(config, create_receiver_source(model_config, config.transfer))


def start_runtime(config: LanguageConfig, handle: LanguageServer) -> WorkerRuntime:
    """Registration with the gateway and the metrics endpoint of a serving worker."""
    return WorkerRuntime(
        config.worker,
        "language",
        config.host,
        handle.port,
        lambda: load_figures(handle),
        registry=create_registry(handle),
    )


def load_figures(handle: LanguageServer) -> dict[str, float]:
    """The load numbers the worker heartbeats to the gateway."""
    load = handle.engine_thread.load()
    return {
        "running": float(load.num_running),
        "waiting": float(load.num_waiting),
        "receiving": float(load.num_receiving),
        "kv_slots_used": float(load.num_kv_slots_used),
        "kv_slots_total": float(load.num_kv_slots_total),
    }


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    config = config_from_args(args)
    if not config.model_path:
        raise SystemExit("--model-path is required")
    handle = serve_with_receiver(config)
    runtime = start_runtime(config, handle)
    print(f"language worker listening on {config.host}:{handle.port}", flush=True)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    runtime.stop()
    handle.stop()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(prog="epd-language")
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
