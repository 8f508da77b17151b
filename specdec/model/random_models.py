"""Llama models by configuration, with random weights: `random:llama-3.2-3b`, `random:llama-3.2-1b`.

The architectures are the published Llama-3.2 configs written out here (vocabulary, widths,
GQA, head sizes, `llama3` RoPE scaling, tied embeddings), so the real shapes can be built,
served and timed where no weights can be downloaded. A name may carry a seed,
`random:llama-3.2-1b:seed=7` (no seed: seed 0).

Every tensor is drawn from its own generator, seeded by the model's seed and the tensor's
name: two builds of the same name on the same device type hold the same weights, a
first-N-layer build holds exactly the full build's first N layers, and a bfloat16 build holds
the float32 build's weights rounded (each tensor is drawn in float32, then cast).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from specdec.errors import InvalidArgumentError

if TYPE_CHECKING:  # imported where used: they pull in transformers' modelling code, which a gateway never needs
    from transformers import LlamaConfig, LlamaForCausalLM

RANDOM_PREFIX = "random:"
#: `random:<architecture>` or `random:<architecture>:seed=<n>`.
_NAME = re.compile(r"random:([a-z0-9.-]+)(?::seed=([0-9]+))?", re.ASCII)
_MAX_SEED = 2**63 - 1

#: The `llama3` RoPE scaling of every Llama 3.1 / 3.2 text model.
LLAMA3_ROPE: dict[str, float | str] = {
    "rope_type": "llama3",
    "rope_theta": 500_000.0,
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

#: The Llama 3 chat format (header, message, end of turn), without the published Llama-3.2
#: template's tool calls and dated default system message: the pip tokenizer ships no template.
LLAMA3_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim }}"
    "{{- '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)


@dataclass(frozen=True)
class RandomArchitecture:
    """A Llama architecture's config values; the defaults are those Llama-3.2-1B and -3B share."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int = 128_256
    tie_word_embeddings: bool = True
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 131_072
    bos_token_id: int = 128_000
    eos_token_ids: tuple[int, ...] = (128_001, 128_008, 128_009)
    initializer_range: float = 0.02
    #: The embedded tokenizer (`specdec.model.loader.EMBEDDED_TOKENIZERS`) its token ids belong to.
    tokenizer: str = "llama-3.2"

    def config(self, num_layers: int = 0) -> LlamaConfig:
        """The `transformers` config, with only the first `num_layers` decoder layers (0 = all)."""
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=num_layers or self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim, hidden_act="silu",
            max_position_embeddings=self.max_position_embeddings, rms_norm_eps=self.rms_norm_eps,
            rope_parameters=dict(LLAMA3_ROPE), tie_word_embeddings=self.tie_word_embeddings,
            bos_token_id=self.bos_token_id, eos_token_id=list(self.eos_token_ids),
            initializer_range=self.initializer_range,
        )


#: The published Llama-3.2 text models (their config.json files), by the name after `random:`.
ARCHITECTURES: dict[str, RandomArchitecture] = {
    "llama-3.2-1b": RandomArchitecture(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64,
    ),
    "llama-3.2-3b": RandomArchitecture(
        hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
        num_key_value_heads=8, head_dim=128,
    ),
}


@dataclass(frozen=True)
class RandomModelSpec:
    """What a `random:` model name says: an architecture of `ARCHITECTURES` and a seed."""

    architecture: str
    seed: int = 0

    @classmethod
    def parse(cls, name: str) -> RandomModelSpec | None:
        """The spec `name` describes; None for a name without the `random:` prefix."""
        if not name.startswith(RANDOM_PREFIX):
            return None
        match = _NAME.fullmatch(name)
        if match is None or match[1] not in ARCHITECTURES:
            raise InvalidArgumentError(
                f"model {name!r}: expected random:<architecture>[:seed=<n>] with an architecture of "
                f"{sorted(ARCHITECTURES)}", field="model"
            )
        seed = int(match[2] or 0)
        if seed > _MAX_SEED:
            raise InvalidArgumentError(f"model {name!r}: the seed must be at most {_MAX_SEED}", field="model")
        return cls(match[1], seed)

    @property
    def name(self) -> str:
        """The canonical name: the same for `random:x` and `random:x:seed=0`."""
        return f"{RANDOM_PREFIX}{self.architecture}:seed={self.seed}"

    @property
    def definition(self) -> RandomArchitecture:
        return ARCHITECTURES[self.architecture]


def build_random_model(
    architecture: RandomArchitecture, seed: int, *, dtype: torch.dtype, device: torch.device | str,
    num_layers: int = 0,
) -> LlamaForCausalLM:
    """A Llama of `architecture` (its first `num_layers` decoder layers; 0 = all) in eval mode,
    its weights drawn on `device` in `dtype` by `fill_random_`.

    Built on the meta device first, so no memory is touched by `transformers`' own
    initialisation: only the weights the model keeps are ever allocated, and each once.
    """
    if not 0 <= num_layers <= architecture.num_hidden_layers:
        raise InvalidArgumentError(
            f"num_layers must be in [1, {architecture.num_hidden_layers}] (or 0: all), got {num_layers}",
            field="num_layers"
        )
    from transformers import LlamaForCausalLM

    config = architecture.config(num_layers)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.to(dtype)  # type: ignore[arg-type]  # transformers types `to` through a decorator that loses its signature
    model.to_empty(device=device)
    if config.tie_word_embeddings:  # to_empty gives each module its own tensor: tie them again
        model.lm_head.weight = model.model.embed_tokens.weight
    # The rotary inverse frequencies are computed, not loaded: compute them again (in fp32, as
    # `transformers` keeps them), since to_empty left the meta tensors' memory uninitialised.
    model.model.rotary_emb = type(model.model.rotary_emb)(config).to(device)
    fill_random_(model, seed, architecture.initializer_range)
    model.eval()
    model.requires_grad_(False)
    return model


def fill_random_(model: nn.Module, seed: int, std: float) -> None:
    """Set every norm weight to 1 and draw every other parameter from normal(0, `std`), as
    Llama initialises them. Each parameter is drawn in fp32 on its own device from a generator
    seeded by `tensor_seed(seed, name)`, then cast to its dtype."""
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):  # tied parameters once, by their first name
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            generator = torch.Generator(device=param.device).manual_seed(tensor_seed(seed, name))
            if param.dtype == torch.float32:
                param.normal_(0.0, std, generator=generator)
            else:
                param.copy_(torch.empty_like(param, dtype=torch.float32).normal_(0.0, std, generator=generator))


def tensor_seed(seed: int, name: str) -> int:
    """The seed of one parameter's generator: a stable hash of the model's seed and the parameter's name."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & _MAX_SEED


def with_llama3_chat_template(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """`tokenizer`, given the Llama 3 chat format when it has no chat template of its own."""
    if tokenizer.chat_template is None:
        tokenizer.chat_template = LLAMA3_CHAT_TEMPLATE
    return tokenizer
