"""The model layer's choices as the command lines name them, and their defaults.

Free of torch and transformers, so a command line builds its parser (`specdec serve --help`)
without loading either; each module that implements a choice takes its names from here.
"""

from __future__ import annotations

import enum

#: The model an unconfigured service loads: the embedded SmolLM2 (no download).
DEFAULT_MODEL = "smollm2-135m"
#: Names of the forward pass's dtypes (`specdec.model.runtime.DTYPES` maps them to torch's).
DTYPE_NAMES = ("float32", "bfloat16")
QUANTIZATIONS = ("none", "int8", "int4")
#: The int4 matmul kernels (`specdec.model.quantize_int4`).
INT4_KERNELS = ("int4dot", "int4pack", "dequant")
#: `--compile`: auto (time compiled and eager steps at start-up, keep the faster), on, off.
COMPILE_MODES = ("auto", "on", "off")
#: `--native-steps`: auto (time the native call against the layer runner per decoding shape
#: class, keep the faster), on (wherever the model allows it), off.
NATIVE_STEP_MODES = ("auto", "on", "off")
#: The default of `--compile-budget-s`: a shape after the first gets its graph only when the
#: graphs so far took at most this many seconds to build.
DEFAULT_COMPILE_BUDGET_S = 25.0
#: The most tokens of one chunk a forward computes by default (`PagedLlama.compute`). Pieces
#: cost time: a later piece's attention is masked over its whole context, where one causal
#: pass skips the blocks above the diagonal; so a chat prompt of a couple of thousand tokens
#: runs whole, and a longer one in pieces whose activations stay small
#: (docs/performance.md#attention-kernels).
DEFAULT_PREFILL_CHUNK_TOKENS = 2048


class AttentionKernel(enum.Enum):
    """Which implementation computes the attention (`PagedLlama.attention`)."""

    GATHER = "gather"
    SDPA = "sdpa"


def device_type(device: str) -> str:
    """The type of a torch device string, as `torch.device(device).type` gives it: "cuda" of "cuda:1"."""
    return device.split(":", 1)[0]
