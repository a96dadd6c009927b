"""An encoder's host cut off with rooms queued, encoding and in transfer, then brought back.

Two encoders, one language worker. Every request ends once within its deadline (those the cut
encoder held fail ``UNAVAILABLE``, or are served when they had not started), the other encoder
takes the new image requests, text goes on, the language worker frees every room it was
receiving, and when the link returns the encoder (declared dead meanwhile) rejoins holding
nothing.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from tests.e2e.conftest import noise_image, png_bytes
from tests.hosts.conftest import wait_until
from tests.hosts.partitions import receiving, routed, seconds_until, stream

ARCH = "qwen2_5_vl"
NUM_REQUESTS = 10


def in_flight(stack, role: str) -> dict[str, int]:
    return {w.address: w.in_flight for w in stack.workers() if w.role == role}


def busy_encoder(stack) -> str:
    """The encoder with at least two requests in flight while the language worker receives
    ("" when none is)."""
    loads = in_flight(stack, "encoder")
    address = max(loads, key=loads.get)
    return address if loads[address] >= 2 and receiving(stack, 0) >= 1 else ""


def test_encoder_host_cut_with_rooms_in_every_state(tiny_model_dir, host_stack_factory) -> None:
    stack = host_stack_factory(
        tiny_model_dir(ARCH), num_encoders=2, env={"EPD_TRANSFER_DEFAULT_TOKENS": "128"}
    )
    # distinct large images: no cache hits, ViT work queued behind each other, multi-chunk rooms
    images = [png_bytes(noise_image(500 + i, 560)) for i in range(NUM_REQUESTS)]
    with stack.client() as client, ThreadPoolExecutor(NUM_REQUESTS) as pool:
        outcomes = [
            stream(pool, client, f"Describe {i}.", [images[i]], max_tokens=8, timeout=60)[0]
            for i in range(NUM_REQUESTS)
        ]
        busiest = wait_until(lambda: busy_encoder(stack), 60, "an encoder with rooms")
        victim = next(p for p in stack.encoders if p.address == busiest)
        survivor = next(p for p in stack.encoders if p is not victim)
        cut_at = time.monotonic()
        stack.cut(victim)
        unrouted_s = seconds_until(
            lambda: victim.address not in routed(stack, "encoder"), cut_at, 30, "unrouted"
        )
        for o in outcomes:
            assert o.ended.wait(60), "a request hangs"
        codes = [o.code for o in outcomes]
        assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE}, codes
        failed = [o for o in outcomes if o.code != grpc.StatusCode.OK]
        last_end_s = max(o.ended_at for o in outcomes) - cut_at
        # the language worker let go of every room the cut encoder was sending
        wait_until(lambda: receiving(stack, 0) == 0, 30, "rooms freed")
        reply = client.generate("Describe.", [images[0]], max_tokens=4, timeout=60)
        assert reply.encoder == survivor.address
        assert client.generate("Text only", max_tokens=4, timeout=30).token_ids

        stack.restore(victim)
        restored_at = time.monotonic()
        back_s = seconds_until(
            lambda: victim.address in routed(stack, "encoder"), restored_at, 30, "rejoined"
        )
        index = stack.encoders.index(victim)
        wait_until(lambda: not stack.encoder_holds(index), 30, "the victim freed its rooms")
        print(f"\nencoder host cut: {len(failed)} of {NUM_REQUESTS} failed "
              f"({sorted({o.details.split(':')[0] for o in failed})}), the last ended "
              f"{last_end_s:.1f} s after the cut; out of routing after {unrouted_s:.1f} s, back "
              f"{back_s:.1f} s after the link returned")  # fmt: skip
        for i in range(4):  # both encoders serve again
            reply = client.generate(f"Again {i}", [png_bytes(noise_image(700 + i, 112))],
                                    max_tokens=4, timeout=60)  # fmt: skip
            assert reply.encoder
    stack.wait_no_leaks(60)
