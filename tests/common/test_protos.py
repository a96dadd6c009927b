"""The generated gRPC code matches the .proto files."""

from __future__ import annotations

from common import protogen


def test_generated_code_is_fresh() -> None:
    assert protogen.proto_files(), "no .proto files found"
    assert protogen.stale_files() == [], "run `make proto`"


def test_configuration_reference_is_fresh() -> None:
    from services import config_doc

    assert config_doc.main(["--check"]) == 0, "run `python -m services.config_doc`"
