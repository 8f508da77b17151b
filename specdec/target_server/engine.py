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
        maxima, the same as the gateway's argmax over the same logits). A multi-step item
        (`decode_steps` n > 1) then decodes on by itself: n - 1 more one-token forwards, batched
        across such items, each feeding the previous argmax; it gets all n argmax tokens.
        """
        self._check_batch([item.slot_id for item in items])
        for item in items:
            self._check_verify_item(item)
        # Rolling back only drops entries the caller declared invalid; the appends below are
        # all-or-nothing, so a capacity error leaves every slot at its valid prefix.
        for item in items:
            self._rollback(item.slot_id, item.valid_len)
        logits = self._run([(item.slot_id, list(item.tokens)) for item in items], logits="all")  # [K+1, vocab] each
        wanted = [rows.argmax(dim=-1) for item, rows in zip(items, logits) if item.argmax_only]  # [K+1] each
        argmax = iter(torch.cat(wanted).tolist() if wanted else [])  # one device-to-host copy for the batch
        chosen = {item.slot_id: list(itertools.islice(argmax, len(item.tokens))) for item in items if item.argmax_only}
        if any(item.decode_steps > 1 for item in items):
            try:
                self._decode_on([item for item in items if item.decode_steps > 1], chosen)
            except BaseException:
                for item in items:
                    self._rollback(item.slot_id, item.valid_len)
                raise
        if any(len(item.tokens) > 1 for item in items):
            self._hand_over()  # draft tokens were judged: the draft proposes next
        return [
            VerifiedChunk(item.slot_id, len(self.tokens[item.slot_id]), argmax=chosen[item.slot_id])
            if item.argmax_only
            else VerifiedChunk(item.slot_id, len(self.tokens[item.slot_id]), logits=rows)
            for item, rows in zip(items, logits)
        ]

    def _check_verify_item(self, item: VerifyItem) -> None:
        self._check_rollback(item.slot_id, item.valid_len, "valid_len")
        if not item.tokens:
            raise InvalidArgumentError(f"tokens: slot {item.slot_id!r} sent no tokens (need [g, t1..tK])")
        k = len(item.tokens) - 1
        if k > self.config.max_speculative_tokens:
            raise InvalidArgumentError(
                f"tokens: slot {item.slot_id!r} sent K={k} draft tokens, above max_speculative_tokens {self.config.max_speculative_tokens}"
            )
        self._check_tokens("tokens", item.slot_id, item.tokens)
        if item.decode_steps > 1:
            if not item.argmax_only or k > 0:
                raise InvalidArgumentError(
                    f"decode_steps: slot {item.slot_id!r} asked for {item.decode_steps} steps; multi-step decoding "
                    "needs argmax_only and a single token (K = 0)"
                )
            if item.decode_steps > self.config.max_speculative_tokens + 1:
                raise InvalidArgumentError(
                    f"decode_steps: {item.decode_steps} for slot {item.slot_id!r} is above max_speculative_tokens + 1 "
                    f"= {self.config.max_speculative_tokens + 1}"
                )
        self._check_length(item.slot_id, item.cached_len_after)

    def _decode_on(self, items: list[VerifyItem], chosen: dict[str, list[int]]) -> None:
        """Greedy steps after the verify forward until each item has `decode_steps` tokens in
        `chosen`; step j feeds every item that still needs a token its last one."""
        for step in range(1, max(item.decode_steps for item in items)):
            active = [item.slot_id for item in items if item.decode_steps > step]
            rows = self._run([(slot, [chosen[slot][-1]]) for slot in active], logits="last")  # [vocab] each
            for slot, token in zip(active, torch.stack(rows).argmax(dim=-1).tolist()):  # one host sync a step
                chosen[slot].append(token)
