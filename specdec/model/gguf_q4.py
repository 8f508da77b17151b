"""Read a GGUF checkpoint's Q4_0 / Q4_1 linear weights as `Int4Weight`s, without dequantizing.

llama.cpp stores each linear layer in blocks of 32 weights with an fp16 scale d (and, for
Q4_1, an fp16 min m) and 4-bit codes: exactly the ``scale * q + zero`` form of
`Int4Weight`. Reading the blocks as they are lets the int4 draft compute with the very
weights the target was dequantized from, so its acceptance approaches 1.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from specdec.errors import InvalidArgumentError
from specdec.model.int4_weight import Int4Weight
from specdec.model.loader import building, gguf_cache_dir

log = logging.getLogger(__name__)

#: GGUF tensor name suffix -> transformers module path inside ``model.layers.N``.
_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.weight")
_Q4_BLOCK = 32  # elements per Q4_0 / Q4_1 block


def gguf_parameter_name(gguf_name: str) -> str | None:
    """The transformers parameter name of a GGUF linear weight, or None for other tensors."""
    if gguf_name == "output.weight":
        return "lm_head.weight"
    match = _GGUF_NAME.fullmatch(gguf_name)
    if match is None or match[2] not in _GGUF_LAYER_NAMES:
        return None
    return f"model.layers.{match[1]}.{_GGUF_LAYER_NAMES[match[2]]}.weight"


def rope_unpermute_rows(rows: int, n_head: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's RoPE permutation of attn_q / attn_k.

    This is transformers' ``LlamaTensorProcessor._reverse_permute_weights``:
    ``w.reshape(n_head, rows // n_head // 2, 2, in).swapaxes(1, 2)``, written as a row gather.
    """
    if rows % (2 * n_head):
        raise InvalidArgumentError(f"{rows} rows do not split into {n_head} heads of (dim/2, 2)")
    return torch.arange(rows).reshape(n_head, rows // n_head // 2, 2).transpose(1, 2).reshape(-1)  # [rows]


def _decode_q4_blocks(data: np.ndarray, in_features: int, *, has_min: bool) -> Int4Weight:
    """Q4_0 / Q4_1 bytes [out, blocks * bytes_per_block] -> `Int4Weight`.

    Each block is fp16 d, then (Q4_1 only) fp16 m, then 16 bytes of codes. The low nibbles hold
    elements 0..15 of the block and the high nibbles hold 16..31. Q4_1 is ``w = d * q + m``, and
    Q4_0 is ``w = d * (q - 8)``, i.e. ``zero = -8 * d``.
    """
    out = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(out, in_features // _Q4_BLOCK, -1)  # [out, groups, bytes]
    d = torch.from_numpy(np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0].astype(np.float32))
    start = 4 if has_min else 2
    if has_min:
        zeros = torch.from_numpy(np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0].astype(np.float32))
    else:
        zeros = -8.0 * d  # exact: a power-of-two multiple
    nibbles = torch.from_numpy(np.ascontiguousarray(blocks[..., start:start + _Q4_BLOCK // 2]))  # [out, groups, 16]
    q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).reshape(out, in_features)  # [out, in]
    return Int4Weight(q, d, zeros, _Q4_BLOCK)  # d, zeros: [out, groups]


def gguf_int4_weights(gguf_path: Path | str, config: Any, cache_dir: Path | str | None = None) -> dict[str, Int4Weight]:
    """`read_gguf_int4_weights`, kept in the GGUF's cache directory after the first read.

    Parsing a GGUF file means parsing all its metadata, the tokenizer's vocabulary included,
    which takes seconds (docs/performance.md#model-loading); the cached codes, scales and zeros
    load in a fraction of one. The file name records the head counts, which decide the row
    order of attn_q and attn_k.
    """
    n_head, n_kv_head = _head_counts(config)
    path = gguf_cache_dir(Path(gguf_path), cache_dir) / f"int4-blocks-h{n_head}-kv{n_kv_head}.safetensors"
    if not path.is_file():
        with building(path):  # processes starting together parse it once
            if not path.is_file():
                return _read_and_cache(gguf_path, config, path)
    tensors = load_file(path)
    names = sorted({key.rsplit(".", 1)[0] for key in tensors})
    return {
        name: Int4Weight(tensors[f"{name}.q"], tensors[f"{name}.scales"], tensors[f"{name}.zeros"], _Q4_BLOCK)
        for name in names
    }


def _read_and_cache(gguf_path: Path | str, config: Any, path: Path) -> dict[str, Int4Weight]:
    """`read_gguf_int4_weights`, also written to `path` (a warning where it cannot be)."""
    weights = read_gguf_int4_weights(gguf_path, config)
    tensors = {f"{name}.{part}": getattr(w, part).contiguous()
               for name, w in weights.items() for part in ("q", "scales", "zeros")}
    staging: Path | None = None
    try:  # written aside and renamed: a crash never leaves half a file under the real name
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, name = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
        os.close(handle)
        staging = Path(name)
        save_file(tensors, str(staging))
        os.chmod(staging, 0o644)  # mkstemp makes it private; the cache may be shared by services
        os.replace(staging, path)
    except OSError as error:
        log.warning("could not cache the int4 blocks of %s in %s: %s", gguf_path, path, error)
        if staging is not None:
            staging.unlink(missing_ok=True)
    return weights


def _head_counts(config: Any) -> tuple[int, int]:
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    n_head = int(text_config.num_attention_heads)
    return n_head, int(getattr(text_config, "num_key_value_heads", None) or n_head)


def read_gguf_int4_weights(gguf_path: Path | str, config: Any) -> dict[str, Int4Weight]:
    """The GGUF file's Q4_0 / Q4_1 linear weights, read from their own blocks without
    dequantizing. The result is keyed by transformers parameter name.

    Tensors in other formats are left out (callers quantize those from float). attn_q and attn_k
    rows are put back into transformers' order with the heads from ``config``
    (``num_attention_heads`` and ``num_key_value_heads``), as transformers' GGUF loader does.
    """
    import gguf  # optional dependency: only needed for GGUF sources

    reader = gguf.GGUFReader(gguf_path)
    arch_field = reader.fields.get("general.architecture")
    arch = arch_field.contents() if arch_field is not None else None
    if arch != "llama":
        raise InvalidArgumentError(f"{gguf_path}: int4 GGUF import supports llama checkpoints, not {arch!r}")
    n_head, n_kv_head = _head_counts(config)
    q4_types = {gguf.GGMLQuantizationType.Q4_0: False, gguf.GGMLQuantizationType.Q4_1: True}
    weights: dict[str, Int4Weight] = {}
    for tensor in reader.tensors:
        name = gguf_parameter_name(tensor.name)
        if name is None or tensor.tensor_type not in q4_types:
            continue
        in_features = int(tensor.shape[0])  # GGUF lists dimensions innermost first: ne = [in, out]
        weight = _decode_q4_blocks(tensor.data, in_features, has_min=q4_types[tensor.tensor_type])
        if ".attn_q." in tensor.name:
            weight = weight.permute_rows(rope_unpermute_rows(weight.out_features, n_head))
        elif ".attn_k." in tensor.name:
            weight = weight.permute_rows(rope_unpermute_rows(weight.out_features, n_kv_head))
        weights[name] = weight
    return weights
