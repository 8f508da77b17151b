"""The tool format of the served model: the one its chat template points to, unless the
gateway's `--tool-call-parser` names one."""

from __future__ import annotations

import logging

from transformers import PreTrainedTokenizerBase

from specdec.gateway.tools.formats import ToolFormat
from specdec.gateway.tools.hermes import Hermes
from specdec.gateway.tools.llama3_json import Llama3Json

log = logging.getLogger(__name__)

FORMATS: dict[str, type[ToolFormat]] = {"hermes": Hermes, "llama3_json": Llama3Json}
#: `--tool-call-parser` choices: a format's name, or `auto` (from the chat template).
PARSER_CHOICES = ("auto", *FORMATS)
#: A marker of the Llama 3 chat format (its role headers).
LLAMA3_MARKER = "<|start_header_id|>"


def choose_format(tokenizer: PreTrainedTokenizerBase, parser: str = "auto") -> ToolFormat:
    """`parser`'s format, or for `auto` the chat template's: Llama 3's role headers ->
    llama3_json; anything else (ChatML's `<|im_start|>`, no template) -> hermes."""
    if parser == "auto":
        template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
        parser = "llama3_json" if LLAMA3_MARKER in template else "hermes"
        log.info("tool calls in the %s format (chosen from the chat template)", parser)
    return FORMATS[parser]()
