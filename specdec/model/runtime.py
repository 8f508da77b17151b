"""Build the runtime a service runs: a loaded model, optional int8 or int4 quantization, our forward."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from specdec.errors import InvalidArgumentError
from specdec.model.choices import DTYPE_NAMES, QUANTIZATIONS
from specdec.model.llama import PagedLlama
from specdec.model.loader import LoadedModel, gguf_path_of, load_model
from specdec.model.quantize import Int8Linear, quantize_int8
from specdec.model.quantize_int4 import quantize_int4
from specdec.model.shortlist_head import DEFAULT_SHORTLIST

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_NAMES}


class RuntimeTuner(Protocol):
    """The start-up choices `build_runtime` asks for (`specdec.tuning.startup.StartupTuner`)."""

    def int4_kernel(self, kernel: str, device: str, dtype: torch.dtype) -> str:
        """The int4 kernel to prefer for "auto" ("" to leave it to `kernel`)."""
        ...

    def output_head(self, exact: Int8Linear, shortlist: int, kernel: str, prefer: str) -> nn.Module:
        """`exact` or a `ShortlistHead` over it."""
        ...

    def dense_kernels(self, forward: PagedLlama) -> None:
        """Set the dense projections' kernels."""
        ...

    def int4_wide_kernels(self, forward: PagedLlama) -> None:
        """Set the int4 projections' kernels for wide inputs."""
        ...


@dataclass
class ModelRuntime:
    """What a service needs to run a model: weights, tokenizer and the paged forward."""

    loaded: LoadedModel
    #: Our paged forward over `loaded.model`'s weights.
    model: PagedLlama
    quantization: str
    #: What made the start-up choices (None: the untuned defaults).
    tuner: RuntimeTuner | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype


def build_runtime(
    model: str,
    *,
    dtype: str = "float32",
    device: str = "cpu",
    quantization: str = "none",
    num_layers: int = 0,
    group_size: int = 32,
    int4_kernel: str = "auto",
    tuner: RuntimeTuner | None = None,
) -> ModelRuntime:
    """Load `model` in `dtype` on `device`, optionally cut it to its first `num_layers` decoder
    layers and quantize its weights (int8, or int4 in groups of `group_size`), and wrap our
    forward around it. `tuner` makes the machine-dependent choices: the int4 kernel for
    `int4_kernel="auto"` (`specdec.model.choices.INT4_KERNELS`), whether a quantized model's
    int8 output head becomes a `ShortlistHead` (a 4-bit pass, then the int8 head on its
    `DEFAULT_SHORTLIST` best tokens), the dense kernels and the int4 kernels for wide inputs. Without one,
    each takes its untuned default: the kernel order of `Int4Linear`, the int8 head, `F.linear`.

    The int8 and int4 kernels only pay off with bfloat16 activations on CPU (see `quantize`
    and `quantize_int4`), so the embedded default draft is `quantization="int4", dtype="bfloat16"`.
    """
    if dtype not in DTYPES:
        raise InvalidArgumentError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}", field="dtype")
    if quantization not in QUANTIZATIONS:
        raise InvalidArgumentError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}",
                                   field="quantization")
    loaded = load_model(model, dtype=DTYPES[dtype], device=device, num_layers=num_layers)
    if quantization == "int8":
        quantize_int8(loaded.model)
    prefer = ""
    if quantization == "int4":
        # Decoder projections in 4 bits, from the GGUF's own Q4 blocks when the model came
        # from one; the output head in int8, since a 4-bit head costs acceptance
        # (docs/performance.md#int4-draft-output-head).
        prefer = tuner.int4_kernel(int4_kernel, device, DTYPES[dtype]) if tuner is not None else ""
        quantize_int4(
            loaded.model, group_size=group_size, gguf_path=gguf_path_of(model), include_lm_head=False,
            kernel=int4_kernel, prefer=prefer,
        )
        quantize_int8(loaded.model)  # only the head is still an nn.Linear
        loaded.model.config.specdec_quantization = "int4"
    head = loaded.model.lm_head
    if isinstance(head, Int8Linear) and tuner is not None:
        loaded.model.lm_head = tuner.output_head(head, DEFAULT_SHORTLIST, int4_kernel, prefer)
    paged = PagedLlama(loaded.model)
    if tuner is not None:
        tuner.dense_kernels(paged)
        tuner.int4_wide_kernels(paged)
    return ModelRuntime(loaded=loaded, model=paged, quantization=quantization, tuner=tuner)
