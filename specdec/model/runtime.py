"""Build the runtime a service runs: a loaded model, optional int8 or int4 quantization, our forward."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.errors import InvalidArgumentError
from specdec.model.llama import PagedLlama
from specdec.model.loader import LoadedModel, gguf_path_of, load_model
from specdec.model.quantize import Int8Linear, quantize_int8
from specdec.model.quantize_int4 import quantize_int4
from specdec.model.shortlist_head import DEFAULT_SHORTLIST, choose_head

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}
QUANTIZATIONS = ("none", "int8", "int4")


@dataclass
class ModelRuntime:
    """What a service needs to run a model: weights, tokenizer and the paged forward."""

    loaded: LoadedModel
    forward: PagedLlama
    quantization: str

    @property
    def dtype(self) -> torch.dtype:
        return self.forward.dtype


def keep_first_layers(loaded: LoadedModel, num_layers: int) -> None:
    """Drop every decoder layer past the first `num_layers` (in place).

    A first-N-layer copy of the target is a cheap, deliberately weak draft: it agrees with
    the target on only a few percent of tokens, which exercises the reject path.
    """
    layers = loaded.model.model.layers
    if not 1 <= num_layers <= len(layers):
        raise InvalidArgumentError(f"num_layers must be in [1, {len(layers)}], got {num_layers}")
    loaded.model.model.layers = layers[:num_layers]
    loaded.model.config.num_hidden_layers = num_layers
    loaded.name = f"{loaded.name} (first {num_layers} layers)"


def build_runtime(
    model: str,
    *,
    dtype: str = "float32",
    device: str = "cpu",
    quantization: str = "none",
    num_layers: int = 0,
    group_size: int = 32,
    head_shortlist: int = DEFAULT_SHORTLIST,
    int4_kernel: str = "auto",
) -> ModelRuntime:
    """Load `model` in `dtype` on `device`, optionally cut it to its first `num_layers` decoder
    layers and quantize its weights (int8, or int4 in groups of `group_size`), and wrap our
    forward around it. A quantized model's int8 output head becomes a `ShortlistHead` (a 4-bit
    pass, then the int8 head on its `head_shortlist` best tokens) where that measures faster;
    `head_shortlist=0` keeps the int8 head. `int4_kernel` names the 4-bit matmul kernel
    (`specdec.model.quantize_int4.KERNELS`) or "auto", which times them at start-up.

    The int8 and int4 kernels only pay off with bfloat16 activations on CPU (see `quantize`
    and `quantize_int4`), so the embedded default draft is `quantization="int4", dtype="bfloat16"`.
    """
    if dtype not in DTYPES:
        raise InvalidArgumentError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if quantization not in QUANTIZATIONS:
        raise InvalidArgumentError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    loaded = load_model(model, dtype=DTYPES[dtype], device=device)
    if num_layers:
        keep_first_layers(loaded, num_layers)
    if quantization == "int8":
        quantize_int8(loaded.model)
    elif quantization == "int4":
        # Decoder projections in 4 bits, from the GGUF's own Q4 blocks when the model came
        # from one; the output head in int8, since a 4-bit head costs acceptance
        # (docs/performance.md#int4-draft-output-head).
        quantize_int4(
            loaded.model, group_size=group_size, gguf_path=gguf_path_of(model), include_lm_head=False, kernel=int4_kernel
        )
        quantize_int8(loaded.model)  # only the head is still an nn.Linear
        loaded.model.config.specdec_quantization = "int4"
    if isinstance(loaded.model.lm_head, Int8Linear):
        loaded.model.lm_head = choose_head(loaded.model.lm_head, head_shortlist, kernel=int4_kernel)
    return ModelRuntime(loaded=loaded, forward=PagedLlama(loaded.model), quantization=quantization)
