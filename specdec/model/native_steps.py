"""The decoder layers of a decoding forward in one native call (`csrc/decode_layers.cpp`).

A draft's step at one token a request is some 120 int4 matmuls and ten times as many tiny
operations between them (norms, RoPE, the cache write, attention, SiLU). Compiled, the tiny
ones still cost a kernel entry each and the graphs' own entries; eager, a dispatch each. Here
one call runs every layer: the int4 matmuls (`csrc/int4_dot.cpp`) and the rest in plain C++,
the residual stream in fp32, so its logits are as close to an fp32 forward of the same weights
as `PagedLlama.eager_layers`' are (tests/specdec/model/test_native_steps.py).

It takes what the draft runs: bf16 activations and KV pool, every projection an `Int4Linear`
on the int4dot kernel with no bias, a CPU, and forwards over a cached context (the attention's
MASKED layout: a drafting step, a round's opening feed, a guessed forward) of at most
`MAX_ROWS` tokens in all. A prompt or a wider forward goes to the model's layer runner, and
so does a shape class (`step_shapes`) the start-up tuner did not give it
(`StartupTuner.native_steps`, by timing).
"""

from __future__ import annotations

import torch

from specdec.kv_cache.paged_cache import PagedKVCache
from specdec.model import int4_dot
from specdec.model.attention import ContextLayout
from specdec.model.llama import LayerInputs, PagedLlama
from specdec.model.quantize_int4 import Int4Linear
from specdec.model.step_shapes import MANY, MAX_MULTI, MULTI, SHAPES, Shape, shape_class

#: The most tokens a forward it takes holds in all: a single request's widest feed, 16 accepted
#: tokens the draft did not draft (a lookup's) and the bonus token. The layer path ran that one
#: eager, as its int4 layers may switch kernels past 16 rows, at 1.7x the native call's time
#: (docs/performance.md#native-draft-steps).
MAX_ROWS = MAX_MULTI
#: The widest head the attention kernel takes (`attention_takes_dim` in csrc/decode_attention.cpp).
MAX_HEAD_DIM = 128
#: The shape classes it can take: all but a batch of wider forwards, whose 3 requests × 9
#: tokens that time the class are past `MAX_ROWS`.
NATIVE_SHAPES = tuple(shape for shape in SHAPES if shape != (MANY, MULTI))


def unsupported(model: PagedLlama) -> str:
    """Why `model`'s steps cannot run natively ("" where they can)."""
    if model.embed_tokens.weight.device.type != "cpu":
        return "not on a CPU"
    if model.dtype != torch.bfloat16:
        return f"{model.dtype} activations, not bfloat16"
    if not int4_dot.available():
        return "no int4dot kernel on this CPU"
    if model.head_dim % 16 or model.head_dim > MAX_HEAD_DIM:
        return f"heads of {model.head_dim} values (the kernel takes multiples of 16 up to {MAX_HEAD_DIM})"
    for layer in model.layers:
        for module in (layer.qkv, layer.o, layer.gate_up, layer.down):
            if not isinstance(module, Int4Linear) or module.bias is not None:
                return "a projection that is not a bias-free int4 layer"
            if module.prepare(model.embed_tokens.weight.device, model.dtype) != "int4dot":
                return f"a {module.kernel} int4 layer, not int4dot"
    return ""


class NativeSteps:
    """The decoding forwards of `model` in the shape classes `shapes`, in one native call each.

    Holds the packed weights it points the kernel at, so they live as long as it does.
    """

    def __init__(self, model: PagedLlama, shapes: tuple[Shape, ...] = NATIVE_SHAPES) -> None:
        why = unsupported(model)
        if why:
            raise ValueError(f"native steps cannot run this model: {why}")
        self.model = model
        self.shapes = set(shapes)
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
        """Whether this runner serves a forward: cached context, a class in `shapes`, at most
        `MAX_ROWS` tokens in all."""
        bsz, width = hidden.shape[:2]
        return (inputs.attention.layout is ContextLayout.MASKED and bsz * width <= MAX_ROWS
                and shape_class(bsz, width) in self.shapes)

    @torch.inference_mode()
    def __call__(self, hidden: torch.Tensor, inputs: LayerInputs, cache: PagedKVCache) -> torch.Tensor:
        """`hidden` [B, T, hidden] in, the same shape out; writes the chunk's K/V to `cache`."""
        bsz, width = hidden.shape[:2]
        rows = bsz * width
        # [B, 1, G·T, L]: SDPA's has G = 1; GATHER repeats the T rows per query head of a group.
        bias = inputs.attention.bias[:, 0, :width]  # [B, T, L]
        writes = torch.full((rows,), -1, dtype=torch.int64).index_put_((inputs.kv_rows,), inputs.write_index)  # [B*T]
        out = torch.ops.specdec.decode_layers(
            hidden.reshape(rows, -1).contiguous(), inputs.cos.reshape(rows, -1).contiguous(),
            inputs.sin.reshape(rows, -1).contiguous(), writes, inputs.attention.context_index.contiguous(),
            bias.reshape(rows, -1).contiguous(), cache.kv, self.table, self.norms, self.model.num_heads,
            self.model.num_kv_heads, self.model.eps,
        )
        return out.view_as(hidden)
