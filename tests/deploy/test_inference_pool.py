"""deploy/k8s/overlays/inference-pool: cells (gateway, target and draft in one pod) behind an
InferencePool, scaled by KEDA on queue depth.

Kubernetes' own kinds are validated against its published schemas; the InferencePool, the
HTTPRoute and the ScaledObject are custom resources whose schemas are not available here, so
their fields are checked against what this overlay relies on in their published API
references (docs/deployment.md#inference-pools says what was not validated).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from specdec.gateway.config import GatewayConfig
from specdec.serving.config import DEFAULT_DRAIN_TIMEOUT_S, ModelServiceConfig
from tests.deploy.test_k8s import K8S, K8S_VERSIONS, KUBECTL, Manifests, kubectl_render, kubernetes_validate, one
from tests.support.kustomize_lite import build
from tests.support.service_commands import expand, parse_service_command

OVERLAY = K8S / "overlays" / "inference-pool"
CUSTOM = {("inference.networking.k8s.io/v1", "InferencePool"), ("gateway.networking.k8s.io/v1", "HTTPRoute"),
          ("keda.sh/v1alpha1", "ScaledObject")}
MODULES = {"gateway": "specdec.gateway", "target": "specdec.target_server", "draft": "specdec.draft_server"}


@pytest.fixture(scope="module")
def objects() -> Manifests:
    return kubectl_render(OVERLAY) if KUBECTL else build(OVERLAY)


def cell_pod(objects: Manifests) -> dict[str, Any]:
    return one(objects, "Deployment", "specdec-cell")["spec"]["template"]


def containers(objects: Manifests) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in cell_pod(objects)["spec"]["containers"]}


def configs(objects: Manifests) -> dict[str, Any]:
    """Each container's config as its service would build it, after $(NAME) expansion."""
    data = one(objects, "ConfigMap", "specdec-config")["data"]
    out = {}
    for name, c in containers(objects).items():
        env = {**data, **{e["name"]: e.get("value", "") for e in c.get("env", [])}}
        module, out[name] = parse_service_command([expand(a, env) for a in c["command"] + c["args"]])
        assert module == MODULES[name]
    return out


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_kubernetes_kinds_are_valid(objects: Manifests, version: str) -> None:
    kinds = sorted(o["kind"] for o in objects)
    assert kinds == sorted(["Namespace", "ConfigMap", "Deployment", "PodDisruptionBudget", "InferencePool",
                            "HTTPRoute", "ScaledObject"])
    assert "HorizontalPodAutoscaler" not in kinds  # KEDA owns the count: two autoscalers would fight
    for obj in objects:
        if (obj["apiVersion"], obj["kind"]) in CUSTOM:
            continue
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as error:
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']} is not valid Kubernetes {version}: {error}")
    assert {o["metadata"].get("namespace") for o in objects if o["kind"] != "Namespace"} == {"specdec"}


def test_a_cell_talks_to_its_own_services(objects: Manifests) -> None:
    c = configs(objects)
    ports = {name: {p["containerPort"] for p in x["ports"]} for name, x in containers(objects).items()}
    gateway, target, draft = c["gateway"], c["target"], c["draft"]
    assert isinstance(gateway, GatewayConfig)
    assert gateway.target_address == f"localhost:{target.port}" and gateway.draft_address == f"localhost:{draft.port}"
    assert gateway.metrics_prefix == "vllm:"  # the names an endpoint picker reads by default
    assert len({target.port, draft.port, gateway.port, gateway.http_port, target.metrics_port,
                draft.metrics_port}) == 6  # one network namespace: no two containers on one port
    assert gateway.http_port in ports["gateway"] and target.port in ports["target"] and draft.port in ports["draft"]


def test_each_pool_holds_its_gateways_full_batch(objects: Manifests) -> None:
    """One gateway per pool: no rule across gateways, only the cell's own batch to hold."""
    c = configs(objects)
    for name in ("target", "draft"):
        pool = c[name]
        assert isinstance(pool, ModelServiceConfig)
        assert c["gateway"].max_batch_size * pool.max_seq_len <= pool.kv_token_budget, name
        assert c["gateway"].max_batch_size <= pool.max_slots, name


def test_a_stopping_cell_loses_no_admitted_request(objects: Manifests) -> None:
    """SIGTERM reaches every container at once, after its preStop pause: the model services
    pause longer than the gateway, so they take slots until the gateway stops admitting, then
    keep them while it drains; the grace covers the longest pause and the drain."""
    pod = cell_pod(objects)["spec"]
    pauses = {name: c["lifecycle"]["preStop"]["sleep"]["seconds"] for name, c in containers(objects).items()}
    assert pauses["target"] > pauses["gateway"] > 0 and pauses["draft"] > pauses["gateway"]
    assert pod["terminationGracePeriodSeconds"] >= max(pauses.values()) + DEFAULT_DRAIN_TIMEOUT_S + 5 + 5
    rollout = one(objects, "Deployment", "specdec-cell")["spec"]["strategy"]["rollingUpdate"]
    assert rollout["maxUnavailable"] == 0  # a new cell serves before an old one drains


def test_the_pool_routes_to_ready_gateways_and_scrapes_them(objects: Manifests) -> None:
    pool = one(objects, "InferencePool", "specdec")["spec"]
    template = cell_pod(objects)
    assert pool["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    gateway = containers(objects)["gateway"]
    assert [p["number"] for p in pool["targetPorts"]] == [configs(objects)["gateway"].http_port]
    assert set(pool["endpointPickerRef"]) <= {"group", "kind", "name", "port", "failureMode"}
    assert pool["endpointPickerRef"]["failureMode"] in ("FailOpen", "FailClose")
    # Ready means /health 200: the target answers and the gateway does not drain.
    assert gateway["readinessProbe"]["httpGet"] == {"path": "/health", "port": pool["targetPorts"][0]["number"]}
    annotations = template["metadata"]["annotations"]
    assert (annotations["prometheus.io/port"], annotations["prometheus.io/path"]) == ("8000", "/metrics")
    route = one(objects, "HTTPRoute", "specdec")["spec"]
    (rule,) = route["rules"]
    assert rule["backendRefs"] == [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                                    "name": "specdec"}]


def test_keda_scales_the_cells_on_queue_depth(objects: Manifests) -> None:
    scaled = one(objects, "ScaledObject", "specdec-cell")["spec"]
    assert scaled["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "specdec-cell"}
    assert 1 <= scaled["minReplicaCount"] <= scaled["maxReplicaCount"]
    (trigger,) = scaled["triggers"]
    assert trigger["type"] == "prometheus"
    assert "vllm:num_requests_waiting" in trigger["metadata"]["query"] and float(trigger["metadata"]["threshold"]) > 0
    model = one(objects, "ConfigMap", "specdec-config")["data"]["TARGET_MODEL"]
    assert f'model_name="{model}"' in trigger["metadata"]["query"]


@pytest.mark.skipif(KUBECTL is None, reason="kubectl (with its built-in kustomize) is not installed")
def test_kustomize_lite_renders_what_kubectl_renders() -> None:
    def key(o: dict[str, Any]) -> tuple[str, str]:
        return o["kind"], o["metadata"]["name"]

    assert sorted(build(OVERLAY), key=key) == sorted(kubectl_render(OVERLAY), key=key)


def test_the_overlay_stands_alone() -> None:
    """It does not build on the base (one shared pair, the other topology)."""
    text = (OVERLAY / "kustomization.yaml").read_text()
    assert "../../base" not in text.split("resources:")[1]
    assert Path(OVERLAY / "namespace.yaml").read_text() == (K8S / "overlays" / "cpu" / "namespace.yaml").read_text()
