"""Start-up kernel measurements: what they time, and that the choices follow them (pinned here)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specdec.model.choices import INT4_KERNELS
from specdec.model.int4_weight import Int4Weight
from specdec.model.linear import KERNELS as DENSE_KERNELS
from specdec.model.linear import DenseLinear
from specdec.model.llama import PagedLlama
from specdec.model.quantize import Int8Linear
from specdec.model.quantize_int4 import Int4Linear, quantize_int4
from specdec.model.shortlist_head import ShortlistHead
from specdec.tuning import startup
from specdec.tuning.kernels import (
    int4_candidates,
    measure_dense,
    measure_head,
    measure_int4_kernels,
    measure_int4_wide,
)
from specdec.tuning.startup import StartupTuner
from specdec.tuning.store import TuningKey, TuningStore
from tests.support.tiny_models import tiny_llama

KEY = TuningKey(
    machine="cpu", torch="t", model="m", weights="w", dtype="float32", quantization="none", device="cpu", threads=2,
    code="c", settings="",
)


def int8_head(out: int = 512, in_features: int = 64) -> Int8Linear:
    weight = torch.randn(out, in_features, generator=torch.Generator().manual_seed(0))
    scales = weight.abs().amax(dim=1) / 127
    return Int8Linear(torch.round(weight / scales[:, None]).to(torch.int8), scales.to(torch.bfloat16))


def test_every_int4_kernel_that_runs_here_is_timed_on_one_thread() -> None:
    threads = torch.get_num_threads()
    times = measure_int4_kernels(torch.bfloat16)
    assert set(times) == {"dequant", *int4_candidates(torch.bfloat16)} and set(times) <= set(INT4_KERNELS)
    assert all(seconds > 0 for seconds in times.values()) and torch.get_num_threads() == threads


def test_the_output_head_follows_the_measurement(monkeypatch: pytest.MonkeyPatch) -> None:
    exact = int8_head()
    assert set(measure_head(exact, ShortlistHead.from_int8(exact, 16))) == {"int8", "shortlist"}
    cases = (({"int8": 2.0, "shortlist": 1.0}, ShortlistHead), ({"int8": 1.0, "shortlist": 2.0}, Int8Linear))
    for times, want in cases:
        monkeypatch.setattr(startup, "measure_head", lambda exact, candidate, times=times: times)
        tuner = StartupTuner()
        assert type(tuner.output_head(exact, 16, "auto", "")) is want
        assert tuner.choices[0].reason == "measured"
    tuner = StartupTuner()
    assert tuner.output_head(exact, 0, "auto", "") is exact  # 0 turns it off: nothing measured
    assert (tuner.choices[0].value, tuner.choices[0].reason) == ("int8", "flag")


def test_dense_kernels_are_measured_per_shape_and_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    weight = torch.randn(96, 64)
    assert all(kernel in DENSE_KERNELS for kernel in measure_dense(weight))
    forward = PagedLlama(tiny_llama())
    monkeypatch.setattr(startup, "measure_dense", lambda weight: ("onednn", "aten"))
    tuner = StartupTuner(TuningStore(tmp_path), KEY)
    tuner.dense_kernels(forward)
    tuner.save()
    dense = [m for m in forward.layers[0].__dict__.values() if isinstance(m, DenseLinear)]
    assert dense and tuner.choices[0].reason in ("measured", "fixed")
    if tuner.choices[0].reason == "measured":  # oneDNN runs here
        assert all(m.narrow_kernel == "onednn" and m.wide_kernel == "aten" for m in dense)
        monkeypatch.setattr(startup, "measure_dense", lambda weight: pytest.fail("measured although cached"))
        again = StartupTuner(TuningStore(tmp_path), KEY)
        again.dense_kernels(PagedLlama(tiny_llama()))
        assert again.choices[0].reason == "cached"


def test_int4_wide_kernels_are_measured_per_shape_and_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def int4_forward() -> PagedLlama:
        return PagedLlama(quantize_int4(tiny_llama(), include_lm_head=False, kernel="dequant"))

    forward = int4_forward()
    int4 = [m for m in forward.layers[0].__dict__.values() if isinstance(m, Int4Linear)]
    assert int4 and set(measure_int4_wide(int4[0], torch.float32)) == {"dequant"}  # its own kernel: one to time
    monkeypatch.setattr(startup, "measure_int4_wide", lambda module, dtype: {"int4pack": 1.0, "dequant": 2.0})
    tuner = StartupTuner(TuningStore(tmp_path), KEY)
    tuner.int4_wide_kernels(forward)
    tuner.save()
    (choice,) = tuner.choices
    assert (choice.name, choice.reason) == ("int4_wide_kernel", "measured") and "int4pack" in choice.detail
    assert all(m.wide_kernel == "int4pack" for m in int4)
    monkeypatch.setattr(startup, "measure_int4_wide", lambda module, dtype: pytest.fail("measured although cached"))
    again = StartupTuner(TuningStore(tmp_path), KEY)
    reloaded = int4_forward()
    again.int4_wide_kernels(reloaded)
    assert again.choices[0].reason == "cached"
    assert all(m.wide_kernel == "int4pack" for layer in reloaded.layers for m in layer.__dict__.values()
               if isinstance(m, Int4Linear))
    StartupTuner().int4_wide_kernels(PagedLlama(tiny_llama()))  # no int4 layers: nothing to choose


def test_coarse_pass_weights_take_the_preferred_kernel() -> None:
    exact = int8_head()
    head = ShortlistHead.from_int8(exact, 16, prefer="dequant")
    assert head.coarse.kernel == "dequant"
    assert isinstance(Int4Weight.from_float(torch.randn(64, 64), 32), Int4Weight)
