"""The ``epd`` console command.

Each subcommand lives in the module that owns it and exposes ``add_arguments(parser)`` and
``run(args) -> int``; this file only maps names to modules, importing the chosen one lazily so
that ``epd --help`` stays fast and a subcommand never pays for another's imports.
The subcommand names are a public contract.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "transfer-bench": ("bench.transfer_protocol", "benchmark the embedding transfer protocol"),
    "make-tiny-model": ("common.models.tiny", "write a random-weight Qwen-VL checkpoint"),
    "serve": ("services.serve", "serve one role: encoder | language | gateway"),
    "run": ("services.launcher", "start the whole stack on 127.0.0.1 and send a demo request"),
    "generate": ("services.gateway.client", "send one request to a gateway"),
    "bench": ("bench.cli", "end-to-end and component benchmarks"),
    "ray": ("services.ray_launcher", "start the pools and gateway as Ray actors"),
}


def main(argv: list[str] | None = None) -> int:
    from common.procs import die_with_parent_from_env

    die_with_parent_from_env()  # a child of ServiceProcess: first, bind its life to the parent
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        width = max(map(len, COMMANDS))
        lines = [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
        print("usage: epd <command> [options]\n\ncommands:\n" + "\n".join(lines))
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\nepd: unknown command {argv[0]!r}", file=sys.stderr)
            return 2
        return 0 if argv else 2
    name = argv[0]
    module = importlib.import_module(COMMANDS[name][0])
    parser = argparse.ArgumentParser(prog=f"epd {name}", description=COMMANDS[name][1])
    module.add_arguments(parser)
    args = parser.parse_args(argv[1:])
    try:
        return int(module.run(args) or 0)
    except (ValueError, OSError) as exc:  # bad settings, files, busy ports: one line, no trace
        print(f"epd {name}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
