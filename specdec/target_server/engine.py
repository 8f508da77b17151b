"""The target engine: batched prefill and batched verification over the paged KV cache."""

from __future__ import annotations

import itertools

import torch

from specdec.errors import InvalidArgumentError, SlotExistsError
from specdec.serving.engine import ModelEngine
from specdec.wire.items import Lease, PrefillItem, ScoredChunk, VerifiedChunk, VerifyItem


class TargetEngine(ModelEngine):
    """The verifier: scores prompts and draft chunks, K+1 positions per request in one pass."""

    def prefill(self, items: list[PrefillItem], lease: Lease | None = None) -> list[ScoredChunk]:
        """Allocate a slot per prompt (held under `lease`) and return the logits at each
        prompt's last position."""
        self._check_batch([item.slot_id for item in items])
        self.leases.check(lease)
        for item in items:
            if item.slot_id in self.tokens:
                raise SlotExistsError(f"slot_id: slot {item.slot_id!r} already exists")
            if not item.prompt_tokens:
                raise InvalidArgumentError(f"prompt_tokens: slot {item.slot_id!r} has an empty prompt")
            self._check_tokens("prompt_tokens", item.slot_id, item.prompt_tokens)
            self._check_length(item.slot_id, len(item.prompt_tokens), "prompt_tokens")
        self._check_new_slots(len(items))
        slot_ids = [item.slot_id for item in items]
        self._allocate(slot_ids, lease)
        try:
            logits = self._run([(item.slot_id, list(item.prompt_tokens)) for item in items], logits="last")
        except BaseException:
            self._free_quietly(slot_ids)
            raise
        return [ScoredChunk(item.slot_id, row, len(self.tokens[item.slot_id])) for item, row in zip(items, logits)]

    def verify(self, items: list[VerifyItem]) -> list[VerifiedChunk]:
        """Roll each slot back to valid_len, then score [g, t1..tK] for all requests in ONE forward.

        Row i of a result is the target's logits after tokens[0..i]: p_1..p_K judge the draft
        tokens and p_{K+1} gives the bonus token. K = 0 is plain decoding. An `argmax_only`
        item gets each row's argmax instead (`torch.argmax`: the lowest index among equal
        maxima, the same as the gateway's argmax over the same logits).
        """
        self._check_batch([item.slot_id for item in items])
        for item in items:
            self._check_rollback(item.slot_id, item.valid_len, "valid_len")
            if not item.tokens:
                raise InvalidArgumentError(f"tokens: slot {item.slot_id!r} sent no tokens (need [g, t1..tK])")
            k = len(item.tokens) - 1
            if k > self.config.max_speculative_tokens:
                raise InvalidArgumentError(
                    f"tokens: slot {item.slot_id!r} sent K={k} draft tokens, above max_speculative_tokens {self.config.max_speculative_tokens}"
                )
            self._check_tokens("tokens", item.slot_id, item.tokens)
            self._check_length(item.slot_id, item.valid_len + len(item.tokens))
        # Rolling back only drops entries the caller declared invalid; the append below is
        # all-or-nothing, so a capacity error leaves every slot at its valid prefix.
        for item in items:
            self._rollback(item.slot_id, item.valid_len)
        logits = self._run([(item.slot_id, list(item.tokens)) for item in items], logits="all")  # [K+1, vocab] each
        wanted = [rows.argmax(dim=-1) for item, rows in zip(items, logits) if item.argmax_only]  # [K+1] each
        argmax = iter(torch.cat(wanted).tolist() if wanted else [])  # one device-to-host copy for the batch
        if any(len(item.tokens) > 1 for item in items):
            self._hand_over()  # draft tokens were judged: the draft proposes next
        return [
            VerifiedChunk(item.slot_id, len(self.tokens[item.slot_id]), argmax=list(itertools.islice(argmax, len(item.tokens))))
            if item.argmax_only
            else VerifiedChunk(item.slot_id, len(self.tokens[item.slot_id]), logits=rows)
            for item, rows in zip(items, logits)
        ]
