"""The suite's target: the embedded SmolLM2-135M-Instruct cut to its first 10 decoder layers.

Exactness (speculative output equal to plain decoding's, token for token or in distribution)
holds for any weights, so the stacks and the references they are checked against run a cut of
the model, as `--num-layers 10` would serve it: a third of the decoder's compute a token (the
output head stays whole), in a suite that is mostly decoding. The first layers keep the whole
model's numbers (a cut that skips to its last layers feeds them activations they never saw,
and rounding differences grow past fp32 tolerances). Its text means nothing and repeats
itself: its int8 copy's greedy drafts are all accepted in practice, so greedy rejections are
the 2-layer draft's (`weak_stack`), while sampled rounds reject from either draft.

Tests about the model's text (coherence, a stop string, a grammar's choices, a draft copying
a repetition, lookups copying the prompt) or about the model itself (loading, its GGUF blocks,
parity of all 30 layers) take the whole of it: `smollm2`, `full_fp32_runtime`, `full_stack`.
"""

from __future__ import annotations

import torch

from specdec.model.choices import DEFAULT_MODEL
from specdec.model.loader import LoadedModel, load_model
from specdec.model.runtime import ModelRuntime, build_runtime

#: Decoder layers of the suite's target, the first of the whole model's 30.
SUITE_LAYERS = 10


def suite_model() -> LoadedModel:
    """The suite's target in fp32 on the CPU."""
    return load_model(DEFAULT_MODEL, dtype=torch.float32, device="cpu", num_layers=SUITE_LAYERS)


def suite_int8_runtime() -> ModelRuntime:
    """The suite's target with int8 weights and bf16 activations: the draft of `int8_stack`."""
    return build_runtime(DEFAULT_MODEL, dtype="bfloat16", quantization="int8", num_layers=SUITE_LAYERS)
