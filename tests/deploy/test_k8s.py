"""deploy/k8s: the base and both overlays render, every manifest is valid Kubernetes, and
what they run is what the services accept.

Rendering uses `kubectl kustomize` when kubectl is installed, else kustomize_lite (the
subset of kustomize the manifests use); where both exist, they must agree.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from specdec.serving.config import Precision
from tests.support.kustomize_lite import build
from tests.support.service_commands import expand, parse_service_command

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="the pip package kubernetes-validate is needed (a dev extra)"
)

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
VARIANTS = {"base": K8S / "base", "cpu": K8S / "overlays" / "cpu", "gpu": K8S / "overlays" / "gpu"}
#: The oldest Kubernetes the manifests claim (native gRPC probes are GA since 1.27) and the newest known.
K8S_VERSIONS = ("1.30", kubernetes_validate.latest_version())
COMPONENTS = {"target": "specdec.target_server", "draft": "specdec.draft_server", "gateway": "specdec.gateway"}
GPU = "nvidia.com/gpu"
KUBECTL = shutil.which("kubectl")

Manifests = list[dict[str, Any]]


def kubectl_render(directory: Path) -> Manifests:
    out = subprocess.run([KUBECTL, "kustomize", str(directory)], capture_output=True, text=True, timeout=60,
                         check=False)
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


@pytest.fixture(scope="module", params=list(VARIANTS))
def rendered(request: pytest.FixtureRequest) -> tuple[str, Manifests]:
    directory = VARIANTS[request.param]
    return request.param, kubectl_render(directory) if KUBECTL else build(directory)


def one(objects: Manifests, kind: str, name: str) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def config_data(objects: Manifests) -> dict[str, str]:
    return one(objects, "ConfigMap", "specdec-config")["data"]


def pod_spec(objects: Manifests, component: str) -> dict[str, Any]:
    return one(objects, "Deployment", f"specdec-{component}")["spec"]["template"]["spec"]


def container(objects: Manifests, component: str) -> dict[str, Any]:
    containers = pod_spec(objects, component)["containers"]
    assert len(containers) == 1
    return containers[0]


def service_config(objects: Manifests, component: str) -> object:
    """The config the component's container would build, after $(NAME) expansion from its env."""
    c = container(objects, component)
    env = {e["name"]: e.get("value", "") for e in c.get("env", [])}
    for source in c.get("envFrom", []):
        env.update(one(objects, "ConfigMap", source["configMapRef"]["name"])["data"])
    module, config = parse_service_command([expand(a, env) for a in c["command"] + c["args"]])
    assert module == COMPONENTS[component]
    return config


def port_named(c: dict[str, Any], name: str) -> int:
    return next(p["containerPort"] for p in c["ports"] if p["name"] == name)


# -- validity ----------------------------------------------------------------------------


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_manifest_is_valid_kubernetes(rendered: tuple[str, Manifests], version: str) -> None:
    variant, objects = rendered
    kinds = sorted(o["kind"] for o in objects)
    expected = ["ConfigMap", *["Deployment"] * 3, "HorizontalPodAutoscaler", *["PodDisruptionBudget"] * 3,
                *["Service"] * 3]
    assert kinds == sorted(expected + ([] if variant == "base" else ["Namespace"]))
    for obj in objects:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as error:
            pytest.fail(f"{variant}: {obj['kind']}/{obj['metadata']['name']} "
                        f"is not valid Kubernetes {version}: {error}")


def test_validation_catches_a_misspelt_field() -> None:
    deployment = json.loads(json.dumps(one(build(VARIANTS["base"]), "Deployment", "specdec-target")))
    probe = deployment["spec"]["template"]["spec"]["containers"][0].pop("readinessProbe")
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = probe
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[-1], strict=True)


@pytest.mark.skipif(KUBECTL is None, reason="kubectl (with its built-in kustomize) is not installed")
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_kustomize_lite_renders_what_kubectl_renders(variant: str) -> None:
    def key(o: dict[str, Any]) -> tuple[str, str, str]:
        return o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"]

    assert sorted(build(VARIANTS[variant]), key=key) == sorted(kubectl_render(VARIANTS[variant]), key=key)


# -- what runs ---------------------------------------------------------------------------


def test_commands_parse_with_the_services_own_flags(rendered: tuple[str, Manifests]) -> None:
    variant, objects = rendered
    target, draft, gateway = (service_config(objects, c) for c in COMPONENTS)
    data = config_data(objects)
    for component, config in (("target", target), ("draft", draft)):
        c = container(objects, component)
        assert config.host == "0.0.0.0"
        assert config.port == port_named(c, "grpc")
        assert config.metrics_port == port_named(c, "metrics")
        assert config.model == data[f"{component.upper()}_MODEL"]
        # --threads matches the whole cores the pod may use (0 would start one per node core).
        assert config.threads == int(c["resources"]["limits"]["cpu"]) > 0
    assert gateway.host == "0.0.0.0" and gateway.port == port_named(container(objects, "gateway"), "grpc")
    assert gateway.http_port == port_named(container(objects, "gateway"), "http")
    assert gateway.target_address == f"specdec-target:{target.port}"
    assert gateway.draft_address == f"specdec-draft:{draft.port}"
    expected_device = "cuda" if variant == "gpu" else "cpu"
    assert target.device == draft.device == expected_device
    # What the precision flags (`auto` in the base) become: bf16 on GPUs, the draft unquantized.
    on_gpu = Precision("bfloat16", "none")
    assert target.precision() == (on_gpu if variant == "gpu" else Precision("float32", "none"))
    assert draft.precision() == (on_gpu if variant == "gpu" else Precision("bfloat16", "int4"))


def test_probes_are_native_grpc_on_the_serving_port(rendered: tuple[str, Manifests]) -> None:
    _, objects = rendered
    for component in COMPONENTS:
        c = container(objects, component)
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert set(c[probe]) & {"grpc", "httpGet", "tcpSocket", "exec"} == {"grpc"}, (component, probe)
            assert c[probe]["grpc"]["port"] == port_named(c, "grpc"), (component, probe)
        startup = c["startupProbe"]
        # Loading (first conversion or hub download) may take minutes: at least 10 of them.
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, component


def test_resources_and_scrape_annotations(rendered: tuple[str, Manifests]) -> None:
    _, objects = rendered
    for component in COMPONENTS:
        c = container(objects, component)
        for bound in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(c["resources"][bound]), (component, bound)
        annotations = one(objects, "Deployment", f"specdec-{component}")["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/path"] == "/metrics"
        assert int(annotations["prometheus.io/port"]) == port_named(c, "metrics")


def test_non_root_and_optional_hf_token(rendered: tuple[str, Manifests]) -> None:
    _, objects = rendered
    for component in COMPONENTS:
        pod = pod_spec(objects, component)
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
        token = next(e for e in container(objects, component)["env"] if e["name"] == "HF_TOKEN")
        assert token["valueFrom"]["secretKeyRef"] == {"name": "specdec-hf-token", "key": "HF_TOKEN", "optional": True}


def test_services_pdbs_and_autoscaler_select_the_pods(rendered: tuple[str, Manifests]) -> None:
    _, objects = rendered
    for component in COMPONENTS:
        deployment = one(objects, "Deployment", f"specdec-{component}")
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
        service = one(objects, "Service", f"specdec-{component}")
        assert service["spec"]["selector"].items() <= labels.items()
        names = {p["name"] for p in container(objects, component)["ports"]}
        http = {"http"} if component == "gateway" else set()  # the OpenAI-compatible API
        assert {p["targetPort"] for p in service["spec"]["ports"]} == names == {"grpc", "metrics"} | http
        pdb = one(objects, "PodDisruptionBudget", f"specdec-{component}")
        assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    hpa = one(objects, "HorizontalPodAutoscaler", "specdec-gateway")["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "specdec-gateway"}
    assert [m["resource"]["name"] for m in hpa["metrics"]] == ["cpu"]
    assert 1 <= hpa["minReplicas"] <= hpa["maxReplicas"]


def test_gateways_share_the_pools_and_roll_out_without_losing_capacity(rendered: tuple[str, Manifests]) -> None:
    """Gateways share the pair's pools (a refusal for room queues, docs/deployment.md#shared-pools):
    the pools must hold one gateway's longest request, and a rollout surges before it drains."""
    _, objects = rendered
    target, draft, _ = (service_config(objects, c) for c in COMPONENTS)
    hpa = one(objects, "HorizontalPodAutoscaler", "specdec-gateway")["spec"]
    deployment = one(objects, "Deployment", "specdec-gateway")["spec"]
    assert deployment["replicas"] <= hpa["maxReplicas"]
    assert deployment["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    for pool in (target, draft):
        assert 0 < pool.max_seq_len <= pool.kv_token_budget and pool.max_seq_len % pool.block_size == 0, pool


def test_gpus_only_in_the_gpu_overlay(rendered: tuple[str, Manifests]) -> None:
    variant, objects = rendered
    if variant != "gpu":
        assert GPU not in json.dumps(objects)
        assert all(container(objects, c)["image"] == "specdec:cpu" for c in COMPONENTS)
        return
    for component in ("target", "draft"):
        c = container(objects, component)
        assert c["image"] == "specdec:cuda"
        assert c["resources"]["requests"][GPU] == c["resources"]["limits"][GPU] == "1"
        assert any(t["key"] == GPU for t in pod_spec(objects, component)["tolerations"])
    gateway = container(objects, "gateway")
    assert gateway["image"] == "specdec:cpu" and GPU not in json.dumps(gateway)
    data = config_data(objects)
    assert (data["TARGET_MODEL"], data["DRAFT_MODEL"]) == ("meta-llama/Llama-3.2-3B-Instruct",
                                                           "meta-llama/Llama-3.2-1B-Instruct")


def test_overlays_put_everything_in_one_namespace(rendered: tuple[str, Manifests]) -> None:
    variant, objects = rendered
    if variant == "base":
        assert all("namespace" not in o["metadata"] for o in objects)
        return
    assert one(objects, "Namespace", "specdec")
    assert {o["metadata"].get("namespace") for o in objects if o["kind"] != "Namespace"} == {"specdec"}


def test_the_grace_period_covers_the_drain(rendered: tuple[str, Manifests]) -> None:
    """On SIGTERM a gateway drains its streams and a model service waits for its slots, for
    --drain-timeout-s, then stops within 5 s: Kubernetes must not kill them before (the
    gateway's preStop pause counts too)."""
    from specdec.gateway.config import GatewayConfig
    from specdec.serving.config import DEFAULT_DRAIN_TIMEOUT_S

    _, objects = rendered
    assert GatewayConfig.__dataclass_fields__["drain_timeout_s"].default == DEFAULT_DRAIN_TIMEOUT_S
    for component in COMPONENTS:
        pre_stop = container(objects, component).get("lifecycle", {}).get("preStop", {})
        pause = pre_stop.get("sleep", {}).get("seconds", 0)
        grace = pod_spec(objects, component)["terminationGracePeriodSeconds"]
        assert grace >= pause + DEFAULT_DRAIN_TIMEOUT_S + 5 + 5, component
    assert container(objects, "gateway")["lifecycle"]["preStop"]["sleep"]["seconds"] > 0
