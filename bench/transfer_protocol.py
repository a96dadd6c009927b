"""``epd transfer-bench``: the protocol against a raw write of the same bytes, same run.

A sender and a receiver process move ``--rooms`` rooms of ``--tokens`` tokens (every token an
image token: the worst case) through the full protocol; the receiver verifies every byte. The
raw baseline is one ``transfer_sync_write`` of one contiguous region of the same number of bytes
between the same two processes (a memcpy into the peer's mapping with ``--transport shm``), of
freshly written source bytes like the protocol's, right after each protocol repetition.
Times are medians over ``--repeats`` after one warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from dataclasses import dataclass

from bench.peer import Peer
from bench.synthetic import RequestSpec
from common.transfer.aux_record import AUX_RECORD_BYTES
from common.transfer.config import TransferConfig
from common.transfer.layout import BufferLayout, parse_dtype
from common.transfer.shm_transport import ShmTransport

JSON_KEYS = (
    "tokens",
    "rooms",
    "transfers",
    "bytes",
    "protocol_ms",
    "raw_ms",
    "ratio",
    "checksum_ok",
    "leaked_blocks_sender",
    "leaked_blocks_receiver",
)


@dataclass(frozen=True)
class BenchParams:
    tokens: int = 2000
    default_tokens: int = 1024
    hidden: int = 3584
    deepstack: int = 0
    dtype: str = "bf16"
    transport: str = "mooncake"
    rooms: int = 1
    repeats: int = 5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=int, default=2000, help="tokens per room")
    parser.add_argument("--default-tokens", type=int, default=1024, help="receiver prealloc")
    parser.add_argument("--hidden", type=int, default=3584, help="hidden size")
    parser.add_argument("--deepstack", type=int, default=0, help="deepstack rows per token")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--transport", choices=("mooncake", "shm"), default="mooncake")
    parser.add_argument("--rooms", type=int, default=1, help="concurrent rooms per repetition")
    parser.add_argument("--repeats", type=int, default=5, help="timed repetitions (median)")
    parser.add_argument("--json", action="store_true", help="print one JSON line")


def _geometry(p: BenchParams, row_bytes: int) -> tuple[int, int]:
    """(sender blocks, receiver blocks): room data plus room for the raw baseline's bytes.

    The receiver is sized like a serving one: every room can stay in its blocks until the
    consumer releases it (half the buffer at most, see ``max_lent_fraction``) with a default
    allocation to spare.
    """
    bs = 128
    bytes_estimate = p.rooms * (p.tokens * (row_bytes + 16) + AUX_RECORD_BYTES)
    raw_blocks = -(-bytes_estimate // (bs * row_bytes)) + 1
    default_blocks = p.default_tokens // bs
    room_blocks = max(-(-p.tokens // bs), default_blocks)
    sender = max(p.rooms * -(-p.tokens // bs), raw_blocks)
    receiver = max(2 * p.rooms * room_blocks + default_blocks, raw_blocks)
    return sender, receiver


def measure(p: BenchParams) -> dict:
    """Run the benchmark; returns the ``JSON_KEYS`` record plus ``write_ms``."""
    os.environ.setdefault("GLOG_minloglevel", "2")
    dtype = parse_dtype(p.dtype)
    probe = BufferLayout(1, 128, p.hidden, p.deepstack, dtype)
    num_sender_blocks, num_receiver_blocks = _geometry(p, probe.row_bytes)
    configs = {  # default_tokens only matters to the receiver
        "sender": TransferConfig(
            num_blocks=num_sender_blocks, default_tokens=128, transport=p.transport
        ),
        "receiver": TransferConfig(
            num_blocks=num_receiver_blocks, default_tokens=p.default_tokens, transport=p.transport
        ),
    }
    layouts = {
        role: BufferLayout(c.num_blocks, 128, p.hidden, p.deepstack, dtype)
        for role, c in configs.items()
    }
    sender = Peer("sender", configs["sender"], layouts["sender"])
    receiver = Peer("receiver", configs["receiver"], layouts["receiver"])
    try:
        return _run(p, sender, receiver)
    finally:
        sender.close()
        receiver.close()


def _run(p: BenchParams, sender: Peer, receiver: Peer) -> dict:
    """Each repetition moves the rooms through the protocol, then writes the same number of
    bytes raw, so both see the machine in the same state; the first repetition warms up."""
    session, raw_base = _raw_target(p, receiver)
    times, raw, writes, transfers, checksum_ok, nbytes = [], [], [], 0, True, 0
    wakeups, frames = [], []
    for rep in range(p.repeats + 1):
        specs = [RequestSpec(rep * p.rooms + i + 1, p.tokens, p.tokens) for i in range(p.rooms)]
        before = sender.ask("call", "stats")
        received_before = receiver.ask("call", "stats")
        if not sender.ask("submit_all", specs):
            raise RuntimeError("sender could not take the rooms")
        result = receiver.ask("receive", specs, sender.endpoint, 300.0, timeout_s=330.0)
        sender.ask("wait_idle", 10.0)
        outcomes = list(result["rooms"].values())
        checksum_ok &= all(isinstance(o, tuple) and o[0] == "ok" for o in outcomes)
        if isinstance(outcomes[0], tuple):
            transfers = outcomes[0][1]
        after = sender.ask("call", "stats")
        received_after = receiver.ask("call", "stats")
        nbytes = after["bytes_sent"] - before["bytes_sent"]
        raw_s = sender.ask("raw_write", session, raw_base, nbytes, 1)[0]
        if rep:
            times.append(result["elapsed_s"])
            raw.append(raw_s)
            writes.append(after["write_seconds"] - before["write_seconds"])
            ends = ((before, after), (received_before, received_after))
            wakeups.append(sum(b["num_wakeups"] - a["num_wakeups"] for a, b in ends) / p.rooms)
            frames.append(sum(_frames(b) - _frames(a) for a, b in ends) / p.rooms)
    leaked_sender = sender.ask("wait_idle", 10.0)["num_used_blocks"]
    leaked_receiver = receiver.ask("wait_idle", 10.0)["num_used_blocks"]
    protocol_ms = statistics.median(times) * 1e3
    raw_ms = statistics.median(raw) * 1e3
    return {
        "tokens": p.tokens,
        "rooms": p.rooms,
        "transfers": transfers,
        "bytes": nbytes,
        "protocol_ms": round(protocol_ms, 3),
        "raw_ms": round(raw_ms, 3),
        "ratio": round(raw_ms / protocol_ms, 3),
        "checksum_ok": bool(checksum_ok),
        "leaked_blocks_sender": leaked_sender,
        "leaked_blocks_receiver": leaked_receiver,
        # not in the JSON line: the sender's time inside its writes, summed over its rooms
        "write_ms": round(statistics.median(writes) * 1e3, 3),
        # nor these: control-loop wake-ups and control frames received, both ends, per room
        "wakeups_per_room": statistics.median(wakeups),
        "frames_per_room": statistics.median(frames),
    }


def _frames(stats: dict) -> int:
    return stats["messages"].get("received", 0)


def _raw_target(p: BenchParams, receiver: Peer) -> tuple[str, int]:
    """(session, address) for the raw write: the start of the receiver's rows region."""
    target = receiver.ask("raw_target")
    if p.transport == "shm":
        region = (target["shm_name"], target["base"], target["nbytes"])
        return "shm:" + ShmTransport.session_for([region]), target["base"]
    return target["session"], target["base"]


def format_table(records: list[dict]) -> str:
    header = f"{'tokens':>7} {'rooms':>5} {'xfers':>5} {'MB':>9} {'protocol ms':>12} "
    header += f"{'raw ms':>9} {'ratio':>6} {'ok':>3} {'leaks':>6}"
    lines = [header]
    for r in records:
        leaks = f"{r['leaked_blocks_sender']}/{r['leaked_blocks_receiver']}"
        lines.append(
            f"{r['tokens']:>7} {r['rooms']:>5} {r['transfers']:>5} {r['bytes'] / 1e6:>9.2f} "
            f"{r['protocol_ms']:>12.3f} {r['raw_ms']:>9.3f} {r['ratio']:>6.3f} "
            f"{'yes' if r['checksum_ok'] else 'NO':>3} {leaks:>6}"
        )
    return "\n".join(lines)


def is_clean(record: dict) -> bool:
    return (
        record["checksum_ok"]
        and record["leaked_blocks_sender"] == 0
        and record["leaked_blocks_receiver"] == 0
    )


def run(args: argparse.Namespace) -> int:
    if args.tokens <= 0 or args.rooms <= 0 or args.repeats <= 0:
        raise SystemExit("--tokens, --rooms and --repeats must be positive")
    params = BenchParams(
        tokens=args.tokens,
        default_tokens=args.default_tokens,
        hidden=args.hidden,
        deepstack=args.deepstack,
        dtype=args.dtype,
        transport=args.transport,
        rooms=args.rooms,
        repeats=args.repeats,
    )
    record = measure(params)
    if args.json:
        print(json.dumps({key: record[key] for key in JSON_KEYS}))
    else:
        print(format_table([record]))
    return 0 if is_clean(record) else 1
