"""The generated gRPC code matches the .proto files."""

from __future__ import annotations

from common import protogen


def test_generated_code_is_fresh() -> None:
    assert protogen.proto_files(), "no .proto files found"
    assert protogen.stale_files() == [], "run `make proto`"
