"""The decoder layers of a 1-token step in one native call (`csrc/decode_layers.cpp`).

A draft's step at one token a request is some 120 int4 matmuls and ten times as many tiny
operations between them (norms, RoPE, the cache write, attention, SiLU). Compiled, the tiny
ones still cost a kernel entry each and the graphs' own entries; eager, a dispatch each. Here
one call runs every layer: the int4 matmuls (`csrc/int4_dot.cpp`) and the rest in plain C++,
rounding to bf16 where the eager forward rounds, so it agrees with `PagedLlama.eager_layers`
up to the order of fp32 sums (tests/specdec/model/test_native_steps.py).

It takes what the draft runs: bf16 activations and KV pool, every projection an `Int4Linear`
on the int4dot kernel with no bias, a CPU, and the SDPA or GATHER attention's MASKED layout
(a decode step's). Anything else (a prompt, a wider chunk) goes to the model's layer runner.
Whether a model's steps take it is the start-up tuner's choice, by timing
(`StartupTuner.native_steps`).
"""

from __future__ import annotations

import torch

from specdec.kv_cache.paged_cache import PagedKVCache
from specdec.model import int4_dot
from specdec.model.attention import ContextLayout
from specdec.model.llama import LayerInputs, PagedLlama
from specdec.model.quantize_int4 import Int4Linear


def unsupported(model: PagedLlama) -> str:
    """Why `model`'s steps cannot run natively ("" where they can)."""
    if model.embed_tokens.weight.device.type != "cpu":
        return "not on a CPU"
    if model.dtype != torch.bfloat16:
        return f"{model.dtype} activations, not bfloat16"
    if not int4_dot.available():
        return "no int4dot kernel on this CPU"
    for layer in model.layers:
        for module in (layer.qkv, layer.o, layer.gate_up, layer.down):
            if not isinstance(module, Int4Linear) or module.bias is not None:
                return "a projection that is not a bias-free int4 layer"
            if module.prepare(model.embed_tokens.weight.device, model.dtype) != "int4dot":
                return f"a {module.kernel} int4 layer, not int4dot"
    return ""


#: The kinds of 1-token step, each decided on its own: one request's, and a batch's.
STEP_KINDS = ("single", "batch")


def step_kind(batch_size: int) -> str:
    return "single" if batch_size == 1 else "batch"


class NativeSteps:
    """The 1-token steps of `model` (every request one new token) of the kinds in `kinds`, in
    one native call each.

    Holds the packed weights it points the kernel at, so they live as long as it does.
    """

    def __init__(self, model: PagedLlama, kinds: tuple[str, ...] = STEP_KINDS) -> None:
        why = unsupported(model)
        if why:
            raise ValueError(f"native steps cannot run this model: {why}")
        self.model = model
        self.kinds = set(kinds)
        matmuls = [m for layer in model.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)
                   if isinstance(m, Int4Linear)]  # all of them (`unsupported`)
        self._operands = [m.int4dot_operands() for m in matmuls]  # (codes, scales) each: kept alive here
        rows = [[codes.data_ptr(), scales.data_ptr(), codes.shape[0], m.in_features, m.group_size]
                for m, (codes, scales) in zip(matmuls, self._operands)]
        self.table = torch.tensor(rows, dtype=torch.int64).view(len(model.layers), 4, 5)  # [layers, 4, 5]
        self.norms = torch.stack(
            [torch.stack((layer.input_norm, layer.post_norm)) for layer in model.layers]
        ).to(torch.bfloat16).contiguous()  # [layers, 2, hidden]

    def takes(self, hidden: torch.Tensor, inputs: LayerInputs) -> bool:
        """Whether a forward is a step this runner serves: one token a request, cached context,
        a kind in `kinds`."""
        return (hidden.shape[1] == 1 and inputs.attention.layout is ContextLayout.MASKED
                and step_kind(hidden.shape[0]) in self.kinds)

    @torch.inference_mode()
    def __call__(self, hidden: torch.Tensor, inputs: LayerInputs, cache: PagedKVCache) -> torch.Tensor:
        """`hidden` [B, 1, hidden] in, the same shape out; writes the step's K/V to `cache`."""
        bsz = hidden.shape[0]
        bias = inputs.attention.bias  # [B, 1, G or 1, L]: SDPA's is [B, 1, 1, L], GATHER repeats it per group
        out = torch.ops.specdec.decode_layers(
            hidden.view(bsz, -1).contiguous(), inputs.cos.view(bsz, -1).contiguous(),
            inputs.sin.view(bsz, -1).contiguous(), self._write_index(inputs, bsz),
            inputs.attention.context_index.contiguous(), bias[:, 0, 0].contiguous(), cache.kv, self.table,
            self.norms, self.model.num_heads, self.model.num_kv_heads, self.model.eps,
        )
        return out.view_as(hidden)

    @staticmethod
    def _write_index(inputs: LayerInputs, bsz: int) -> torch.Tensor:
        """The pool row each request's token writes. # [B]"""
        if inputs.kv_rows.numel() != bsz:
            raise ValueError(f"native steps write every request's token: {inputs.kv_rows.numel()} of {bsz} rows")
        return inputs.write_index.index_select(0, torch.argsort(inputs.kv_rows)).contiguous()
