"""The Dockerfile agrees with the manifests and the setup rules (no Docker daemon needed)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "deploy" / "docker"
UID = 10001


def dockerfile() -> str:
    return (DOCKER / "Dockerfile").read_text()


def instructions(keyword: str) -> list[str]:
    return re.findall(rf"^{keyword}\s+(.+)$", dockerfile(), flags=re.MULTILINE)


def test_cpu_default_and_cuda_variant() -> None:
    stages = [line.split() for line in instructions("FROM")]
    names = {words[-1] for words in stages if len(words) == 3 and words[1].upper() == "AS"}
    assert {"base-cpu", "base-cuda", "image"} <= names
    assert "ARG VARIANT=cpu" in dockerfile()
    assert stages[-1][0] == "base-${VARIANT}", "the final stage builds on the chosen variant"


def test_installs_like_make_setup() -> None:
    text = dockerfile()
    assert "libibverbs1" in text
    torch = text.index('"torch==${TORCH_VERSION}"')
    assert torch < text.index("-r /opt/epd/requirements.txt"), "torch is installed first"
    assert "ARG TORCH_VERSION=2.13.0" in text
    assert "torch==2.13.0" in (REPO / "requirements.txt").read_text()
    assert "! pip show torchvision" in text
    installs = [line for line in text.splitlines() if "pip install" in line]
    assert not any("torchvision" in line for line in installs)
    assert "python -m common.protogen" in text, "the image must generate the gRPC code"


def test_ignores_generated_and_local_files() -> None:
    ignored = set((DOCKER / "Dockerfile.dockerignore").read_text().split())
    assert {".venv", ".git", "protos/epd/v1/*_pb2.py", "protos/epd/v1/*_pb2_grpc.py"} <= ignored


def test_user_matches_manifests() -> None:
    assert instructions("USER") == [f"{UID}:{UID}"]
    assert instructions("ENTRYPOINT") == ['["epd"]']
    base = REPO / "deploy" / "k8s" / "base"
    for role in ("gateway", "encoder", "language"):
        docs = yaml.safe_load_all((base / f"{role}.yaml").read_text())
        (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
        spec = deployment["spec"]["template"]["spec"]
        assert spec["securityContext"]["runAsUser"] == UID
        assert {c["image"] for c in spec["containers"]} == {"epd-serve"}
