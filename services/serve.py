"""``epd serve encoder|language|gateway [options]``: run one role in this process.

Each role's server module owns its options (``epd serve ROLE --help`` lists them); the module is
imported only for the role asked for, so the gateway never loads torch. Every role first restarts
itself with tcmalloc preloaded (``common/allocator.py``) unless ``LD_PRELOAD`` is set.
"""

from __future__ import annotations

import argparse
import importlib

from common.allocator import restart_with_allocator

ROLE_MODULES = {
    "encoder": "services.encoder.server",
    "language": "services.language.server",
    "gateway": "services.gateway.server",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("role", choices=sorted(ROLE_MODULES), help="which service to run")
    parser.add_argument("options", nargs=argparse.REMAINDER, help="the role's own options")


def run(args: argparse.Namespace) -> int:
    restart_with_allocator()  # before torch is imported (returns when nothing is to do)
    module = importlib.import_module(ROLE_MODULES[args.role])
    parser = argparse.ArgumentParser(prog=f"epd serve {args.role}")
    module.add_arguments(parser)
    return int(module.run(parser.parse_args(args.options)) or 0)
