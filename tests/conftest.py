"""Shared fixtures: the suite's target (a cut of the embedded model, tests/support/models.py)
and the whole embedded model, each loaded once per test session where used, and the device of
the device-agnostic tests.

The first load converts the embedded GGUF to safetensors in the specdec cache
(`$SPECDEC_CACHE_DIR`, default `~/.cache/specdec`); later sessions reuse it. The fixtures of
tests/support are registered here, so every test folder finds them by name.

`pytest --device cuda` runs the tests marked `device_agnostic` (they need no GGUF file and no
service, and take the `device` fixture) on that device; every other test runs on the CPU as
always. `pytest -m device_agnostic --device cuda` runs those alone.

Under pytest-xdist each worker runs torch on its share of the cores (`worker_threads`): with
`-n 2` on two cores, two workers of two intra-op threads each would fight over both cores,
and an OpenMP team whose threads are not all running waits at every barrier (several times
slower for the small ops of these models). A test that checks the multi-threaded kernels
takes `every_core`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from specdec.model.choices import DEFAULT_MODEL
from specdec.model.loader import LoadedModel, load_model
from tests.support.models import suite_model

pytest_plugins = ["tests.support.services", "tests.support.stacks", "tests.support.pki"]
DEVICE_AGNOSTIC = "device_agnostic"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--device", default="cpu",
                     help="torch device of the device_agnostic tests, e.g. cuda (default cpu); the rest run on the CPU")


def pytest_configure(config: pytest.Config) -> None:
    device = torch.device(config.getoption("--device"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError(f"--device {device}: torch sees no CUDA device here")
    if (threads := worker_threads()) is not None:
        torch.set_num_threads(threads)


def worker_threads() -> int | None:
    """Intra-op threads of an xdist worker: its share of this process's cores (at least one);
    None outside xdist workers (one process keeps torch's default, every core)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if "PYTEST_XDIST_WORKER" not in os.environ or workers < 2:
        return None
    return max(1, len(os.sched_getaffinity(0)) // workers)


@pytest.fixture(scope="module")
def every_core() -> Iterator[int]:
    """The module's tests run torch on every core of this process, as outside xdist (for the
    checks of what the multi-threaded kernels give); the number of threads."""
    before, cores = torch.get_num_threads(), len(os.sched_getaffinity(0))
    torch.set_num_threads(cores)
    yield cores
    torch.set_num_threads(before)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test that takes `device` must be marked, or `-m device_agnostic` would skip it."""
    unmarked = [item.nodeid for item in items
                if "device" in getattr(item, "fixturenames", ()) and item.get_closest_marker(DEVICE_AGNOSTIC) is None]
    if unmarked:
        raise pytest.UsageError(f"tests taking the `device` fixture must be marked {DEVICE_AGNOSTIC}: {unmarked}")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """`--dist loadfile` hands out the longest files first (tests/support/schedule.py)."""
    if config.getoption("dist") != "loadfile":
        return None
    from tests.support.schedule import LongestFileFirst

    return LongestFileFirst(config, log)


@pytest.fixture(scope="session")
def device(pytestconfig: pytest.Config) -> torch.device:
    """The device of the `device_agnostic` tests: `--device`, default the CPU; with its index
    (cuda:0 for cuda), as the device of the tensors made on it names it."""
    device = torch.device(pytestconfig.getoption("--device"))
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


@pytest.fixture(scope="session")
def target_model() -> LoadedModel:
    """The suite's target (tests/support/models.py: a third of SmolLM2's decoder layers) in fp32."""
    torch.set_num_threads(max(1, torch.get_num_threads()))
    return suite_model()


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    """The whole embedded SmolLM2-135M-Instruct in fp32 on the CPU, for tests of its text or its loading."""
    return load_model(DEFAULT_MODEL, dtype=torch.float32, device="cpu")
