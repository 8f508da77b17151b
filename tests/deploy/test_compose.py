"""docker-compose.yml (and its GPU override) as `docker-compose config` resolves them: the
five services, health checks through `specdec health`, start-up order, the model cache,
and service commands that the services' own flags accept. No Docker engine is needed."""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from specdec.serving.config import Precision
from tests.support.service_commands import parse_service_command

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = shutil.which("docker-compose")
pytestmark = pytest.mark.skipif(COMPOSE is None,
                                reason="docker-compose is not installed (apt-get install docker-compose)")

MODEL_SERVICES = {"target": "specdec.target_server", "draft": "specdec.draft_server", "gateway": "specdec.gateway"}
#: Variables the compose files read; cleared so that the defaults are what is tested.
SETTINGS = {m for f in ("docker-compose.yml", "docker-compose.gpu.yml")
            for m in re.findall(r"\$\{(\w+)", (ROOT / f).read_text())}


ComposeConfig = Callable[..., dict[str, Any]]


@pytest.fixture(scope="module")
def compose_config(tmp_path_factory: pytest.TempPathFactory) -> ComposeConfig:
    """`docker-compose config` of these files with only `env` set of SETTINGS (and no .env file)."""
    env_file = tmp_path_factory.mktemp("compose") / "empty.env"
    env_file.write_text("")

    def config(*files: str, **env: str) -> dict[str, Any]:
        environment = {k: v for k, v in os.environ.items() if k not in SETTINGS} | env
        argv = [COMPOSE, "--project-directory", str(ROOT), "--env-file", str(env_file)]
        for name in files:
            argv += ["-f", str(ROOT / name)]
        out = subprocess.run([*argv, "config"], capture_output=True, text=True, env=environment, timeout=60,
                             check=False)
        assert out.returncode == 0, out.stderr
        return yaml.safe_load(out.stdout)

    return config


@pytest.fixture(scope="module")
def default(compose_config: ComposeConfig) -> dict[str, Any]:
    return compose_config("docker-compose.yml")


def command(service: dict[str, Any]) -> list[str]:
    cmd = service["command"]
    return shlex.split(cmd) if isinstance(cmd, str) else list(cmd)


def configs(compose: dict[str, Any]) -> dict[str, Any]:
    """Service name -> the config its command builds (parsed by the service's own flags)."""
    parsed = {}
    for name, module in MODEL_SERVICES.items():
        found, parsed[name] = parse_service_command(command(compose["services"][name]))
        assert found == module, name
    return parsed


def published(service: dict[str, Any]) -> dict[int, int]:
    return {int(p["target"]): int(p["published"]) for p in service.get("ports", [])}


def test_five_services(default: dict[str, Any]) -> None:
    assert set(default["services"]) == {"draft", "target", "gateway", "prometheus", "grafana"}


def test_commands_parse_with_the_services_own_flags(default: dict[str, Any]) -> None:
    parsed = configs(default)
    target, draft, gateway = parsed["target"], parsed["draft"], parsed["gateway"]
    assert all(c.host == "0.0.0.0" and c.metrics_port == 9090 for c in parsed.values())
    assert (target.port, draft.port, gateway.port, gateway.http_port) == (50052, 50051, 50050, 8000)
    assert gateway.target_address == f"target:{target.port}" and gateway.draft_address == f"draft:{draft.port}"
    # The embedded pair by default: the fp32 target and its int4 self-draft, as `auto` picks on the CPU.
    assert (target.model, target.device, target.precision()) == ("smollm2-135m", "cpu", Precision("float32", "none"))
    assert (draft.model, draft.device, draft.precision()) == ("smollm2-135m", "cpu", Precision("bfloat16", "int4"))


def test_health_checks_use_specdec_health_on_the_service_port(default: dict[str, Any]) -> None:
    parsed = configs(default)
    for name in MODEL_SERVICES:
        check = default["services"][name]["healthcheck"]
        assert check["test"] == ["CMD", "specdec", "health", f"localhost:{parsed[name].port}"], name
        assert check["start_period"], name  # model loading must not count as failures


def test_start_order_waits_for_health(default: dict[str, Any]) -> None:
    services = default["services"]
    healthy = {"condition": "service_healthy"}
    # One model service at a time: each times its forward at start-up.
    assert services["draft"]["depends_on"] == {"target": healthy}
    assert services["gateway"]["depends_on"] == {"target": healthy, "draft": healthy}


def test_model_cache_volume(default: dict[str, Any]) -> None:
    assert "model-cache" in default["volumes"]
    for name in MODEL_SERVICES:
        service = default["services"][name]
        # SPECDEC_CACHE_DIR and HF_HOME live there (Dockerfile)
        assert "model-cache:/cache:rw" in service["volumes"], name
        assert service["image"] == "specdec:cpu" and service["build"]["args"]["VARIANT"] == "cpu"
        assert "HF_TOKEN" in service["environment"]


def test_ports_and_monitoring_mounts(default: dict[str, Any]) -> None:
    services = default["services"]
    assert published(services["gateway"]) == {50050: 50050, 8000: 8000}
    assert published(services["prometheus"]) == {9090: 9090}
    assert published(services["grafana"]) == {3000: 3000}
    assert not published(services["target"]) and not published(services["draft"])
    mounts = {v.split(":")[1]: Path(v.split(":")[0])
              for s in ("prometheus", "grafana") for v in services[s]["volumes"] if v.startswith("/")}
    assert mounts["/etc/prometheus"] == ROOT / "deploy" / "prometheus"
    assert mounts["/etc/grafana/provisioning"] == ROOT / "deploy" / "grafana" / "provisioning"
    assert mounts["/var/lib/grafana/dashboards"] == ROOT / "deploy" / "grafana" / "dashboards"
    assert list((ROOT / "deploy" / "grafana" / "dashboards").glob("*.json"))
    # Grafana's provisioning reads the dashboards where they are mounted, and Prometheus by its service name.
    provisioning = ROOT / "deploy" / "grafana" / "provisioning"
    providers = [p for f in provisioning.glob("dashboards/*.yml") for p in yaml.safe_load(f.read_text())["providers"]]
    assert providers and all(p["options"]["path"] == "/var/lib/grafana/dashboards" for p in providers)
    sources = [d for f in provisioning.glob("datasources/*.yml") for d in yaml.safe_load(f.read_text())["datasources"]]
    assert any(d["type"] == "prometheus" and d["url"] == "http://prometheus:9090" for d in sources)


def test_prometheus_scrapes_the_compose_services(default: dict[str, Any]) -> None:
    prometheus = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    scraped = {t for job in prometheus["scrape_configs"] for sc in job.get("static_configs", []) for t in sc["targets"]}
    parsed = configs(default)
    assert {f"{name}:{config.metrics_port}" for name, config in parsed.items()} <= scraped


def test_production_pair_by_environment(compose_config: ComposeConfig) -> None:
    compose = compose_config(
        "docker-compose.yml", TARGET_MODEL="meta-llama/Llama-3.2-3B-Instruct",
        DRAFT_MODEL="meta-llama/Llama-3.2-1B-Instruct", HF_TOKEN="hf_test", TARGET_ARGS="--threads 1",
    )
    parsed = configs(compose)
    assert parsed["target"].model == "meta-llama/Llama-3.2-3B-Instruct" and parsed["target"].threads == 1
    assert parsed["draft"].model == "meta-llama/Llama-3.2-1B-Instruct"
    assert all(compose["services"][name]["environment"]["HF_TOKEN"] == "hf_test" for name in MODEL_SERVICES)


def test_gpu_override_changes_only_image_device_and_gpus(compose_config: ComposeConfig,
                                                         default: dict[str, Any]) -> None:
    gpu = compose_config("docker-compose.yml", "docker-compose.gpu.yml")
    base, moved = configs(default), configs(gpu)
    for name in ("target", "draft"):
        service = gpu["services"][name]
        assert moved[name] == dataclasses.replace(base[name], device="cuda"), name
        assert moved[name].precision() == Precision("bfloat16", "none"), name  # `auto` on a GPU
        assert service["image"] == "specdec:cuda" and service["build"]["args"]["VARIANT"] == "cuda"
        devices = service["deploy"]["resources"]["reservations"]["devices"]
        assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
        assert {k: v for k, v in service.items() if k not in ("image", "build", "deploy", "command")} == {
            k: v for k, v in default["services"][name].items() if k not in ("image", "build", "command")
        }
    # Merging files reorders a service's port list: compare the ports as a set.
    gateway, gpu_gateway = default["services"]["gateway"], gpu["services"]["gateway"]
    assert {**gpu_gateway, "ports": None} == {**gateway, "ports": None}
    assert published(gpu_gateway) == published(gateway)


def test_stop_waits_for_the_drain(default: dict[str, Any]) -> None:
    """`docker compose stop` gives each service its drain (--drain-timeout-s) and the stop after it."""
    from specdec.serving.config import DEFAULT_DRAIN_TIMEOUT_S

    for name in ("target", "draft", "gateway"):
        grace = default["services"][name]["stop_grace_period"]
        assert grace.endswith("s") and int(grace[:-1]) >= DEFAULT_DRAIN_TIMEOUT_S + 10, name
