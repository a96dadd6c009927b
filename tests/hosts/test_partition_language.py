"""A language worker's host cut off (link down, the process runs on) and brought back.

Mid-decode: the streams on it end ``UNAVAILABLE`` once the gateway drops it as silent
(``--worker-expiry-s``, 3 s here), the streams on the other worker go on, new requests go to the
other worker; when the link returns the worker, declared dead meanwhile, registers again and
serves, having freed the requests it was decoding (its server's keepalive found the gateway
gone). Mid-transfer: a prompt many times the default buffer (continuations), cut while the
embeddings arrive; the encoder frees the room's blocks once the receiver is silent.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from tests.e2e.conftest import noise_image, png_bytes
from tests.hosts.conftest import wait_until
from tests.hosts.partitions import receiving, routed, running, seconds_until, stream

LONG = {"max_tokens": 8000, "ignore_eos": True}  # far longer than the test: cancelled at its end
SMALL_IMAGE = png_bytes(noise_image(1, 112))
ARCH = "qwen2_5_vl"


def test_language_host_cut_mid_decode_then_rejoins(tiny_model_dir, host_stack_factory) -> None:
    stack = host_stack_factory(tiny_model_dir(ARCH), num_languages=2)
    victim, survivor = stack.languages
    outcomes = []
    with stack.client() as client, ThreadPoolExecutor(8) as pool:
        try:
            _cut_mid_decode(stack, client, pool, outcomes)
        finally:
            for o in outcomes:
                o.call.cancel()  # the other worker's streams (and all of them on a failure)
    stack.wait_no_leaks(60)


def _cut_mid_decode(stack, client, pool, outcomes) -> None:
    victim, survivor = stack.languages
    # one at a time, so that the gateway sees each in flight and spreads them by load
    for i in range(8):
        images = [SMALL_IMAGE] if i % 2 else []
        outcome, _ = stream(pool, client, f"Tell long story {i}.", images, timeout=120, **LONG)
        outcomes.append(outcome)
        assert outcome.first_chunk.wait(60), outcome.details
        if len(outcomes) >= 4 and running(stack, 0) and running(stack, 1):
            break
    num_on_victim = running(stack, 0)
    assert num_on_victim and running(stack, 1)
    cut_at = time.monotonic()
    stack.cut(victim)
    unrouted_s = seconds_until(
        lambda: victim.address not in routed(stack, "language"), cut_at, 30, "unrouted"
    )
    wait_until(lambda: sum(o.ended.is_set() for o in outcomes) == num_on_victim, 30, "ends")
    ended = [o for o in outcomes if o.ended.is_set()]
    for o in ended:
        assert o.code == grpc.StatusCode.UNAVAILABLE, (o.code, o.details)
        assert victim.address in o.details
        assert 0 < o.num_tokens < LONG["max_tokens"]
    ended_s = max(o.ended_at for o in ended) - cut_at
    assert victim.address not in {w.address for w in stack.workers()}  # declared dead
    reply = client.generate("Still there?", [SMALL_IMAGE], max_tokens=4, timeout=30)
    assert reply.language == survivor.address

    stack.restore(victim)
    restored_at = time.monotonic()
    back_s = seconds_until(
        lambda: victim.address in routed(stack, "language"), restored_at, 30, "rejoined"
    )
    # the worker freed the requests whose gateway side ended while it was cut off
    wait_until(lambda: running(stack, 0) == 0, 30, "the victim's requests freed")
    freed_s = time.monotonic() - restored_at
    print(f"\nlanguage host cut mid-decode: out of routing after {unrouted_s:.1f} s, "
          f"its {num_on_victim} streams ended after {ended_s:.1f} s, back in routing "
          f"{back_s:.1f} s after the link returned, its requests freed by "
          f"{freed_s:.1f} s after")  # fmt: skip
    assert [o for o in outcomes if o.ended.is_set()] == ended  # the others run on
    for i in range(4):
        reply = client.generate(f"Again {i}", max_tokens=4, timeout=30)
        assert reply.token_ids


def test_language_host_cut_mid_transfer(tiny_model_dir, host_stack_factory) -> None:
    """~1,300-token prompts against a 128-token default buffer, the receiver cut off while the
    rooms are open: each request ends once (one the victim had not answered is sent again to
    the other worker), the encoder frees every room and block."""
    stack = host_stack_factory(
        tiny_model_dir(ARCH), num_languages=2, env={"EPD_TRANSFER_DEFAULT_TOKENS": "128"}
    )
    images = [png_bytes(noise_image(300 + i, 672)) for i in range(6)]
    with stack.client() as client, ThreadPoolExecutor(6) as pool:
        outcomes = [
            stream(pool, client, f"Describe picture {i}.", [images[i]], max_tokens=8,
                   timeout=60)[0]
            for i in range(6)
        ]  # fmt: skip
        index = wait_until(
            lambda: next((i + 1 for i in range(2) if receiving(stack, i)), 0), 60, "a room"
        )
        victim = stack.languages[index - 1]
        cut_at = time.monotonic()
        stack.cut(victim)
        for o in outcomes:
            assert o.ended.wait(60)
        codes = [o.code for o in outcomes]
        assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE}, codes
        # a request the victim had not answered yet is sent again to the other worker
        served = {o.chunks[-1].language for o in outcomes if o.code == grpc.StatusCode.OK}
        assert victim.address not in served
        last_end_s = max(o.ended_at for o in outcomes) - cut_at
        # the encoder let go of the cut-off receiver's rooms (heartbeat silence)
        wait_until(lambda: not stack.encoder_holds(0), 30, "encoder rooms freed")
        freed_s = time.monotonic() - cut_at
        stack.restore(victim)
        wait_until(lambda: victim.address in routed(stack, "language"), 30, "rejoined")
        print(f"\nlanguage host cut mid-transfer: {codes.count(grpc.StatusCode.OK)} of 6 "
              f"served (by the other worker), the last ended {last_end_s:.1f} s after the cut; "
              f"the encoder held nothing {freed_s:.1f} s after it")  # fmt: skip
        reply = client.generate("Describe.", [images[0]], max_tokens=4, timeout=60)
        assert reply.timing.num_transfers >= 2  # still a multi-chunk prompt
    stack.wait_no_leaks(60)
