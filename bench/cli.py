"""``epd bench <which>``: the benchmarks as subcommands.

* ``e2e`` — end to end through the gateway vs transformers (``bench.e2e``).
* ``all`` — every benchmark, each in a fresh interpreter (``bench.run_all``, ``make bench``).
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from bench import e2e

    sub = parser.add_subparsers(dest="which", required=True, metavar="{e2e,all}")
    e2e.add_arguments(sub.add_parser("e2e", help="end to end through the gateway vs transformers"))
    sub.add_parser("all", help="every benchmark, one after the other (make bench)")


def run(args: argparse.Namespace) -> int:
    if args.which == "e2e":
        from bench import e2e

        return e2e.run(args)
    from bench import run_all

    return run_all.main()
