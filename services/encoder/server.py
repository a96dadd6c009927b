"""``epd serve encoder``: the encoder's gRPC server (Encoder + health + reflection).

``serve(model_path, config)`` starts everything in-process and returns ``(server, service, port)``;
``add_arguments(parser)`` / ``run(args)`` are the command-line entry.

On SIGTERM the encoder drains (``common.worker.drain_worker``): it leaves every gateway, refuses
new ``Encode`` calls with ``UNAVAILABLE`` (the gateway tries its next encoder) and finishes what it
accepted — rooms queued for the ViT, waiting for blocks, or held by the sender until their
language worker pulled them (``wait_until_idle``) — up to ``--drain-timeout-s``; ``Cancel``,
``GetLoad`` and ``WaitEncoded`` keep answering meanwhile. Then it stops.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

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
from common.worker import WorkerRuntime, add_worker_arguments, drain_worker, worker_configs
from protos.epd.v1 import encoder_pb2, encoder_pb2_grpc

from . import convert
from .config import ENV_PREFIX, EncoderConfig
from .errors import UnknownRoom
from .metrics import create_registry
from .service import EncoderService
from .servicer import EncoderServicer
from .shipping import Sender
from .types import RoomStatus

logger = logging.getLogger(__name__)
SERVICE_NAME = encoder_pb2.DESCRIPTOR.services_by_name["Encoder"].full_name
# Rooms not done with: being encoded, waiting for blocks, held by the sender.
UNFINISHED = (RoomStatus.QUEUED, RoomStatus.ENCODED, RoomStatus.SUBMITTED)
RECHECK_S = (0.01, 0.2)  # first and longest wait between looks at the sender's rooms


def serve(
    model_path: str | Path, config: EncoderConfig, sender: Sender | None = None
) -> tuple[Server, EncoderService, int]:
    """Load the model, start the server; returns (server, service, bound port).

    Stop with ``server.stop(grace)`` then ``service.close()``.
    """
    num_threads = set_compute_threads(config.worker.compute_threads)
    logger.info("encoder: %d compute threads", num_threads)
    service = EncoderService(model_path, config, sender)
    release_free_memory()  # what loading and prepacking freed (common/allocator.py)
    encode = f"/{SERVICE_NAME}/Encode"
    long_methods = (encode, f"/{SERVICE_NAME}/WaitEncoded")
    capacity = StreamCapacity(config.grpc_workers, long_methods, who="encoder")
    try:
        server = create_server(
            "epd-encoder",
            config.max_message_mb,
            capacity,
            server_security(config.worker.internal),
            work_methods=(encode,),
            keepalive=config.worker.keepalive,
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
    logger.info(allocator_line())
    server, service, port = serve(args.model_path, config)
    runtime = start_runtime(config, service, port)

    def stop() -> None:
        runtime.stop()
        server.stop(grace=5).wait()
        service.close()

    def drain(deadline: float) -> bool:
        return drain_worker(server, runtime, deadline, lambda d: wait_until_idle(service, d))

    banner = f"encoder listening on {config.host}:{port} sender={service.sender.endpoint}"
    return Running(port, banner, stop, drain=drain, drain_timeout_s=config.worker.drain_timeout_s)


def wait_until_idle(service: EncoderService, deadline: float) -> bool:
    """Until the encoder owes no language worker anything (True), or ``deadline``
    (``time.monotonic``) passes (False).

    No room is accepted any more (``Encode`` is refused), so the rooms unfinished now are all
    there is; each is awaited on the room table's condition until it is shipped or failed. A
    room whose language worker has not asked for it yet is awaited too: a receiver short of
    blocks sends its init late, and the sender's own bootstrap timeout ends a room that nobody
    asks for. NOTE: the sender signals no event when its last room ends; its rooms outlive the
    table's only by a write's acknowledgement or a receiver's abort, so it is looked at again
    after short, growing waits.
    """
    rooms = [room for status in UNFINISHED for room in service.rooms.rooms_with(status)]
    logger.info("draining: %d accepted rooms to finish", len(rooms))
    for room in rooms:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        try:
            service.wait(room, RoomStatus.SHIPPED, left)
        except UnknownRoom:
            pass
    wait_s = RECHECK_S[0]
    while service.sender.stats().get("rooms_active"):
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(wait_s, left))
        wait_s = min(2 * wait_s, RECHECK_S[1])
    return True


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    return serve_until_terminated(lambda: start(args))


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
