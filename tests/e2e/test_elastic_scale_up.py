"""Scale-up under load, with real processes on 127.0.0.1: workers started while requests flow
through two gateways register with both within a few heartbeats and take their share at once.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc

from protos.epd.v1 import common_pb2
from services.gateway.client import GatewayClient
from tests.e2e.conftest import noise_image, png_bytes
from tests.e2e.test_faults import wait_for

ARCH = "qwen2_5_vl"
HEARTBEAT_S = 0.5  # the test stacks' --heartbeat-interval-s
CONCURRENCY = 6
WARM_UP = 3  # requests each new worker serves before its share is counted
WINDOW = 8 * CONCURRENCY  # requests the share is counted over


@dataclass(frozen=True)
class Served:
    done_at: float
    encoder: str
    language: str


def test_workers_started_under_load_serve_their_share(tiny_model_dir, stack_factory) -> None:
    stack = stack_factory(tiny_model_dir(ARCH), num_gateways=2)
    served: list[Served] = []
    failures: list[str] = []
    stop = threading.Event()
    lock = threading.Lock()

    def load(worker_id: int) -> None:
        """Requests one after the other; half the threads prefer each gateway."""
        n = 0
        gateways = (
            stack.gateway_addresses[worker_id % 2 :] + stack.gateway_addresses[: worker_id % 2]
        )
        with GatewayClient(gateways) as client:
            while not stop.is_set():
                n += 1
                image = png_bytes(noise_image(10_000 * worker_id + n, 112))  # always a new one
                try:
                    reply = client.generate(
                        f"Load {worker_id}.{n}", [image], max_tokens=8, ignore_eos=True
                    )
                except grpc.RpcError as exc:
                    failures.append(f"{exc.code().name}: {exc.details()}")
                    continue
                if reply.finish_reason != common_pb2.FINISH_REASON_LENGTH:
                    failures.append(f"finish_reason {reply.finish_reason}")
                with lock:
                    served.append(Served(time.monotonic(), reply.encoder, reply.language))

    with ThreadPoolExecutor(CONCURRENCY) as pool:
        running = [pool.submit(load, i) for i in range(CONCURRENCY)]
        wait_for(lambda: len(served) >= 2 * CONCURRENCY, 120, "load flowing")
        language = stack.start_worker("language", wait=False)
        encoder = stack.start_worker("encoder", wait=False)
        for proc in (language, encoder):
            proc.wait_healthy(180)
        new = {language.address, encoder.address}

        def listed_everywhere() -> bool:
            return all(
                new <= {w.address for w in stack.workers(r) if w.healthy}
                for r in stack.registry_addresses
            )

        wait_for(listed_everywhere, 4 * HEARTBEAT_S, "both gateways listing the new workers")
        wait_for(
            lambda: (
                sum(s.language == language.address for s in served) >= WARM_UP
                and sum(s.encoder == encoder.address for s in served) >= WARM_UP
            ),
            30,
            "the new workers serving",
        )
        # the share is counted once they are warm (first calls of a process are slow), over
        # enough requests that half, give or take, is not luck
        window_start = time.monotonic()
        wait_for(
            lambda: sum(s.done_at > window_start for s in served) >= WINDOW,
            180,
            "requests after scale-up",
        )
        stop.set()
        for future in running:
            future.result(60)
    assert failures == []
    after = [s for s in served if s.done_at > window_start]
    share_language = sum(s.language == language.address for s in after) / len(after)
    share_encoder = sum(s.encoder == encoder.address for s in after) / len(after)
    # two workers per pool: each new one takes a fair part of the load (half, give or take)
    assert share_language >= 0.25 and share_encoder >= 0.25, (share_language, share_encoder)
    stack.wait_no_leaks()
