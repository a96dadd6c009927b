"""``epd serve encoder``: the encoder's gRPC server (Encoder + health + reflection).

``serve(model_path, config)`` starts everything in-process and returns ``(server, service, port)``;
``add_arguments(parser)`` / ``run(args)`` are the command-line entry.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import grpc

from common.cli_config import add_cli_args, from_cli_args
from common.grpc_server import Running, create_server, serve_until_terminated, start_server
from common.internal import server_security
from common.stream_capacity import StreamCapacity
from common.worker import WorkerRuntime, add_worker_arguments, worker_configs
from protos.epd.v1 import encoder_pb2, encoder_pb2_grpc

from . import convert
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
    long_methods = (f"/{SERVICE_NAME}/Encode", f"/{SERVICE_NAME}/WaitEncoded")
    capacity = StreamCapacity(config.grpc_workers, long_methods, who="encoder")
    try:
        server = create_server(
            "epd-encoder", config.max_message_mb, capacity, server_security(config.worker.internal)
        )
        encoder_pb2_grpc.add_EncoderServicer_to_server(EncoderServicer(service), server)
        port, _ = start_server(
            server, config.host, config.port, (SERVICE_NAME,), config.worker.health_port
        )
    except (OSError, ValueError):
        service.close()
        raise
    endpoint = service.sender.endpoint
    logger.info("encoder serving on %s:%d (sender %s)", config.host, port, endpoint)
    return server, service, port


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-path", type=Path, required=True, help="checkpoint directory")
    add_cli_args(parser, EncoderConfig, ENV_PREFIX)
    add_worker_arguments(parser, ENV_PREFIX)


def config_from_args(args: argparse.Namespace) -> EncoderConfig:
    return from_cli_args(EncoderConfig, args, ENV_PREFIX, **worker_configs(args, ENV_PREFIX))


def start(args: argparse.Namespace) -> Running:
    """Serve, register with the gateway, expose metrics (``epd serve encoder`` and Ray)."""
    config = config_from_args(args)
    server, service, port = serve(args.model_path, config)
    runtime = start_runtime(config, service, port)

    def stop() -> None:
        runtime.stop()
        server.stop(grace=5).wait()
        service.close()

    banner = f"encoder listening on {config.host}:{port} sender={service.sender.endpoint}"
    return Running(port, banner, stop)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    return serve_until_terminated(start(args))


def start_runtime(config: EncoderConfig, service: EncoderService, port: int) -> WorkerRuntime:
    """Registration with the gateway and the metrics endpoint of a serving encoder."""
    return WorkerRuntime(
        config.worker,
        "encoder",
        config.host,
        port,
        lambda: convert.load_to_proto(service.load()),
        info={"transfer_endpoint": service.sender.endpoint},
        registry=create_registry(service),
    )


def main() -> int:
    parser = argparse.ArgumentParser(prog="epd serve encoder", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
