"""Shared fixtures: the embedded model is loaded once per test session, and the device of the
device-agnostic tests.

The first load converts the embedded GGUF to safetensors in the specdec cache
(`$SPECDEC_CACHE_DIR`, default `~/.cache/specdec`); later sessions reuse it. The fixtures of
tests/support are registered here, so every test folder finds them by name.

`pytest --device cuda` runs the tests marked `device_agnostic` (they need no GGUF file and no
service, and take the `device` fixture) on that device; every other test runs on the CPU as
always. `pytest -m device_agnostic --device cuda` runs those alone.
"""

from __future__ import annotations

import pytest
import torch

from specdec.model.choices import DEFAULT_MODEL
from specdec.model.loader import LoadedModel, load_model

pytest_plugins = ["tests.support.services", "tests.support.stacks", "tests.support.pki"]
DEVICE_AGNOSTIC = "device_agnostic"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--device", default="cpu",
                     help="torch device of the device_agnostic tests, e.g. cuda (default cpu); the rest run on the CPU")


def pytest_configure(config: pytest.Config) -> None:
    device = torch.device(config.getoption("--device"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError(f"--device {device}: torch sees no CUDA device here")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test that takes `device` must be marked, or `-m device_agnostic` would skip it."""
    unmarked = [item.nodeid for item in items
                if "device" in getattr(item, "fixturenames", ()) and item.get_closest_marker(DEVICE_AGNOSTIC) is None]
    if unmarked:
        raise pytest.UsageError(f"tests taking the `device` fixture must be marked {DEVICE_AGNOSTIC}: {unmarked}")


@pytest.fixture(scope="session")
def device(pytestconfig: pytest.Config) -> torch.device:
    """The device of the `device_agnostic` tests: `--device`, default the CPU; with its index
    (cuda:0 for cuda), as the device of the tensors made on it names it."""
    device = torch.device(pytestconfig.getoption("--device"))
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    """The embedded SmolLM2-135M-Instruct target in fp32 on the CPU."""
    torch.set_num_threads(max(1, torch.get_num_threads()))
    return load_model(DEFAULT_MODEL, dtype=torch.float32, device="cpu")
