"""Incremental, UTF-8-safe detokenization with stop strings.

Text is streamed as deltas of the decoded completion. Two kinds of tail are held back
until the next tokens decide them: an incomplete UTF-8 character (decoded as U+FFFD) and
any suffix that could be the start of a stop string — so a stop string split across
token boundaries is never partly emitted. The stop string itself is never emitted.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

REPLACEMENT_CHAR = "\ufffd"


@dataclass(frozen=True)
class TextUpdate:
    tokens: list[int]  # tokens taken, in order (excludes EOS and anything after a stop)
    text: str  # new text safe to emit
    stopped: bool  # an EOS token or a stop string ended the completion


class StopStringDetokenizer:
    """Feeds accepted tokens, returns what may be emitted, and detects EOS and stop strings."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: list[str], eos_token_ids: set[int]) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.eos_token_ids = eos_token_ids
        self.tokens: list[int] = []
        self.emitted = ""  # text sent so far

    def add(self, tokens: list[int]) -> TextUpdate:
        eos_at = next((i for i, t in enumerate(tokens) if t in self.eos_token_ids), len(tokens))
        taken = tokens[:eos_at]  # EOS and anything after it are never emitted
        before = len(self.tokens)
        self.tokens.extend(taken)
        text = self._text()
        if self._find_stop(text) is not None:
            # Keep only the tokens up to the one that completes the stop string. This re-decodes
            # prefixes, but only in the round that stops.
            for n in range(1, len(taken) + 1):
                self.tokens[before:] = taken[:n]
                prefix_text = self._text()
                cut = self._find_stop(prefix_text)
                if cut is not None:
                    return TextUpdate(taken[:n], self._flush(prefix_text[:cut]), True)
        if eos_at < len(tokens):
            return TextUpdate(taken, self._flush(text), True)
        safe = text.rstrip(REPLACEMENT_CHAR)  # an incomplete UTF-8 character waits for its bytes
        safe = safe[: len(safe) - self._partial_stop_len(safe)]
        return TextUpdate(taken, self._flush(safe), False)

    def finish(self) -> str:
        """Everything still held back (the completion ended for another reason)."""
        return self._flush(self._text())

    def _text(self) -> str:
        return str(self.tokenizer.decode(self.tokens, skip_special_tokens=True))

    def _flush(self, text: str) -> str:
        if not text.startswith(self.emitted):  # decoding is prefix-stable for byte-level BPE
            return ""
        delta = text[len(self.emitted):]
        self.emitted = text
        return delta

    def _find_stop(self, text: str) -> int | None:
        """Index of the earliest stop string in the not-yet-emitted tail of `text`, if any."""
        if not self.stop:
            return None
        start = max(0, len(self.emitted) - max(len(s) for s in self.stop) + 1)
        hits = [i for s in self.stop if (i := text.find(s, start)) != -1]
        return min(hits) if hits else None

    def _partial_stop_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that begins some stop string."""
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest
