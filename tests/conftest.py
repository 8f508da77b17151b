"""Shared fixtures: the embedded model is loaded once per test session.

The first load converts the embedded GGUF to safetensors in the specdec cache
(`$SPECDEC_CACHE_DIR`, default `~/.cache/specdec`); later sessions reuse it. The fixtures of
tests/support are registered here, so every test folder finds them by name.
"""

from __future__ import annotations

import pytest
import torch

from specdec.model.loader import DEFAULT_MODEL, LoadedModel, load_model

pytest_plugins = ["tests.support.services", "tests.support.stacks", "tests.support.pki"]


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    """The embedded SmolLM2-135M-Instruct target in fp32 on the CPU."""
    torch.set_num_threads(max(1, torch.get_num_threads()))
    return load_model(DEFAULT_MODEL, dtype=torch.float32, device="cpu")
