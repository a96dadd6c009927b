"""The Kubernetes manifests: every kustomize target renders, every core object passes strict
schema validation for Kubernetes 1.32, CRD objects (ServiceMonitor) are well formed, and the
cross-references that a typo would silently break still hold (selectors, ports, names). The
lifecycle agrees with the services: several gateway replicas with an HPA and a PDB, workers
registering with every gateway through a headless Service, readiness and liveness probes on the
health service names the servers answer, and preStop + drain timeout within each pod's grace
period."""

from __future__ import annotations

import functools
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from common.drain import READINESS

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
KUBECTL = Path(sys.executable).parent / "kubectl"
K8S_VERSION = "1.32.0"
TARGETS = ("base", "overlays/dev", "overlays/prod")
NAMESPACES = {"overlays/dev": "epd-dev", "overlays/prod": "epd-prod"}
ROLES = ("gateway", "encoder", "language")
WORKERS = ("encoder", "language")
CRD_KINDS = {"ServiceMonitor": "monitoring.coreos.com/v1"}
HPA_METRICS = {
    "epd-encoder": "epd_encoder_queue_depth",
    "epd-language": "epd_language_num_waiting_reqs",
}
REGISTRY_SERVICE = "epd-gateway-registry"  # headless: every gateway pod's registry port
STOP_MARGIN_S = 5  # grace period left after preStop + drain timeout, to stop and exit
UID = 10001
GPU = "nvidia.com/gpu"
RDMA = "rdma/hca_shared_devices_a"
VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")

Obj = dict[str, Any]


@functools.cache
def render(target: str) -> tuple[Obj, ...]:
    """``kubectl kustomize`` output of ``deploy/k8s/<target>`` as a tuple of objects."""
    proc = subprocess.run(
        [str(KUBECTL), "kustomize", str(K8S / target)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, f"kustomize {target} failed:\n{proc.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(proc.stdout) if doc)


@pytest.fixture(params=TARGETS)
def objs(request: pytest.FixtureRequest) -> tuple[Obj, ...]:
    return render(request.param)


def of_kind(objs: tuple[Obj, ...], kind: str) -> dict[str, Obj]:
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == kind}


def pod_spec(deployment: Obj) -> Obj:
    return deployment["spec"]["template"]["spec"]


def pod_labels(deployment: Obj) -> dict[str, str]:
    return deployment["spec"]["template"]["metadata"]["labels"]


def all_containers(spec: Obj) -> list[Obj]:
    return spec.get("initContainers", []) + spec["containers"]


def main_container(deployment: Obj) -> Obj:
    (container,) = pod_spec(deployment)["containers"]
    return container


def selects(selector: Obj, labels: dict[str, str]) -> bool:
    """A label selector (matchLabels + matchExpressions) applied to ``labels``."""
    if not selector.get("matchLabels") and not selector.get("matchExpressions"):
        return False  # an empty selector would select everything: never what we mean
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {
            "In": labels.get(key) in values,
            "NotIn": labels.get(key) not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def selected_deployments(objs: tuple[Obj, ...], selector: Obj) -> list[str]:
    return [
        name for name, d in of_kind(objs, "Deployment").items() if selects(selector, pod_labels(d))
    ]


def container_ports(container: Obj) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container.get("ports", [])}


def port_declared(port: int | str, container: Obj) -> bool:
    ports = container_ports(container)
    return port in ports if isinstance(port, str) else port in ports.values()


def arg_value(container: Obj, flag: str) -> str:
    values = [a.split("=", 1)[1] for a in container.get("args", []) if a.startswith(flag + "=")]
    assert len(values) == 1, f"{container['name']}: expected one {flag}=..., got {values}"
    return values[0]


def env_names(container: Obj, configmaps: dict[str, Obj]) -> dict[str, str | None]:
    """Variables the container sees: env entries (value or None when from a reference) and
    the keys of ConfigMaps it takes with envFrom."""
    names: dict[str, str | None] = {}
    for ref in container.get("envFrom", []):
        names.update(configmaps[ref["configMapRef"]["name"]].get("data", {}))
    for var in container.get("env", []):
        names[var["name"]] = var.get("value")
    return names


def config_value(objs: tuple[Obj, ...], container: Obj, key: str) -> str:
    value = env_names(container, of_kind(objs, "ConfigMap")).get(key)
    assert value is not None, f"{container['name']}: {key} not set"
    return value


def field_ref(container: Obj, name: str) -> str | None:
    for var in container.get("env", []):
        if var["name"] == name:
            return var.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
    return None


def test_renders_every_role(objs: tuple[Obj, ...]) -> None:
    names = {f"epd-{role}" for role in ROLES}
    assert set(of_kind(objs, "Deployment")) == names
    assert set(of_kind(objs, "Service")) == names | {REGISTRY_SERVICE}
    assert set(of_kind(objs, "PodDisruptionBudget")) == names
    assert set(of_kind(objs, "ServiceMonitor")) == names
    assert set(of_kind(objs, "HorizontalPodAutoscaler")) == names
    prefixes = {name.rsplit("-", 1)[0] for name in of_kind(objs, "ConfigMap")}
    assert prefixes == {f"epd-{r}-config" for r in (*ROLES, "transfer", "internal")}
    policies = {"epd-default-deny", *names}
    assert set(of_kind(objs, "NetworkPolicy")) == policies


@pytest.mark.parametrize("target", TARGETS)
def test_namespaces(target: str) -> None:
    objs = render(target)
    namespaced = [o for o in objs if o["kind"] != "Namespace"]
    found = {o["metadata"].get("namespace") for o in namespaced}
    if target == "base":
        assert found == {None}, "the base must stay namespace-agnostic"
        assert not of_kind(objs, "Namespace")
    else:
        assert found == {NAMESPACES[target]}
        assert set(of_kind(objs, "Namespace")) == {NAMESPACES[target]}


def test_core_objects_validate_strict(objs: tuple[Obj, ...]) -> None:
    errors = []
    for obj in objs:
        if obj["kind"] in CRD_KINDS:
            continue
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"{obj['kind']}/{obj['metadata']['name']}: {exc.message} at {exc.path}")
    assert not errors, "\n".join(errors)


def test_crd_objects_are_well_formed(objs: tuple[Obj, ...]) -> None:
    """kubernetes-validate has no schema for CRDs: check the ServiceMonitor fields we use."""
    duration = re.compile(r"^[0-9]+(ms|s|m|h)$")
    monitors = of_kind(objs, "ServiceMonitor")
    assert monitors
    for name, sm in monitors.items():
        assert sm["apiVersion"] == CRD_KINDS["ServiceMonitor"], name
        assert set(sm) == {"apiVersion", "kind", "metadata", "spec"}, name
        spec = sm["spec"]
        assert set(spec) <= {"selector", "endpoints", "namespaceSelector", "jobLabel"}, name
        labels = spec["selector"]["matchLabels"]
        assert labels and all(isinstance(v, str) for v in labels.values()), name
        assert spec["endpoints"], name
        for ep in spec["endpoints"]:
            assert set(ep) <= {"port", "path", "scheme", "interval", "scrapeTimeout"}, name
            assert isinstance(ep["port"], str), f"{name}: endpoints select a named Service port"
            assert ep.get("path", "/metrics").startswith("/"), name
            assert ep.get("scheme", "http") in ("http", "https"), name
            for key in ("interval", "scrapeTimeout"):
                assert duration.match(ep.get(key, "30s")), f"{name}: bad {key}"


def test_service_selectors_and_target_ports(objs: tuple[Obj, ...]) -> None:
    deployments = of_kind(objs, "Deployment")
    for name, svc in of_kind(objs, "Service").items():
        selected = selected_deployments(objs, {"matchLabels": svc["spec"]["selector"]})
        assert len(selected) == 1, f"Service {name} selects {selected}"
        container = main_container(deployments[selected[0]])
        for port in svc["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            assert port_declared(target, container), f"Service {name}: no container port {target}"
            if isinstance(target, str):
                assert port["name"] == target, f"Service {name}: port names differ"
    public = of_kind(objs, "Service")["epd-gateway"]["spec"]
    assert public.get("type", "ClusterIP") == "ClusterIP"
    assert "registry" not in {p["name"] for p in public["ports"]}, "workers use the headless one"
    for name in (*(f"epd-{role}" for role in WORKERS), REGISTRY_SERVICE):
        assert of_kind(objs, "Service")[name]["spec"]["clusterIP"] == "None", name


def test_probes_hit_the_health_port(objs: tuple[Obj, ...]) -> None:
    """Probes use the plaintext health-only port: kubelet gRPC probes speak neither TLS nor
    bearer tokens, so they must not depend on the main port's credentials. The gateway's
    readiness is its HTTP API's /health (open without a key; HTTPS when the gateway has TLS)."""
    for name, deployment in of_kind(objs, "Deployment").items():
        container = main_container(deployment)
        grpc_port = int(arg_value(container, "--port"))
        health_port = int(arg_value(container, "--health-port"))
        assert container_ports(container)["grpc"] == grpc_port, name
        assert container_ports(container)["health"] == health_port != grpc_port, name
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = container[kind]
            if name == "epd-gateway" and kind == "readinessProbe":
                assert set(probe) & {"grpc", "httpGet", "tcpSocket", "exec"} == {"httpGet"}
                http_port = int(arg_value(container, "--http-port"))
                assert container_ports(container)["http"] == http_port
                assert probe["httpGet"]["port"] == "http" and probe["httpGet"]["path"] == "/health"
                configmaps = of_kind(objs, "ConfigMap")
                tls = "EPD_GATEWAY_TLS_CERT_FILE" in env_names(container, configmaps)
                assert probe["httpGet"].get("scheme", "HTTP") == ("HTTPS" if tls else "HTTP")
                continue
            assert set(probe) & {"grpc", "httpGet", "tcpSocket", "exec"} == {"grpc"}, (name, kind)
            assert probe["grpc"]["port"] == health_port, f"{name} {kind} misses the health port"
        # readiness turns NOT_SERVING when a drain starts (the gateway's /health follows it);
        # liveness ("") stays SERVING through it
        if name != "epd-gateway":
            assert container["readinessProbe"]["grpc"]["service"] == READINESS, name
        for kind in ("startupProbe", "livenessProbe"):
            assert container[kind]["grpc"].get("service", "") == "", (name, kind)
        startup = container["startupProbe"]
        budget_s = startup["periodSeconds"] * startup["failureThreshold"]
        assert budget_s >= (300 if name != "epd-gateway" else 30), f"{name}: startup too short"


def test_hpas_target_deployments(objs: tuple[Obj, ...]) -> None:
    deployments = of_kind(objs, "Deployment")
    adapter = yaml.safe_load((K8S / "prometheus-adapter" / "values.yaml").read_text())
    served = {rule["name"]["as"] for rule in adapter["rules"]["custom"]}
    for name, hpa in of_kind(objs, "HorizontalPodAutoscaler").items():
        ref = hpa["spec"]["scaleTargetRef"]
        assert (ref["apiVersion"], ref["kind"]) == ("apps/v1", "Deployment"), name
        assert ref["name"] == name and name in deployments, f"HPA {name} targets {ref['name']}"
        deployment = deployments[ref["name"]]
        assert "replicas" not in deployment["spec"], f"{ref['name']}: the HPA owns replicas"
        assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"], name
        *queue, resource = hpa["spec"]["metrics"]
        if name == "epd-gateway":  # a stream relay: CPU is its load
            assert queue == [], name
            assert hpa["spec"]["minReplicas"] >= 2, "one gateway would be a single point"
        else:
            (pods,) = queue
            assert pods["type"] == "Pods", f"{name}: the queue metric comes first"
            assert pods["pods"]["metric"]["name"] == HPA_METRICS[name]
            assert pods["pods"]["target"]["type"] == "AverageValue"
            assert HPA_METRICS[name] in served, f"prometheus-adapter does not serve {name}'s metric"
        assert resource["type"] == "Resource" and resource["resource"]["name"] == "cpu", name
        assert resource["resource"]["target"]["type"] == "Utilization", name
        for container in pod_spec(deployment)["containers"]:
            assert "cpu" in container["resources"]["requests"], "CPU utilization needs requests"


def test_pdb_selectors_match(objs: tuple[Obj, ...]) -> None:
    for name, pdb in of_kind(objs, "PodDisruptionBudget").items():
        assert selected_deployments(objs, pdb["spec"]["selector"]) == [name], name
        assert len({"minAvailable", "maxUnavailable"} & set(pdb["spec"])) == 1, name
    gateway = of_kind(objs, "PodDisruptionBudget")["epd-gateway"]["spec"]
    assert gateway["minAvailable"] == 1, "a drain or an eviction always leaves one gateway"
    assert of_kind(objs, "HorizontalPodAutoscaler")["epd-gateway"]["spec"]["minReplicas"] > 1


def test_drain_fits_the_grace_period(objs: tuple[Obj, ...]) -> None:
    """Every role: preStop sleeps a few seconds, then SIGTERM starts the drain; preStop, the
    drain timeout and a margin to stop fit in terminationGracePeriodSeconds, so the kubelet's
    SIGKILL never cuts a drain short."""
    for name, deployment in of_kind(objs, "Deployment").items():
        container = main_container(deployment)
        command = container["lifecycle"]["preStop"]["exec"]["command"]
        assert command[0] == "sleep" and len(command) == 2, (name, command)
        pre_stop_s = int(command[1])
        assert 0 < pre_stop_s <= 10, name
        role = name.removeprefix("epd-").upper()
        drain_s = float(config_value(objs, container, f"EPD_{role}_DRAIN_TIMEOUT_S"))
        grace_s = pod_spec(deployment)["terminationGracePeriodSeconds"]
        assert drain_s >= 30, f"{name}: a drain of {drain_s} s cuts long generations"
        assert pre_stop_s + drain_s + STOP_MARGIN_S <= grace_s, (name, pre_stop_s, drain_s, grace_s)


def test_config_references_resolve(objs: tuple[Obj, ...]) -> None:
    configmaps = of_kind(objs, "ConfigMap")
    claims = of_kind(objs, "PersistentVolumeClaim")
    for name, deployment in of_kind(objs, "Deployment").items():
        spec = pod_spec(deployment)
        volumes = {v["name"]: v for v in spec["volumes"]}
        for volume in volumes.values():
            sources = set(volume) - {"name"}
            assert len(sources) == 1, f"{name}: volume {volume['name']} has sources {sources}"
            if "persistentVolumeClaim" in volume:
                claim = volume["persistentVolumeClaim"]["claimName"]
                assert claim in claims, f"{name}: PVC {claim} is not in the render"
        for container in all_containers(spec):
            for ref in container.get("envFrom", []):
                assert ref["configMapRef"]["name"] in configmaps, f"{name}: {ref}"
            known = env_names(container, configmaps)
            for text in container.get("command", []) + container.get("args", []):
                for var in VAR_REF.findall(text):
                    assert var in known, f"{name}/{container['name']}: $({var}) is undefined"
            for mount in container.get("volumeMounts", []):
                assert mount["name"] in volumes, f"{name}: no volume {mount['name']}"


def test_servicemonitors_match_services(objs: tuple[Obj, ...]) -> None:
    services = of_kind(objs, "Service")
    unscraped = {
        n
        for n, svc in services.items()
        if "metrics" not in {p["name"] for p in svc["spec"]["ports"]}
    }
    assert unscraped == {REGISTRY_SERVICE}, "only the registry's discovery Service has no metrics"
    services = {n: svc for n, svc in services.items() if n not in unscraped}
    scraped = set()
    for name, sm in of_kind(objs, "ServiceMonitor").items():
        matched = [
            svc_name
            for svc_name, svc in services.items()
            if selects(sm["spec"]["selector"], svc["metadata"].get("labels", {}))
        ]
        assert matched, f"ServiceMonitor {name} selects no Service"
        for svc_name in matched:
            port_names = {p["name"] for p in services[svc_name]["spec"]["ports"]}
            for ep in sm["spec"]["endpoints"]:
                assert ep["port"] in port_names, f"{name}: {svc_name} has no port {ep['port']}"
            scraped.add(svc_name)
    assert scraped == set(services), f"Services without metrics scraping: {set(services) - scraped}"
    for deployment in of_kind(objs, "Deployment").values():
        assert "metrics" in container_ports(main_container(deployment))


def test_workers_reach_gateway_and_peers(objs: tuple[Obj, ...]) -> None:
    deployments = of_kind(objs, "Deployment")
    services = of_kind(objs, "Service")
    gateway_metrics = int(arg_value(main_container(deployments["epd-gateway"]), "--metrics-port"))
    assert container_ports(main_container(deployments["epd-gateway"]))["metrics"] == gateway_metrics
    gateway = main_container(deployments["epd-gateway"])
    registry_port = int(arg_value(gateway, "--registry-port"))
    assert container_ports(gateway)["registry"] == registry_port
    assert registry_port != int(arg_value(gateway, "--port"))
    public = {p["name"]: p for p in services["epd-gateway"]["spec"]["ports"]}
    assert public["http"]["targetPort"] == "http"  # the HTTP API is exposed beside gRPC
    assert container_ports(gateway)["http"] == int(arg_value(gateway, "--http-port"))
    for role in WORKERS:
        container = main_container(deployments[f"epd-{role}"])
        host, port = arg_value(container, "--gateway").rsplit(":", 1)
        assert host in services, f"{role}: --gateway names no Service"
        registry = services[host]["spec"]
        by_port = {p["port"]: p for p in registry["ports"]}
        assert by_port[int(port)]["targetPort"] == "registry", f"{role}: not the registry port"
        # one DNS record per gateway pod, published before it is ready: workers reach every one
        assert registry["clusterIP"] == "None" and registry["publishNotReadyAddresses"], role
        assert selected_deployments(objs, {"matchLabels": registry["selector"]}) == ["epd-gateway"]
        assert arg_value(container, "--advertise-host") == "$(POD_IP)"
        assert field_ref(container, "POD_IP") == "status.podIP"
        assert field_ref(container, "EPD_TRANSFER_HOST") == "status.podIP"
        control = int(config_value(objs, container, "EPD_TRANSFER_CONTROL_PORT"))
        assert container_ports(container)["transfer-ctl"] == control
        assert container_ports(container)["metrics"] == int(arg_value(container, "--metrics-port"))
        assert config_value(objs, container, "EPD_TRANSFER_TRANSPORT") == "mooncake"


def test_security_context(objs: tuple[Obj, ...]) -> None:
    prod = any(o["kind"] == "Namespace" and o["metadata"]["name"] == "epd-prod" for o in objs)
    for name, deployment in of_kind(objs, "Deployment").items():
        spec = pod_spec(deployment)
        pod = spec["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["runAsUser"] == UID, name
        assert pod["seccompProfile"]["type"] == "RuntimeDefault", name
        assert spec.get("automountServiceAccountToken") is False, name
        assert not spec.get("hostNetwork"), f"{name}: hostNetwork is documented, not applied"
        for container in all_containers(spec):
            ctx = container["securityContext"]
            where = f"{name}/{container['name']}"
            assert ctx["allowPrivilegeEscalation"] is False, where
            assert ctx["readOnlyRootFilesystem"] is True, where
            assert ctx["capabilities"]["drop"] == ["ALL"], where
            added = set(ctx["capabilities"].get("add", []))
            worker = name != "epd-gateway" and container in spec["containers"]
            assert added == ({"IPC_LOCK"} if prod and worker else set()), where
            mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
            assert not mounts["/tmp"].get("readOnly"), f"{where}: /tmp must be writable"
            assert not mounts["/cache"].get("readOnly"), f"{where}: /cache must be writable"


def test_dev_overlay() -> None:
    objs = render("overlays/dev")
    deployments = of_kind(objs, "Deployment")
    hpas = of_kind(objs, "HorizontalPodAutoscaler")
    assert hpas["epd-gateway"]["spec"]["minReplicas"] == 2  # several gateways, as in prod
    for role in WORKERS:
        assert hpas[f"epd-{role}"]["spec"]["minReplicas"] == 1
    labels = of_kind(objs, "Namespace")["epd-dev"]["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "restricted"
    for role in WORKERS:
        spec = pod_spec(deployments[f"epd-{role}"])
        container = main_container(deployments[f"epd-{role}"])
        (init,) = spec["initContainers"]
        assert init["args"][0] == "make-tiny-model"
        assert "--arch=qwen2_5_vl" in init["args"] and "--size=demo" in init["args"]
        model_path = config_value(objs, container, f"EPD_{role.upper()}_MODEL_PATH")
        assert arg_value(init, "--out") == model_path == "/models/demo"
        assert arg_value(container, "--model-path") == f"$(EPD_{role.upper()}_MODEL_PATH)"
        init_mounts = {m["mountPath"]: m for m in init["volumeMounts"]}
        assert init_mounts["/models"]["name"] == "models"
        assert not init_mounts["/models"].get("readOnly")
        assert "emptyDir" in {v["name"]: v for v in spec["volumes"]}["models"]
        assert config_value(objs, container, "EPD_TRANSFER_PROTOCOL") == "tcp"
        assert config_value(objs, container, f"EPD_{role.upper()}_DEVICE") == "cpu"
    for deployment in deployments.values():
        for container in all_containers(pod_spec(deployment)):
            assert container["image"] == "epd-serve:dev"
            assert GPU not in container["resources"].get("limits", {})


def test_prod_overlay() -> None:
    objs = render("overlays/prod")
    deployments = of_kind(objs, "Deployment")
    claim = of_kind(objs, "PersistentVolumeClaim")["epd-models"]
    assert claim["spec"]["accessModes"] == ["ReadOnlyMany"]
    for hpa in of_kind(objs, "HorizontalPodAutoscaler").values():
        assert hpa["spec"]["minReplicas"] >= 2
    for role in WORKERS:
        deployment = deployments[f"epd-{role}"]
        spec = pod_spec(deployment)
        container = main_container(deployment)
        assert "initContainers" not in spec
        assert spec["terminationGracePeriodSeconds"] == 120  # long generations drain longer
        assert float(config_value(objs, container, f"EPD_{role.upper()}_DRAIN_TIMEOUT_S")) > 60
        resources = container["resources"]
        for name in (GPU, RDMA):
            assert resources["requests"][name] == resources["limits"][name] == "1", (role, name)
        assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
        assert {"key": GPU, "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
        models = {v["name"]: v for v in spec["volumes"]}["models"]
        assert models["persistentVolumeClaim"] == {"claimName": "epd-models", "readOnly": True}
        model_path = config_value(objs, container, f"EPD_{role.upper()}_MODEL_PATH")
        assert model_path.startswith("/models/") and model_path != "/models/demo"
        assert config_value(objs, container, "EPD_TRANSFER_PROTOCOL") == "rdma"
        assert config_value(objs, container, "EPD_TRANSFER_DEVICE_NAMES") == "mlx5_0"
        assert config_value(objs, container, f"EPD_{role.upper()}_DEVICE") == "cuda"
        annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        assert annotations["k8s.v1.cni.cncf.io/networks"] == "epd-rdma"
    language = main_container(deployments["epd-language"])
    assert config_value(objs, language, "EPD_LANGUAGE_DTYPE") == "bfloat16"
    for deployment in deployments.values():
        for container in all_containers(pod_spec(deployment)):
            assert container["image"].endswith("/epd-serve:0.1.0-cuda")
    assert GPU not in main_container(deployments["epd-gateway"])["resources"]["limits"]
