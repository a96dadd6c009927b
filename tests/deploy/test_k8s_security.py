"""The security objects of the Kubernetes manifests, checked by what they mean.

NetworkPolicies are evaluated (the subset of the semantics they use: pod and namespace
selectors, named and numbered ports, port ranges) against the rendered pods, for every pair of
source and destination port that matters: only the gateway reaches workers' gRPC, only workers
reach the registry, only the other pool reaches a pool's transfer ports, metrics only from the
monitoring namespace. Secrets: every ``*_FILE`` setting names a key of a mounted Secret; the
repository's Secret files are placeholders that the services refuse to start with.
"""

from __future__ import annotations

import base64
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from common.secret_files import read_secret_lines
from tests.deploy.test_k8s import (
    K8S,
    KUBECTL,
    TARGETS,
    WORKERS,
    Obj,
    all_containers,
    container_ports,
    env_names,
    main_container,
    of_kind,
    pod_labels,
    pod_spec,
    render,
    selects,
)

MONITORING = "monitoring"
MOONCAKE_SAMPLE = 8
# Starts argv[1] Mooncake engines and prints the TCP ports this process listens on.
MOONCAKE_PORTS = """
import os, subprocess, sys
from mooncake.engine import TransferEngine
engines = [TransferEngine() for _ in range(int(sys.argv[1]))]
for engine in engines:
    engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout
mine = [line.split()[3] for line in out.splitlines() if f"pid={os.getpid()}," in line]
print(" ".join(address.rsplit(":", 1)[1] for address in mine))
"""


@dataclass(frozen=True)
class Source:
    """Where a connection comes from: a pod of a Deployment in the namespace, or any pod of
    another namespace (``deployment`` None)."""

    deployment: str | None = None
    namespace: str = "same"


OUTSIDE = Source(namespace="elsewhere")
MONITOR = Source(namespace=MONITORING)


def _peer_matches(peer: Obj, source: Source, labels: dict[str, str] | None) -> bool:
    """One ``from`` entry. NOTE: a namespaceSelector here only ever names another namespace
    (monitoring), and no entry combines it with a podSelector or uses an ipBlock."""
    assert "ipBlock" not in peer, "ipBlock peers are not evaluated here"
    if "namespaceSelector" in peer:
        assert "podSelector" not in peer, "namespace + pod selectors are not evaluated here"
        ns_labels = {"kubernetes.io/metadata.name": source.namespace}
        return source.namespace != "same" and selects(peer["namespaceSelector"], ns_labels)
    in_namespace = source.namespace == "same" and labels is not None
    return in_namespace and selects(peer["podSelector"], labels)


def _port_matches(rule_port: Obj, port: int, dst_ports: dict[str, int]) -> bool:
    value = rule_port["port"]
    if isinstance(value, str):
        return dst_ports.get(value) == port
    return value <= port <= rule_port.get("endPort", value)


def allowed(objs: tuple[Obj, ...], source: Source, destination: str, port: int) -> bool:
    """Whether the NetworkPolicies admit a TCP connection from ``source`` to ``port`` of a pod
    of the Deployment ``destination``."""
    deployments = of_kind(objs, "Deployment")
    dst_labels = pod_labels(deployments[destination])
    dst_ports = container_ports(main_container(deployments[destination]))
    src_labels = pod_labels(deployments[source.deployment]) if source.deployment else None
    policies = [
        p
        for p in of_kind(objs, "NetworkPolicy").values()
        if selects(p["spec"]["podSelector"], dst_labels)
    ]
    assert policies, f"{destination} is not isolated"
    for policy in policies:
        for rule in policy["spec"].get("ingress", []):
            peers = rule.get("from")
            if peers is not None and not any(_peer_matches(p, source, src_labels) for p in peers):
                continue
            ports = rule.get("ports")
            if ports is None or any(_port_matches(p, port, dst_ports) for p in ports):
                return True
    return False


@pytest.fixture(params=TARGETS)
def objs(request: pytest.FixtureRequest) -> tuple[Obj, ...]:
    return render(request.param)


def ports_of(objs: tuple[Obj, ...], deployment: str) -> dict[str, int]:
    return container_ports(main_container(of_kind(objs, "Deployment")[deployment]))


def test_every_epd_pod_is_isolated(objs: tuple[Obj, ...]) -> None:
    deny = of_kind(objs, "NetworkPolicy")["epd-default-deny"]["spec"]
    assert deny["policyTypes"] == ["Ingress"] and not deny.get("ingress")
    for deployment in of_kind(objs, "Deployment").values():
        assert selects(deny["podSelector"], pod_labels(deployment))


def test_policy_ports_exist_on_the_pods_they_select(objs: tuple[Obj, ...]) -> None:
    deployments = of_kind(objs, "Deployment")
    for name, policy in of_kind(objs, "NetworkPolicy").items():
        chosen = policy["spec"]["podSelector"]
        selected = [d for d in deployments.values() if selects(chosen, pod_labels(d))]
        assert selected, f"{name} selects no pod"
        for rule in policy["spec"].get("ingress", []):
            assert rule.get("ports"), f"{name}: a rule without ports opens every port"
            for port in rule["ports"]:
                assert port["protocol"] == "TCP"
                if isinstance(port["port"], str):
                    for deployment in selected:
                        ports = container_ports(main_container(deployment))
                        assert port["port"] in ports, f"{name}: no port {port['port']}"


def test_only_the_gateway_reaches_the_workers_grpc(objs: tuple[Obj, ...]) -> None:
    for role in WORKERS:
        grpc = ports_of(objs, f"epd-{role}")["grpc"]
        assert allowed(objs, Source("epd-gateway"), f"epd-{role}", grpc)
        for source in (Source("epd-encoder"), Source("epd-language"), OUTSIDE, MONITOR):
            assert not allowed(objs, source, f"epd-{role}", grpc), (source, role)


def test_only_workers_reach_the_registry_and_anyone_the_public_api(objs: tuple[Obj, ...]) -> None:
    ports = ports_of(objs, "epd-gateway")
    for role in WORKERS:
        assert allowed(objs, Source(f"epd-{role}"), "epd-gateway", ports["registry"])
    for source in (Source("epd-gateway"), OUTSIDE, MONITOR):
        assert not allowed(objs, source, "epd-gateway", ports["registry"]), source
    for source in (OUTSIDE, Source("epd-encoder"), MONITOR):
        assert allowed(objs, source, "epd-gateway", ports["grpc"])
        assert allowed(objs, source, "epd-gateway", ports["http"])


def mooncake_range(objs: tuple[Obj, ...], role: str) -> tuple[int, int]:
    policy = of_kind(objs, "NetworkPolicy")[f"epd-{role}"]
    ranges = [
        (p["port"], p["endPort"])
        for rule in policy["spec"]["ingress"]
        for p in rule["ports"]
        if "endPort" in p
    ]
    assert len(ranges) == 1, ranges
    return ranges[0]


def test_only_the_other_pool_reaches_the_transfer_ports(objs: tuple[Obj, ...]) -> None:
    for role, peer in (("encoder", "language"), ("language", "encoder")):
        control = ports_of(objs, f"epd-{role}")["transfer-ctl"]
        low, high = mooncake_range(objs, role)
        for port in (control, low, (low + high) // 2, high):
            assert allowed(objs, Source(f"epd-{peer}"), f"epd-{role}", port), (role, port)
            for source in (Source(f"epd-{role}"), Source("epd-gateway"), OUTSIDE, MONITOR):
                assert not allowed(objs, source, f"epd-{role}", port), (source, role, port)
        # the range admits no other port of the pod (its gRPC, metrics, health)
        others = {n: p for n, p in ports_of(objs, f"epd-{role}").items() if n != "transfer-ctl"}
        assert not any(low <= p <= high for p in others.values()), others


def test_metrics_only_from_the_monitoring_namespace(objs: tuple[Obj, ...]) -> None:
    for name in of_kind(objs, "Deployment"):
        metrics = ports_of(objs, name)["metrics"]
        assert allowed(objs, MONITOR, name, metrics), name
        sources = [OUTSIDE, *(Source(d) for d in of_kind(objs, "Deployment") if d != name)]
        for source in sources:
            assert not allowed(objs, source, name, metrics), (source, name)


def test_no_rule_opens_the_health_port(objs: tuple[Obj, ...]) -> None:
    """Probes come from the pod's node, which NetworkPolicies always admit."""
    for name in of_kind(objs, "Deployment"):
        health = ports_of(objs, name)["health"]
        for source in (OUTSIDE, MONITOR, *(Source(d) for d in of_kind(objs, "Deployment"))):
            assert not allowed(objs, source, name, health), (source, name)


def test_the_mooncake_range_covers_the_ports_mooncake_picks() -> None:
    """Mooncake opens its handshake and tcp data ports itself: the range in the policies must
    hold what the installed engine picks (a sample of engines in this process)."""
    pytest.importorskip("mooncake.engine")
    low, high = mooncake_range(render("base"), "language")
    env = {**os.environ, "MC_LOG_LEVEL": "ERROR", "GLOG_minloglevel": "3"}
    proc = subprocess.run(
        [sys.executable, "-c", MOONCAKE_PORTS, str(MOONCAKE_SAMPLE)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    ports = [int(p) for p in proc.stdout.split()]
    assert len(ports) >= MOONCAKE_SAMPLE  # a handshake port per engine, and tcp data ports
    assert all(low <= p <= high for p in ports), (low, high, sorted(ports))


def secret_mounts(objs: tuple[Obj, ...], deployment: Obj, container: Obj) -> dict[str, Obj]:
    """mountPath -> the Secret mounted there (whole directories only)."""
    secrets = of_kind(objs, "Secret")
    volumes = {v["name"]: v for v in pod_spec(deployment)["volumes"]}
    found = {}
    for mount in container.get("volumeMounts", []):
        volume = volumes[mount["name"]]
        if "secret" not in volume:
            continue
        assert "subPath" not in mount, f"{mount['name']}: subPath mounts never see updates"
        assert mount.get("readOnly") is True, mount["name"]
        name = volume["secret"]["secretName"]
        assert name in secrets, f"Secret {name} is not in the render"
        assert volume["secret"].get("defaultMode", 0o644) & 0o007 == 0, "world-readable secret"
        found[mount["mountPath"]] = secrets[name]
    return found


def file_settings(objs: tuple[Obj, ...], deployment: Obj) -> dict[str, tuple[str, Obj]]:
    """Every ``*_FILE`` setting of the main container -> (path, the Secret holding it)."""
    container = main_container(deployment)
    mounts = secret_mounts(objs, deployment, container)
    settings = {}
    for key, value in env_names(container, of_kind(objs, "ConfigMap")).items():
        if not key.endswith("_FILE") or not value:
            continue
        directory, file_name = value.rsplit("/", 1)
        assert directory in mounts, f"{key}={value}: no Secret mounted at {directory}"
        secret = mounts[directory]
        assert file_name in secret.get("data", {}), f"{key}: no key {file_name} in the Secret"
        settings[key] = (value, secret)
    return settings


def test_secret_references_resolve(objs: tuple[Obj, ...]) -> None:
    for deployment in of_kind(objs, "Deployment").values():
        for container in all_containers(pod_spec(deployment)):
            secret_mounts(objs, deployment, container)
        file_settings(objs, deployment)


def test_dev_runs_without_credentials() -> None:
    objs = render("overlays/dev")
    assert not of_kind(objs, "Secret")
    for deployment in of_kind(objs, "Deployment").values():
        assert file_settings(objs, deployment) == {}


GATEWAY_FILES = {
    "EPD_GATEWAY_TLS_CERT_FILE",
    "EPD_GATEWAY_TLS_KEY_FILE",
    "EPD_GATEWAY_API_KEYS_FILE",
    "EPD_INTERNAL_TOKEN_FILE",
}
WORKER_FILES = {"EPD_INTERNAL_TOKEN_FILE", "EPD_TRANSFER_SECRET_FILE"}
MTLS_FILES = {
    "EPD_INTERNAL_TLS_CERT_FILE",
    "EPD_INTERNAL_TLS_KEY_FILE",
    "EPD_INTERNAL_TLS_CA_FILE",
}


def check_credentials(objs: tuple[Obj, ...], extra: set[str] = frozenset()) -> None:
    deployments = of_kind(objs, "Deployment")
    gateway = file_settings(objs, deployments["epd-gateway"])
    assert set(gateway) == GATEWAY_FILES | extra
    tls = gateway["EPD_GATEWAY_TLS_CERT_FILE"][1]
    assert tls["type"] == "kubernetes.io/tls"
    for role in WORKERS:
        assert set(file_settings(objs, deployments[f"epd-{role}"])) == WORKER_FILES | extra
    tokens = {
        file_settings(objs, deployments[name])["EPD_INTERNAL_TOKEN_FILE"][1]["metadata"]["name"]
        for name in deployments
    }
    assert len(tokens) == 1, "every role must mount the same internal token"


def test_prod_turns_every_credential_on() -> None:
    check_credentials(render("overlays/prod"))


def test_the_repository_ships_only_placeholders_that_services_refuse(tmp_path: Path) -> None:
    objs = render("overlays/prod")
    secrets = of_kind(objs, "Secret")
    assert len(secrets) == 4
    for name, secret in secrets.items():
        for key, data in secret["data"].items():
            path = tmp_path / f"{name}-{key}"
            path.write_bytes(base64.b64decode(data))
            with pytest.raises(ValueError, match="REPLACE-ME placeholder"):
                read_secret_lines(path)


def render_with_mtls(tmp_path: Path) -> tuple[Obj, ...]:
    """``overlays/prod`` plus ``components/internal-mtls``, as an operator would combine them."""
    root = os.path.relpath(K8S, tmp_path)
    (tmp_path / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": [f"{root}/overlays/prod"],
                "components": [f"{root}/components/internal-mtls"],
            }
        )
    )
    proc = subprocess.run(
        [str(KUBECTL), "kustomize", "--load-restrictor=LoadRestrictionsNone", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return tuple(doc for doc in yaml.safe_load_all(proc.stdout) if doc)


def test_internal_mtls_component(tmp_path: Path) -> None:
    objs = render_with_mtls(tmp_path)
    check_credentials(objs, MTLS_FILES)
    for deployment in of_kind(objs, "Deployment").values():
        container = main_container(deployment)
        names = env_names(container, of_kind(objs, "ConfigMap"))
        assert names["EPD_INTERNAL_TLS_SERVER_NAME"] == "epd-internal"
        secret = file_settings(objs, deployment)["EPD_INTERNAL_TLS_CA_FILE"][1]
        assert set(secret["data"]) == {"tls.crt", "tls.key", "ca.crt"}
