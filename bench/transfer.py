"""Transfer-plane benchmark table for ``make bench``: time vs tokens, protocol vs raw.

``main()`` runs ``bench.transfer_protocol.measure`` for 128..16384 tokens (hidden 3584, bf16,
all tokens image tokens) plus the three goal scenarios and four concurrent rooms, then the bytes
on the wire per image in bf16 and fp32 for the real models' row widths (``bench.wire_bytes``),
and prints the tables; then the fixed cost of one room (``bench.room_cost``): a 1-token room
through the protocol vs a raw write of its bytes, broken into write and control time.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("GLOG_minloglevel", "2")

from bench import room_cost, wire_bytes  # noqa: E402
from bench.transfer_protocol import BenchParams, format_table, is_clean, measure  # noqa: E402

TOKENS = (128, 256, 512, 1024, 2048, 4096, 8192, 16384)
GOAL_REPEATS = 15


def goal_rows() -> list[tuple[str, dict]]:
    whole = measure(BenchParams(tokens=2000, default_tokens=2048, repeats=GOAL_REPEATS))
    split = measure(BenchParams(tokens=2000, default_tokens=1024, repeats=GOAL_REPEATS))
    shm = measure(
        BenchParams(tokens=2000, default_tokens=2048, transport="shm", repeats=GOAL_REPEATS)
    )
    rooms = measure(BenchParams(tokens=2000, default_tokens=2048, rooms=4, repeats=GOAL_REPEATS))
    return [
        ("protocol / raw Mooncake, 2000 tok, default 2048 (goal >= 0.9)", whole),
        ("2000 tok, default 1024 (goal <= 1.25x the row above)", split),
        ("shm / memcpy, 2000 tok (goal >= 0.5)", shm),
        ("protocol / raw Mooncake, 4 concurrent rooms of 2000 tok", rooms),
    ]


def main() -> int:
    records = [measure(BenchParams(tokens=n, default_tokens=1024)) for n in TOKENS]
    print("time vs tokens (hidden 3584 bf16, default 1024, Mooncake tcp, median of 5)")
    print(format_table(records))
    goals = goal_rows()
    print(f"\ngoals (median of {GOAL_REPEATS})")
    for label, record in goals:
        print(
            f"  {label}: ratio {record['ratio']:.3f}, protocol {record['protocol_ms']:.2f} ms "
            f"(in its writes {record['write_ms']:.2f} ms), raw {record['raw_ms']:.2f} ms"
        )
    whole, split = goals[0][1], goals[1][1]
    print(f"  split / whole: {split['protocol_ms'] / whole['protocol_ms']:.3f}")
    per_image = wire_bytes.rows()
    print(
        f"\nbytes on the wire per image by wire dtype (EPD_TRANSFER_DTYPE; Mooncake tcp, "
        f"median of {wire_bytes.REPEATS})"
    )
    print(wire_bytes.format_table(per_image))
    cost = room_cost.measure_room_cost()
    print("\nwhat bounds small rooms")
    print(room_cost.format_cost(cost, records))
    clean = all(is_clean(r) for r in records + [g[1] for g in goals])
    return 0 if clean and wire_bytes.all_clean(per_image) else 1


if __name__ == "__main__":
    sys.exit(main())
