"""Protobuf/gRPC code generation for ``protos/epd/v1``.

``python -m common.protogen`` regenerates the Python modules next to the ``.proto`` files;
``--check`` regenerates into a temporary directory and exits non-zero when the tree's generated
code differs (stale or missing), which the test suite uses.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = REPO_ROOT / "protos" / "epd" / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_files() -> list[Path]:
    return sorted(PROTO_DIR.glob("*.proto"))


def generate(out_root: Path) -> list[Path]:
    """Run protoc for every proto file; generated modules land under ``out_root``."""
    import grpc_tools
    from grpc_tools import protoc  # imported lazily: only codegen needs it

    include = Path(grpc_tools.__file__).parent / "_proto"
    files = [str(p.relative_to(REPO_ROOT)) for p in proto_files()]
    if not files:
        return []
    args = [
        "protoc",
        f"-I{REPO_ROOT}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *files,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed for {files}")
    rel = PROTO_DIR.relative_to(REPO_ROOT)
    return sorted(p for p in (out_root / rel).iterdir() if p.name.endswith(GENERATED_SUFFIXES))


def stale_files() -> list[str]:
    """Names of generated modules that are missing or differ from a fresh generation."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        stale = [p.name for p in fresh if not (PROTO_DIR / p.name).exists()]
        stale += [
            p.name
            for p in fresh
            if (PROTO_DIR / p.name).exists()
            and not filecmp.cmp(p, PROTO_DIR / p.name, shallow=False)
        ]
        fresh_names = {p.name for p in fresh}
        stale += [
            p.name
            for p in PROTO_DIR.iterdir()
            if p.name.endswith(GENERATED_SUFFIXES) and p.name not in fresh_names
        ]
    return sorted(stale)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if generated code is stale")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        if stale:
            print("stale generated code (run `make proto`): " + ", ".join(stale))
            return 1
        return 0
    if stale_files():
        generate(REPO_ROOT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
