"""Render chat messages to prompt token ids with the tokenizer's own chat template."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from specdec.errors import InvalidArgumentError


def encode_chat(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Mapping[str, str]]) -> list[int]:
    """Token ids of `messages` rendered with the chat template, ending in the assistant turn's opening."""
    if not messages:
        raise InvalidArgumentError("chat: at least one message is required", field="chat")
    if tokenizer.chat_template is None:
        raise InvalidArgumentError("chat: the target tokenizer has no chat template; send a plain prompt", field="chat")
    conversation = [dict(message) for message in messages]
    rendered: Any = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
    # transformers 5 returns a BatchEncoding here, 4.x a plain list.
    ids = rendered["input_ids"] if isinstance(rendered, Mapping) or hasattr(rendered, "keys") else rendered
    return [int(t) for t in ids]
