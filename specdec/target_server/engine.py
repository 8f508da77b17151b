"""The target engine: batched prefill and batched verification over the paged KV cache."""

from __future__ import annotations

import itertools
import time
import typing
from collections.abc import Mapping

import torch

from specdec.errors import CapacityExhaustedError, InvalidArgumentError, SlotExistsError
from specdec.model.forward_batch import StepShape
from specdec.model.runtime import ModelRuntime
from specdec.sampling.draws import drawn_tokens, pick_tokens, position_generator, sample
from specdec.sampling.logprobs import RowLogprobs, answer_rows
from specdec.sampling.params import SamplingParams
from specdec.sampling.rejection_sampler import PLACEHOLDER_TOKEN_ID, draw_candidates, token_probs
from specdec.sampling.transforms import chunk_logits_to_probs, logits_to_probs, stack_chunks
from specdec.serving.engine import ModelEngine
from specdec.target_server.config import TargetConfig
from specdec.tuning.threads import one_thread
from specdec.wire.items import (
    ArgmaxMode,
    DecodeMode,
    DrawnMode,
    Lease,
    LogitsMode,
    PrefillItem,
    SampledMode,
    ScoredChunk,
    VerifiedArgmax,
    VerifiedChunk,
    VerifiedDecode,
    VerifiedDrawn,
    VerifiedLogits,
    VerifiedSampled,
    VerifyItem,
    requested_logprobs,
)


class TargetEngine(ModelEngine):
    """The verifier: scores prompts and draft chunks, K+1 positions per request in one pass."""

    def __init__(self, runtime: ModelRuntime, config: TargetConfig) -> None:
        super().__init__(runtime, config)
        self.tuner.note("batch_invariant", config.batch_invariant, "flag")
        if config.batch_invariant:
            tokens, blocks = config.max_speculative_tokens + 1, -(-self.max_seq_len // self.cache.block_size)
            invariant = self.model.fixed_shape(config.invariant_batch, tokens, blocks)
            # Where no width is position-invariant, the shape as asked: then only equal positions are bit-exact.
            self.step_shape = invariant or StepShape(config.invariant_batch, tokens, blocks)
            self.tuner.note("invariant_step_tokens", self.step_shape.tokens, "measured",
                            f"{tokens} needed; rows {'' if invariant else 'not '}position-invariant")

    def prefill(self, items: list[PrefillItem], lease: Lease | None = None) -> list[ScoredChunk]:
        """Allocate a slot per prompt (held under `lease`) and return the logits at each
        prompt's last position."""
        self._check_batch([item.slot_id for item in items])
        self.leases.check(lease)
        for item in items:
            if item.slot_id in self.tokens:
                raise SlotExistsError(f"slot_id: slot {item.slot_id!r} already exists")
            if not item.prompt_tokens:
                raise InvalidArgumentError(f"prompt_tokens: slot {item.slot_id!r} has an empty prompt",
                                           field="prompt_tokens")
            self._check_tokens("prompt_tokens", item.slot_id, item.prompt_tokens)
            self._check_length(item.slot_id, len(item.prompt_tokens), "prompt_tokens")
            self._check_max_len(item.slot_id, item.max_len)
        self._check_new_slots(len(items))
        slot_ids = [item.slot_id for item in items]
        prompts = {item.slot_id: list(item.prompt_tokens) for item in items}
        max_lens = {item.slot_id: item.max_len for item in items}
        holder = lease.holder if lease is not None else None
        self._check_reserved_room(prompts, holder, max_lens)
        rest = self._allocate(prompts, lease, max_lens)
        try:
            logits = self._run([(slot_id, rest[slot_id]) for slot_id in slot_ids], logits="last")
        except BaseException as error:
            self._free_quietly(slot_ids)
            if isinstance(error, CapacityExhaustedError):  # it waits for room: the pool is shared now
                self.reservations.refused(holder)
            raise
        self.reservations.admitted(holder)
        return [ScoredChunk(item.slot_id, row, len(self.tokens[item.slot_id])) for item, row in zip(items, logits)]

    def _check_reserved_room(self, prompts: Mapping[str, list[int]], holder: str | None,
                             max_lens: Mapping[str, int]) -> None:
        """In a pool shared with another holder, new slots of `holder` must fit at their
        whole length (their `max_lens`, at least their prompts) in the free blocks beyond every
        slot's reserved growth (`specdec.serving.reservations`); a refused holder is marked
        waiting. Here alone: admission is at the target (a draft's slot follows its target's)."""
        kept = self.kept_free(holder)
        if not kept:
            return
        blocks = self.cache.blocks
        needed = sum(-(-max(max_lens.get(slot_id, 0), len(prompt)) // blocks.block_size)
                     for slot_id, prompt in prompts.items())
        if needed > blocks.num_free_blocks - kept:
            self.reservations.refused(holder)
            raise CapacityExhaustedError(
                f"KV pool (shared): {len(prompts)} new slot(s) need {needed} blocks at their whole length; "
                f"{blocks.num_free_blocks} are free, {kept} of them reserved for requests already running to grow "
                "into", resource="kv_blocks",
            )

    def verify(self, items: list[VerifyItem], deadline: float | None = None) -> list[VerifiedChunk]:
        """Roll each slot back to valid_len, then score [g, t1..tK] for all requests in ONE forward
        and answer each item as its mode says (one method per mode). Row i of an item's logits is
        the target's prediction after tokens[0..i]: p_1..p_K judge the draft tokens and p_{K+1}
        gives the bonus token. `deadline` (a `time.monotonic` instant) bounds Decode items' steps.
        """
        self._check_batch([item.slot_id for item in items])
        for item in items:
            self._check_verify_item(item)
        # Rolling back only drops entries the caller declared invalid; the appends below are
        # all-or-nothing, so a capacity error leaves every slot at its valid prefix.
        for item in items:
            self._rollback(item.slot_id, item.valid_len)
        rows = self._run([(item.slot_id, list(item.tokens)) for item in items], logits="all", prompt=False)
        raw = {item.slot_id: r for item, r in zip(items, rows)}  # [K+1, vocab] each
        scored = [(item, _masked(item, r)) for item, r in zip(items, rows)]
        try:
            answers = {
                **self._answer_logits([(i, r) for i, r in scored if isinstance(i.mode, LogitsMode)]),
                **self._answer_argmax([(i, r) for i, r in scored if isinstance(i.mode, ArgmaxMode)], raw),
                **self._answer_sampled([(i, r) for i, r in scored if isinstance(i.mode, SampledMode)], raw),
                **self._answer_decode([(i, r) for i, r in scored if isinstance(i.mode, DecodeMode)], raw, deadline),
                **self._answer_drawn([(i, r) for i, r in scored if isinstance(i.mode, DrawnMode)], raw),
            }
        except BaseException:
            for item in items:
                self._rollback(item.slot_id, item.valid_len)
            raise
        if any(len(item.tokens) > 1 for item in items):
            self._hand_over()  # draft tokens were judged: the draft proposes next
        return [answers[item.slot_id] for item in items]

    def _check_verify_item(self, item: VerifyItem) -> None:
        self._check_rollback(item.slot_id, item.valid_len, "valid_len")
        if not item.tokens:
            raise InvalidArgumentError(f"tokens: slot {item.slot_id!r} sent no tokens (need [g, t1..tK])",
                                       field="tokens")
        k = len(item.tokens) - 1
        limit = self.config.max_speculative_tokens
        if k > limit:
            raise InvalidArgumentError(
                f"tokens: slot {item.slot_id!r} sent K={k} draft tokens, above max_speculative_tokens {limit}",
                field="tokens"
            )
        self._check_tokens("tokens", item.slot_id, item.tokens)
        match item.mode:
            case SampledMode(sampling=sampling, draft_probs=draft_probs):
                self._check_sampling(item.slot_id, sampling)
                if k == 0:
                    raise InvalidArgumentError(f"mode: slot {item.slot_id!r} is sampled with no draft tokens",
                                               field="mode")
                draft_probs.check_drafted(list(item.tokens[1:]), self.vocab_size,
                                          f"draft_probs of slot {item.slot_id!r}")
            case DrawnMode(sampling=sampling):
                self._check_sampling(item.slot_id, sampling)
                if k == 0:
                    raise InvalidArgumentError(f"mode: slot {item.slot_id!r} is drawn with no draft tokens",
                                               field="mode")
            case DecodeMode(steps=steps, sampling=sampling):
                if sampling is not None:
                    self._check_sampling(item.slot_id, sampling)
                if k > 0:
                    raise InvalidArgumentError(f"mode: slot {item.slot_id!r} decodes on after {k} draft tokens",
                                               field="mode")
                if not 1 <= steps <= limit + 1:
                    raise InvalidArgumentError(
                        f"steps: {steps} for slot {item.slot_id!r}, need 1 to max_speculative_tokens + 1 = {limit + 1}",
                        field="steps"
                    )
        if item.allowed is not None:
            rows = 1 if isinstance(item.mode, DecodeMode) else len(item.tokens)
            if isinstance(item.mode, DecodeMode) and item.mode.steps != 1:
                raise InvalidArgumentError(f"steps: slot {item.slot_id!r} decodes {item.mode.steps} steps under a "
                                           "grammar mask, which covers one (the gateway advances the grammar)",
                                           field="steps")
            item.allowed.check(rows, self.vocab_size, f"allowed of slot {item.slot_id!r}")
        self._check_length(item.slot_id, item.cached_len_after)

    def _answer_logits(self, scored: list[tuple[VerifyItem, torch.Tensor]]) -> dict[str, VerifiedChunk]:
        return {item.slot_id: VerifiedLogits(item.slot_id, self._cached(item), rows) for item, rows in scored}

    def _answer_argmax(self, scored: list[tuple[VerifyItem, torch.Tensor]], raw: Raw) -> dict[str, VerifiedChunk]:
        """Each row's argmax (`torch.argmax`: the lowest index among equal maxima, as the
        gateway's argmax over the same logits), with one device-to-host copy for the batch."""
        if not scored:
            return {}
        best = iter(torch.cat([rows.argmax(dim=-1) for _, rows in scored]).tolist())
        tokens = [list(itertools.islice(best, len(item.tokens))) for item, _ in scored]
        logprobs = self._logprobs(scored, tokens, raw)
        return {
            item.slot_id: VerifiedArgmax(item.slot_id, self._cached(item), answer, logprobs[item.slot_id])
            for (item, _), answer in zip(scored, tokens)
        }

    def _answer_sampled(self, scored: list[tuple[VerifyItem, torch.Tensor]], raw: Raw) -> dict[str, VerifiedChunk]:
        """For each item and its logits [K + 1, vocab]: p, the logits with the item's transforms
        (the penalties' context growing through the draft tokens), the K + 1 candidates
        (`rejection_sampler.draw_candidates`, each with the generator of its sequence position)
        and p_i(t_i) [K]. One batch."""
        if not scored:
            return {}
        modes = [typing.cast(SampledMode, item.mode) for item, _ in scored]
        k_max = max(len(item.tokens) for item, _ in scored) - 1
        vocab = scored[0][1].shape[-1]
        device = scored[0][1].device
        drafts = torch.full((len(scored), k_max), PLACEHOLDER_TOKEN_ID, dtype=torch.int64,
                            device=device)  # [S, K_max]: the placeholder past each K, as the gateway pads
        for b, (item, _) in enumerate(scored):
            drafts[b, : len(item.tokens) - 1] = torch.tensor(item.tokens[1:], device=drafts.device)
        q = torch.cat([m.draft_probs.distributions(vocab, extra_rows=1, device=drafts.device) for m in modes])
        with one_thread():  # a top-p sort on two threads stalls when another process holds a core
            p, rows, generators = self._position_probs(scored, [mode.sampling for mode in modes])
            candidates = iter(drawn_tokens(draw_candidates(rows, q, generators)))  # [sum(K_b+1)]
        p_drafts = token_probs(p, drafts).tolist()  # [S, K_max]
        answers = [list(itertools.islice(candidates, len(item.tokens))) for item, _ in scored]
        logprobs = self._logprobs(scored, answers, raw)
        return {
            item.slot_id: VerifiedSampled(item.slot_id, self._cached(item), answers[b],
                                          p_drafts[b][: len(item.tokens) - 1], logprobs[item.slot_id])
            for b, (item, _) in enumerate(scored)
        }

    def _answer_drawn(self, scored: list[tuple[VerifyItem, torch.Tensor]], raw: Raw) -> dict[str, VerifiedChunk]:
        """For each item and its logits [K + 1, vocab]: each row's draw from p with the generator
        of its sequence position, the token plain decoding draws there (`_choose`). One batch."""
        if not scored:
            return {}
        with one_thread():  # as in `_answer_sampled`
            _, rows, generators = self._position_probs(
                scored, [typing.cast(DrawnMode, item.mode).sampling for item, _ in scored])
            draws = iter(drawn_tokens(sample(rows, generators)))  # [sum(K_b+1)]
        answers = [list(itertools.islice(draws, len(item.tokens))) for item, _ in scored]
        logprobs = self._logprobs(scored, answers, raw)
        return {
            item.slot_id: VerifiedDrawn(item.slot_id, self._cached(item), answer, logprobs[item.slot_id])
            for (item, _), answer in zip(scored, answers)
        }

    def _position_probs(
        self, scored: list[tuple[VerifyItem, torch.Tensor]], params: list[SamplingParams]
    ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Generator | None]]:
        """p of every item's rows under its transforms, the penalty context growing through the
        draft tokens (row 0's is the slot's cached tokens through g): padded [S, K_max+1, vocab]
        and flat [sum(K_b+1), vocab], with each flat row's `position_generator`."""
        k_max = max(len(item.tokens) for item, _ in scored) - 1
        logits = stack_chunks([rows for _, rows in scored], k_max + 1)  # [S, K_max+1, vocab]
        context = [self.tokens[item.slot_id][: item.valid_len + 1] for item, _ in scored]
        p = chunk_logits_to_probs(logits, params, context, [item.tokens[1:] for item, _ in scored])
        rows = torch.cat([p[b, : len(item.tokens)] for b, (item, _) in enumerate(scored)])  # [sum(K_b+1), vocab]
        generators = [position_generator(params[b], item.valid_len + 1 + i, rows.device)
                      for b, (item, _) in enumerate(scored) for i in range(len(item.tokens))]
        return p, rows, generators

    def _answer_decode(self, scored: list[tuple[VerifyItem, torch.Tensor]], raw: Raw,
                       deadline: float | None) -> dict[str, VerifiedChunk]:
        """Plain decoding on the target: each item's first token from its verify row, then
        one-token forwards batched across the items that want more, each feeding the token
        chosen last, until every item has its `steps` tokens.

        The steps only save calls, so they must never turn a slow call into a failed one: with
        less than twice the slowest step so far left before `deadline`, decoding stops and
        each item returns the tokens it has (its cached length says how many).
        """
        if not scored:
            return {}
        items = [item for item, _ in scored]
        chosen = {item.slot_id: [token]
                  for item, token in zip(items, self._choose(items, torch.cat([r for _, r in scored])))}
        logprobs = {slot: [rows] for slot, rows
                    in self._logprobs(scored, [chosen[i.slot_id] for i in items], raw).items()}
        slowest = 0.0
        for step in range(1, max(typing.cast(DecodeMode, item.mode).steps for item in items)):
            if deadline is not None and time.monotonic() + 2 * slowest > deadline:
                break
            started = time.monotonic()
            active = [item for item in items if typing.cast(DecodeMode, item.mode).steps > step]
            rows = self._run([(item.slot_id, [chosen[item.slot_id][-1]]) for item in active], logits="last",
                             prompt=False)
            for item, token in zip(active, self._choose(active, torch.stack(rows))):  # rows: [vocab] each
                chosen[item.slot_id].append(token)
            stepped = [(item, row[None]) for item, row in zip(active, rows)]  # no mask: one step a grammar
            step_logprobs = self._logprobs(stepped, [chosen[item.slot_id][-1:] for item in active],
                                           {item.slot_id: row for item, row in stepped})
            for slot, step_rows in step_logprobs.items():
                logprobs[slot].append(step_rows)
            slowest = max(slowest, time.monotonic() - started)
        return {
            item.slot_id: VerifiedDecode(item.slot_id, self._cached(item), chosen[item.slot_id],
                                         self._joined(logprobs[item.slot_id]))
            for item in items
        }

    @staticmethod
    def _joined(steps: list[RowLogprobs | None]) -> RowLogprobs | None:
        return None if steps[0] is None else RowLogprobs.concat([s for s in steps if s is not None])

    def _logprobs(self, scored: list[tuple[VerifyItem, torch.Tensor]], answers: list[list[int]],
                  raw: Raw) -> dict[str, RowLogprobs | None]:
        """Per item, its rows' logprobs when its mode asks (`LogprobsRequest`), else None: the
        draft tokens' and the `answers`' (one per row) and each row's top alternatives, one batch
        for the items that ask. Row 0's penalty context is the slot's tokens through the item's
        first token g, and it grows through the draft tokens row by row, as p's does. Raw logprobs
        come from the `raw` rows, transformed ones from the grammar-masked rows in `scored`."""
        out: dict[str, RowLogprobs | None] = {item.slot_id: None for item, _ in scored}
        asking = [(item, rows if request.transforms is not None else raw[item.slot_id], answer, request)
                  for (item, rows), answer in zip(scored, answers)
                  if (request := requested_logprobs(item.mode)) is not None]
        if not asking:
            return out
        context = [self.tokens[item.slot_id][: len(self.tokens[item.slot_id]) - rows.shape[0] + 1]
                   for item, rows, _, _ in asking]
        with one_thread():  # as in `_answer_sampled`
            answered = answer_rows([rows for _, rows, _, _ in asking], [r for *_, r in asking], context,
                                   [item.tokens[1:] for item, *_ in asking], [a for _, _, a, _ in asking])
        out.update({item.slot_id: rows for (item, *_), rows in zip(asking, answered)})
        return out

    def _choose(self, items: list[VerifyItem], rows: torch.Tensor) -> list[int]:
        """The next token of each Decode item from its last logits row (`rows` [n, vocab]): the
        raw argmax without sampling params, else the transforms over the slot's cached tokens,
        then the argmax or a draw with `position_generator` (a seed per sequence position)."""
        tokens = rows.argmax(dim=-1)  # [n]
        modes = [typing.cast(DecodeMode, item.mode) for item in items]
        sampled = [(n, mode.sampling) for n, mode in enumerate(modes) if mode.sampling is not None]
        if sampled:
            params = [p for _, p in sampled]
            context = [self.tokens[items[n].slot_id] for n, _ in sampled]
            index = torch.tensor([n for n, _ in sampled], device=rows.device)  # [s]
            generators = [position_generator(p, len(c), rows.device) for p, c in zip(params, context)]
            with one_thread():  # as in `_answer_sampled`
                probs = logits_to_probs(rows.index_select(0, index), params, context)  # [s, vocab]
                tokens = tokens.index_copy(0, index, pick_tokens(probs, params, generators))
        return drawn_tokens(tokens)  # one host sync a step

    def _cached(self, item: VerifyItem) -> int:
        return len(self.tokens[item.slot_id])


#: Each item's logits rows before its grammar mask, by slot: what raw logprobs are computed from.
Raw = dict[str, torch.Tensor]


def _masked(item: VerifyItem, rows: torch.Tensor) -> torch.Tensor:
    """`rows` [K+1, vocab] under the item's grammar mask; a Logits answer stays raw (the gateway,
    which holds the masks, applies them with the request's other transforms)."""
    if item.allowed is None or isinstance(item.mode, LogitsMode):
        return rows
    return item.allowed.apply(rows)
