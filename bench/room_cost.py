"""The fixed cost of one transfer room, for ``bench.transfer``: what bounds small rooms.

Measured in one run, between two processes on 127.0.0.1:

* a 1-token room through the full protocol vs one raw Mooncake write of the same bytes (the
  difference is the fixed cost per room);
* inside the protocol's time, the sender's own transport write (one batch: the image rows, and
  over shared memory or to an older receiver the token fields and aux record too);
  the rest is control: the init and the final status on ZMQ, the hand-offs between the control
  loops, the writer thread and the consumer;
* a bare ZMQ round trip between two processes (PUSH to a peer's PULL and back, the control
  plane's socket pattern), the floor of any protocol that needs an init and a status: back to
  back, and after an idle gap like the one before each room (every thread on the way then
  wakes from sleep, as a room's do: on a 2-vCPU VM that costs several times the warm trip);
* control-loop wake-ups and control frames per room (both ends), from the peers' counters;
* the intercept of a least-squares line through the time-vs-size table (protocol and raw), the
  same fixed cost seen from the large rooms.

``python -m bench.room_cost`` prints this breakdown alone (``bench.transfer`` adds the table).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import sys
import time
from dataclasses import dataclass

import zmq

from bench.transfer_protocol import BenchParams, measure

REPEATS = 30
ROUND_TRIPS = 200
IDLE_GAP_S = 0.005  # about the pause before each room in ``measure`` (the driver's commands)


@dataclass(frozen=True)
class RoomCost:
    protocol_ms: float  # a 1-token room, add_room to delivered
    raw_ms: float  # one raw write of the same bytes
    write_ms: float  # the sender's transport write inside the protocol's time
    zmq_round_trip_ms: float  # bare two-process ZMQ round trip, back to back
    zmq_idle_round_trip_ms: float  # the same after IDLE_GAP_S idle, as before each room
    wakeups_per_room: float
    frames_per_room: float
    nbytes: int

    @property
    def fixed_ms(self) -> float:
        return self.protocol_ms - self.raw_ms

    @property
    def control_ms(self) -> float:
        """The protocol's time outside its transport write."""
        return self.protocol_ms - self.write_ms


def _echo(endpoint: str, ready) -> None:
    """Child: bind a PULL, tell the parent where, send every frame back to the parent's PULL."""
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = ctx.socket(zmq.PUSH)
    push.connect(endpoint)
    ready.send(port)
    while True:
        frame = pull.recv()
        if frame == b"stop":
            break
        push.send(frame)
    push.close(0)
    pull.close(0)
    ctx.term()


def zmq_round_trip_ms(num: int = ROUND_TRIPS, gap_s: float = 0.0) -> float:
    """Median time of a 200-byte frame to a child process and back (after 20 warm-ups),
    ``gap_s`` idle between trips."""
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    spawn = mp.get_context("spawn")
    ours, theirs = spawn.Pipe()
    child = spawn.Process(target=_echo, args=(f"tcp://127.0.0.1:{port}", theirs), daemon=True)
    child.start()
    push = ctx.socket(zmq.PUSH)
    try:
        if not ours.poll(60):
            raise TimeoutError("echo process did not start")
        push.connect(f"tcp://127.0.0.1:{ours.recv()}")
        poller = zmq.Poller()
        poller.register(pull, zmq.POLLIN)
        frame, times = b"x" * 200, []
        for i in range(num + 20):
            start = time.perf_counter()
            push.send(frame)
            if not poller.poll(10_000):
                raise TimeoutError("no echo within 10 s")
            pull.recv()
            if i >= 20:
                times.append(time.perf_counter() - start)
            if gap_s:
                time.sleep(gap_s)
        push.send(b"stop")
    finally:
        child.join(10)
        if child.is_alive():
            child.kill()
        push.close(0)
        pull.close(0)
        ctx.term()
    return statistics.median(times) * 1e3


def measure_room_cost(repeats: int = REPEATS) -> RoomCost:
    record = measure(BenchParams(tokens=1, default_tokens=128, repeats=repeats))
    return RoomCost(
        protocol_ms=record["protocol_ms"],
        raw_ms=record["raw_ms"],
        write_ms=record["write_ms"],
        zmq_round_trip_ms=zmq_round_trip_ms(),
        zmq_idle_round_trip_ms=zmq_round_trip_ms(gap_s=IDLE_GAP_S),
        wakeups_per_room=record["wakeups_per_room"],
        frames_per_room=record["frames_per_room"],
        nbytes=record["bytes"],
    )


def intercept_ms(records: list[dict], key: str) -> float:
    """Intercept (ms at 0 bytes) of the least-squares line of ``key`` against bytes."""
    xs = [float(r["bytes"]) for r in records]
    ys = [float(r[key]) for r in records]
    return statistics.linear_regression(xs, ys).intercept


def format_cost(cost: RoomCost, records: list[dict]) -> str:
    rest = cost.control_ms - cost.zmq_idle_round_trip_ms
    lines = [
        f"fixed cost per room {cost.fixed_ms:.2f} ms "
        f"(1-token room, {cost.nbytes} B: protocol {cost.protocol_ms:.2f} ms vs raw write "
        f"{cost.raw_ms:.2f} ms, median of {REPEATS})",
        f"  in the sender's write (one batch)             {cost.write_ms:>7.2f} ms",
        f"  control: init -> status -> delivered          {cost.control_ms:>7.2f} ms",
        f"    of which a bare ZMQ round trip, {IDLE_GAP_S * 1e3:.0f} ms idle   "
        f"{cost.zmq_idle_round_trip_ms:>7.2f} ms ({cost.zmq_round_trip_ms:.2f} back to back)",
        f"    thread hand-offs, handlers, assembly        {rest:>7.2f} ms",
        f"  control-loop wake-ups / frames per room       {cost.wakeups_per_room:>7.1f} / "
        f"{cost.frames_per_room:.1f}",
    ]
    if len(records) >= 2:
        protocol, raw = intercept_ms(records, "protocol_ms"), intercept_ms(records, "raw_ms")
        lines.append(
            f"  intercept of time vs bytes (table above): protocol {protocol:.2f} ms, "
            f"raw {raw:.2f} ms"
        )
    return "\n".join(lines)


def main() -> int:
    os.environ.setdefault("GLOG_minloglevel", "2")
    cost = measure_room_cost()
    print(format_cost(cost, []))
    return 0


if __name__ == "__main__":
    sys.exit(main())
