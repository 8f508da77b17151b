"""The target engine: batched prefill and batched verification over the paged KV cache."""

from __future__ import annotations

import itertools
import time

import torch

from specdec.errors import InvalidArgumentError, SlotExistsError
from specdec.model.threads import one_thread
from specdec.sampling.rejection_sampler import draw_candidates, token_probs
from specdec.sampling.transforms import chunk_logits_to_probs, logits_to_probs, pick_tokens, position_generator
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
        rest = self._allocate({item.slot_id: list(item.prompt_tokens) for item in items}, lease)
        try:
            logits = self._run([(slot_id, rest[slot_id]) for slot_id in slot_ids], logits="last")
        except BaseException:
            self._free_quietly(slot_ids)
            raise
        return [ScoredChunk(item.slot_id, row, len(self.tokens[item.slot_id])) for item, row in zip(items, logits)]

    def verify(self, items: list[VerifyItem], deadline: float | None = None) -> list[VerifiedChunk]:
        """Roll each slot back to valid_len, then score [g, t1..tK] for all requests in ONE forward.

        Row i of a result is the target's logits after tokens[0..i]: p_1..p_K judge the draft
        tokens and p_{K+1} gives the bonus token. K = 0 is plain decoding. An `argmax_only`
        item gets each row's argmax instead (`torch.argmax`: the lowest index among equal
        maxima, the same as the gateway's argmax over the same logits). A plain item with
        `sampling` gets the token those transforms choose (`_choose`); a speculative one (with
        `draft_probs`) its K + 1 candidates and p_i(t_i) (`_candidates`). A multi-step item
        (`decode_steps` n > 1) then decodes on by itself: n - 1 more one-token forwards, batched
        across such items, each feeding the token chosen last; it gets all n tokens, or fewer
        (at least one) when another step would not finish before `deadline` (a `time.monotonic`
        instant: the call's own deadline).
        """
        self._check_batch([item.slot_id for item in items])
        for item in items:
            self._check_verify_item(item)
        # Rolling back only drops entries the caller declared invalid; the appends below are
        # all-or-nothing, so a capacity error leaves every slot at its valid prefix.
        for item in items:
            self._rollback(item.slot_id, item.valid_len)
        logits = self._run([(item.slot_id, list(item.tokens)) for item in items], logits="all", prompt=False)  # [K+1, vocab] each
        wanted = [rows.argmax(dim=-1) for item, rows in zip(items, logits) if item.argmax_only]  # [K+1] each
        argmax = iter(torch.cat(wanted).tolist() if wanted else [])  # one device-to-host copy for the batch
        chosen = {item.slot_id: list(itertools.islice(argmax, len(item.tokens))) for item in items if item.argmax_only}
        sampled = [(item, rows) for item, rows in zip(items, logits) if item.sampling is not None and item.draft_probs is None]
        if sampled:
            picks = self._choose([item for item, _ in sampled], torch.cat([rows for _, rows in sampled]))
            chosen.update({item.slot_id: [token] for (item, _), token in zip(sampled, picks)})
        speculative = [(item, rows) for item, rows in zip(items, logits) if item.draft_probs is not None]
        target_probs = self._candidates(speculative, chosen) if speculative else {}
        if any(item.decode_steps > 1 for item in items):
            try:
                self._decode_on([item for item in items if item.decode_steps > 1], chosen, deadline)
            except BaseException:
                for item in items:
                    self._rollback(item.slot_id, item.valid_len)
                raise
        if any(len(item.tokens) > 1 for item in items):
            self._hand_over()  # draft tokens were judged: the draft proposes next
        return [
            VerifiedChunk(item.slot_id, len(self.tokens[item.slot_id]), chosen=chosen[item.slot_id],
                          target_probs=target_probs.get(item.slot_id))
            if item.target_chooses
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
        if item.sampling is not None and (item.argmax_only or (k > 0) != (item.draft_probs is not None)):
            raise InvalidArgumentError(
                f"sampling: slot {item.slot_id!r} asked the target to choose with its sampling params; that takes "
                "draft_probs with draft tokens (K > 0) and none without, and excludes argmax_only"
            )
        if item.draft_probs is not None:
            if item.sampling is None:
                raise InvalidArgumentError(f"draft_probs: slot {item.slot_id!r} sent q without sampling params")
            item.draft_probs.check_drafted(list(item.tokens[1:]), self.vocab_size, f"draft_probs of slot {item.slot_id!r}")
        if item.decode_steps > 1:
            if not item.target_chooses or k > 0:
                raise InvalidArgumentError(
                    f"decode_steps: slot {item.slot_id!r} asked for {item.decode_steps} steps; multi-step decoding "
                    "needs a single token (K = 0) and argmax_only or sampling"
                )
            if item.decode_steps > self.config.max_speculative_tokens + 1:
                raise InvalidArgumentError(
                    f"decode_steps: {item.decode_steps} for slot {item.slot_id!r} is above max_speculative_tokens + 1 "
                    f"= {self.config.max_speculative_tokens + 1}"
                )
        self._check_length(item.slot_id, item.cached_len_after)

    def _choose(self, items: list[VerifyItem], rows: torch.Tensor) -> list[int]:
        """The next token of each item from its last logits row (`rows` [n, vocab]): the argmax
        for `argmax_only`, else `sampling`'s transforms over the slot's cached tokens, then the
        argmax or a draw, with the draw's `position_generator` (a seed per sequence position)."""
        tokens = rows.argmax(dim=-1)  # [n]
        sampled = [(n, item.sampling) for n, item in enumerate(items) if item.sampling is not None]
        if sampled:
            params = [p for _, p in sampled]
            context = [self.tokens[items[n].slot_id] for n, _ in sampled]
            index = torch.tensor([n for n, _ in sampled], device=rows.device)  # [s]
            generators = [position_generator(p, len(c), rows.device) for p, c in zip(params, context)]
            with one_thread():  # a top-p sort on two threads stalls for ~100 ms when another process holds a core
                probs = logits_to_probs(rows.index_select(0, index), params, context)  # [s, vocab]
                tokens = tokens.index_copy(0, index, pick_tokens(probs, params, generators))
        return tokens.tolist()  # one host sync a step

    def _candidates(self, items: list[tuple[VerifyItem, torch.Tensor]], chosen: dict[str, list[int]]) -> dict[str, list[float]]:
        """For each sampled speculative item and its logits [K + 1, vocab]: p, the logits with
        the item's transforms (the repetition-penalty context growing through the draft
        tokens); its K + 1 candidates into `chosen` (`rejection_sampler.draw_candidates`, each
        with the generator of its sequence position); and p_i(t_i) [K], returned. One batch."""
        k_max = max(len(item.tokens) for item, _ in items) - 1
        vocab = items[0][1].shape[-1]
        logits = items[0][1].new_zeros(len(items), k_max + 1, vocab)  # [S, K_max+1, vocab]
        drafts = torch.zeros(len(items), k_max, dtype=torch.int64, device=logits.device)  # [S, K_max], 0 past each K
        q, params = [], []
        for b, (item, item_logits) in enumerate(items):
            assert item.sampling is not None and item.draft_probs is not None  # a sampled speculative item
            logits[b, : item_logits.shape[0]] = item_logits
            drafts[b, : len(item.tokens) - 1] = torch.tensor(item.tokens[1:], device=logits.device)
            q.append(item.draft_probs.distributions(vocab, extra_rows=1, device=logits.device))  # [K_b+1, vocab]
            params.append(item.sampling)
        # The context of row 0 is the slot's cached tokens up to and including g.
        context = [self.tokens[item.slot_id][: item.valid_len + 1] for item, _ in items]
        with one_thread():  # as in `_choose`
            p = chunk_logits_to_probs(logits, params, context, [item.tokens[1:] for item, _ in items])  # [S, K_max+1, vocab]
            rows = torch.cat([p[b, : len(item.tokens)] for b, (item, _) in enumerate(items)])  # [sum(K_b+1), vocab]
            generators = [position_generator(params[b], item.valid_len + 1 + i, rows.device)
                          for b, (item, _) in enumerate(items) for i in range(len(item.tokens))]
            candidates = draw_candidates(rows, torch.cat(q), generators).tolist()  # [sum(K_b+1)]
        p_drafts = token_probs(p, drafts).tolist()  # [S, K_max]
        out = {}
        for b, (item, _) in enumerate(items):
            k = len(item.tokens) - 1
            chosen[item.slot_id] = candidates[:k + 1]
            candidates = candidates[k + 1:]
            out[item.slot_id] = p_drafts[b][:k]
        return out

    def _decode_on(self, items: list[VerifyItem], chosen: dict[str, list[int]], deadline: float | None) -> None:
        """Steps after the verify forward until each item has `decode_steps` tokens in `chosen`;
        step j feeds every item that still needs a token the one chosen last.

        Multi-step only saves calls, so it must never turn a slow call into a failed one: with
        less than twice the slowest step so far left before `deadline`, it stops, and each
        item returns the tokens it has (its cached length says so). Measured on 2 cores while
        a draft service restarted beside the target: 4-step Verify calls of 8 requests took
        up to 9-10 s against 0.1-0.7 s before, and one overran the gateway's 10 s deadline.
        """
        slowest = 0.0
        for step in range(1, max(item.decode_steps for item in items)):
            if deadline is not None and time.monotonic() + 2 * slowest > deadline:
                return
            started = time.monotonic()
            active = [item for item in items if item.decode_steps > step]
            rows = self._run([(item.slot_id, [chosen[item.slot_id][-1]]) for item in active], logits="last", prompt=False)  # [vocab] each
            for item, token in zip(active, self._choose(active, torch.stack(rows))):
                chosen[item.slot_id].append(token)
            slowest = max(slowest, time.monotonic() - started)
