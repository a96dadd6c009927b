"""``epd serve encoder``: the encoder's gRPC server (Encoder + health + reflection).

``serve(model_path, config)`` starts everything in-process and returns ``(server, service, port)``;
``add_arguments(parser)`` / ``run(args)`` are the command-line entry.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from concurrent import futures
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common.cli_config import add_cli_args, from_cli_args
from common.transfer.config import ENV_PREFIX as TRANSFER_ENV_PREFIX
from common.transfer.config import TransferConfig
from common.worker import WorkerConfig, WorkerRuntime
from protos.epd.v1 import encoder_pb2, encoder_pb2_grpc

from .config import ENV_PREFIX, EncoderConfig
from .metrics import create_registry
from .service import EncoderService
from .servicer import EncoderServicer
from .shipping import Sender

logger = logging.getLogger(__name__)
SERVICE_NAME = encoder_pb2.DESCRIPTOR.services_by_name["Encoder"].full_name


def serve(
    model_path: str | Path, config: EncoderConfig, sender: Sender | None = None
) -> tuple[grpc.Server, EncoderService, int]:
    """Load the model, start the server; returns (server, service, bound port).

    Stop with ``server.stop(grace)`` then ``service.close()``.
    """
    service = EncoderService(model_path, config, sender)
    max_bytes = config.max_message_mb << 20
    server = grpc.server(
        futures.ThreadPoolExecutor(config.grpc_workers, thread_name_prefix="epd-encoder-rpc"),
        options=[
            ("grpc.max_receive_message_length", max_bytes),
            ("grpc.max_send_message_length", max_bytes),
        ],
    )
    encoder_pb2_grpc.add_EncoderServicer_to_server(EncoderServicer(service), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    port = server.add_insecure_port(f"{config.host}:{config.port}")
    if port == 0:
        service.close()
        raise OSError(f"cannot bind {config.host}:{config.port}")
    server.start()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    endpoint = service.sender.endpoint
    logger.info("encoder serving on %s:%d (sender %s)", config.host, port, endpoint)
    return server, service, port


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-path", type=Path, required=True, help="checkpoint directory")
    add_cli_args(parser, EncoderConfig, ENV_PREFIX)
    add_cli_args(parser, WorkerConfig, ENV_PREFIX)
    add_cli_args(parser, TransferConfig, TRANSFER_ENV_PREFIX, flag_prefix="transfer")


def config_from_args(args: argparse.Namespace) -> EncoderConfig:
    transfer = from_cli_args(TransferConfig, args, TRANSFER_ENV_PREFIX, flag_prefix="transfer")
    worker = from_cli_args(WorkerConfig, args, ENV_PREFIX)
    return from_cli_args(EncoderConfig, args, ENV_PREFIX, transfer=transfer, worker=worker)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    config = config_from_args(args)
    server, service, port = serve(args.model_path, config)
    endpoint = service.sender.endpoint
    runtime = start_runtime(config, service, port)
    print(f"encoder listening on {config.host}:{port} sender={endpoint}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    runtime.stop()
    server.stop(grace=5).wait()
    service.close()
    return 0


def start_runtime(config: EncoderConfig, service: EncoderService, port: int) -> WorkerRuntime:
    """Registration with the gateway and the metrics endpoint of a serving encoder."""
    return WorkerRuntime(
        config.worker,
        "encoder",
        config.host,
        port,
        lambda: load_figures(service),
        info={"transfer_endpoint": service.sender.endpoint},
        registry=create_registry(service),
    )


def load_figures(service: EncoderService) -> dict[str, float]:
    """The load numbers the encoder heartbeats to the gateway."""
    load = service.load()
    return {
        "queue_depth": float(load.num_queued_requests),
        "queued_images": float(load.num_queued_images),
        "waiting_for_blocks": float(load.num_waiting_for_blocks),
        "free_blocks": float(load.sender.get("num_free_blocks", -1)),
    }


def main() -> int:
    parser = argparse.ArgumentParser(prog="epd serve encoder", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
