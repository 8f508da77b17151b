"""Tokenizer facts two services must agree on before their tokens are interchangeable."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from transformers import PreTrainedTokenizerBase

from specdec.errors import SpecdecError

if TYPE_CHECKING:  # the model classes' import is heavy, and a gateway only reads tokenizers
    from transformers import PreTrainedModel


class TokenizerMismatchError(SpecdecError):
    """Draft and target tokenize differently: speculation between them would be wrong."""

    status_code_name = "FAILED_PRECONDITION"


@dataclass(frozen=True)
class TokenizerInfo:
    """Vocabulary width, end-of-sequence ids and a fingerprint of the token strings."""

    vocab_size: int
    eos_token_ids: tuple[int, ...]
    fingerprint: str

    @classmethod
    def of(cls, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> TokenizerInfo:
        return cls(
            vocab_size=int(model.config.vocab_size),
            eos_token_ids=eos_token_ids(model, tokenizer),
            fingerprint=tokenizer_fingerprint(tokenizer),
        )


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """SHA-256 over every token string in id order (added tokens included)."""
    digest = hashlib.sha256()
    for token in tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))):
        digest.update((token if token is not None else "\0").encode("utf-8", "surrogatepass"))
        digest.update(b"\n")
    return digest.hexdigest()


def eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """Union of the generation config's EOS ids and the tokenizer's, sorted."""
    ids: set[int] = set()
    generation_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for source in (generation_eos, model.config.eos_token_id, tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif source is not None:
            ids.update(int(i) for i in source)
    return tuple(sorted(ids))


def check_compatible(draft: TokenizerInfo, target: TokenizerInfo, names: tuple[str, str] = ("draft", "target")) -> None:
    """Raise TokenizerMismatchError naming the first difference between two tokenizers
    (called `names` in the message)."""
    a, b = names
    if draft.vocab_size != target.vocab_size:
        raise TokenizerMismatchError(f"vocab size differs: {a} {draft.vocab_size}, {b} {target.vocab_size}")
    if draft.eos_token_ids != target.eos_token_ids:
        raise TokenizerMismatchError(
            f"EOS token ids differ: {a} {list(draft.eos_token_ids)}, {b} {list(target.eos_token_ids)}"
        )
    if draft.fingerprint != target.fingerprint:
        raise TokenizerMismatchError(
            f"tokenizer fingerprints differ: {a} {draft.fingerprint[:12]}…, {b} {target.fingerprint[:12]}…"
        )
