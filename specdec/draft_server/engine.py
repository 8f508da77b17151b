"""The draft engine: lazy prefill, implicit rollback and K autoregressive drafting steps.

Each drafting step is one batched forward across every request still drafting. A request
may bring a guess at its next tokens (a lookup's): fed with its new tokens in the first
forward, each guessed token the draft draws anyway saves it a step. With `lookup_guesses`
the draft also guesses on its own: wherever no guess is left to check, it looks its text up
in the slot's earlier tokens (`specdec.prompt_lookup`) and feeds what followed there with the
token it has just drawn, so a copy resumes after every token the answer changes. Tokens
are sampled from q, the request's transformed distribution, with a per-slot generator
(seeded once per slot), so a seeded request drafts the same tokens whatever it is batched
with. q is cut to the tokens that carry its mass (`sparse_probs.cut_tail`) and rounded to
the wire dtype before the token is drawn from it, so acceptance judges each token against
exactly the distribution it was drawn from. A structured-output request's rows are masked by its
grammar before anything else (`grammars`), and the tokens its grammar forces are its guess.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.draft_server.config import DraftConfig
from specdec.draft_server.grammars import DraftGrammars, SlotGrammar, masked
from specdec.errors import InvalidArgumentError
from specdec.grammar import GrammarCompiler
from specdec.model.runtime import ModelRuntime
from specdec.prompt_lookup import PromptLookupIndex
from specdec.sampling.draws import drawn_tokens, make_generator, pick_tokens, position_generator
from specdec.sampling.sparse_probs import SparseRows, cut_tail
from specdec.sampling.transforms import logits_to_probs
from specdec.serving.call_merger import split
from specdec.serving.engine import ModelEngine
from specdec.wire.items import Lease, Proposal, ProposeItem


class DraftEngine(ModelEngine):
    """The proposer: keeps its own cache per slot and drafts k tokens per request."""

    def __init__(self, runtime: ModelRuntime, config: DraftConfig) -> None:
        super().__init__(runtime, config)
        #: Each unseeded slot's random stream, advanced across rounds (a seeded request draws each
        #: position with its own generator, `position_generator`).
        self.generators: dict[str, torch.Generator] = {}
        #: The n-grams of each slot's accepted tokens, for its own guesses (`lookup_guesses`).
        self.lookups: dict[str, PromptLookupIndex] = {}
        self.guess_tokens, self.guess_min_match = config.lookup_guess_tokens, config.lookup_guess_min_match
        #: Structured-output slots' grammars, walked with the draft's own tokenizer.
        self.grammars = DraftGrammars(GrammarCompiler(runtime.loaded.tokenizer, self.tokenizer_info.vocab_size,
                                                      self.tokenizer_info.eos_token_ids))

    def release(self, slot_id: str) -> None:
        super().release(slot_id)
        self.generators.pop(slot_id, None)
        self.lookups.pop(slot_id, None)
        self.grammars.release(slot_id)

    def propose(
        self, items: list[ProposeItem], probs_dtype: torch.dtype = torch.float32, lease: Lease | None = None
    ) -> list[Proposal]:
        """Roll back, feed new tokens (whole prompt for unseen slots, held under `lease`) and the
        guesses that fit, then draft k tokens each."""
        return self.propose_together([(items, lease)], probs_dtype)[0]

    def propose_together(
        self, calls: Sequence[tuple[list[ProposeItem], Lease | None]], probs_dtype: torch.dtype = torch.float32
    ) -> list[list[Proposal]]:
        """`propose` for several calls (several gateways') in one batch: each call's new slots
        are held under its own lease; the proposals come back per call. All or nothing."""
        items = [item for call_items, _ in calls for item in call_items]
        new_slots = self._validate(items)
        for _, lease in calls:
            self.leases.check(lease)
        accepted = [self.tokens.get(item.slot_id, [])[: item.valid_len] + item.new_tokens for item in items]
        # A new slot's new_tokens are its whole prompt (valid_len 0): it feeds what the prefix cache lacks.
        feeds = {item.slot_id: list(item.new_tokens) for item in items}
        try:
            for call_items, lease in calls:
                fresh = [item for item in call_items if item.slot_id in new_slots]
                feeds.update(self._allocate({item.slot_id: feeds[item.slot_id] for item in fresh}, lease,
                                            {item.slot_id: item.max_len for item in fresh}))
            for item in items:  # a slot an import created has none yet either
                if item.sampling.seed is None and item.slot_id not in self.generators:
                    self.generators[item.slot_id] = make_generator(None, self.cache.device)
            for item in items:
                if item.slot_id not in new_slots:
                    self._rollback(item.slot_id, item.valid_len)
            walks = [self.grammars.walk(item.slot_id, item.grammar, tokens, item.valid_len, item.stop_token_ids)
                     for item, tokens in zip(items, accepted)]
            guesses = [self._fed_guess(item, feeds[item.slot_id], len(items), walk)
                       for item, walk in zip(items, walks)]
            logits = self._feed([(item.slot_id, feeds[item.slot_id] + guess.tokens)
                                 for item, guess in zip(items, guesses)],
                                [1 + len(guess.tokens) for guess in guesses])
            proposals = self._draft(items, logits, guesses, walks, probs_dtype)
        except BaseException:
            self._free_quietly(new_slots)
            raise
        finally:
            self.grammars.end_drafts()
        self._hand_over()  # the target verifies next
        return split(proposals, [len(call_items) for call_items, _ in calls])

    def _fed_guess(self, item: ProposeItem, feed: list[int], batch: int, walk: SlotGrammar | None) -> Guess:
        """The guessed tokens fed with `feed`: the tokens the grammar forces, else the item's
        guess, else with `lookup_guesses` the draft's own over the accepted text (which it
        indexes here); all but the K-th (the last drafted token is never fed), and none after a
        prompt-sized feed (`_is_short`), whose forward would have to score every position."""
        if item.lookup_guesses:
            self._index(item.slot_id, self.tokens[item.slot_id] + feed)
        if not self._is_short(len(feed)):
            return Guess([])
        if walk is not None and (forced := walk.forced(item.num_speculative_tokens - 1)):
            return Guess(forced, GuessKind.FORCED)
        if item.guess_tokens:
            return Guess(item.guess_tokens[: item.num_speculative_tokens - 1], GuessKind.GATEWAY)
        return Guess(self._own_guess(item, feed, min(self.guess_tokens // batch, item.num_speculative_tokens - 1)))

    def _index(self, slot_id: str, accepted: list[int]) -> None:
        """Index the slot's accepted tokens (they only grow: `_rollback` drops an index it cuts)."""
        self.lookups.setdefault(slot_id, PromptLookupIndex()).update(accepted)

    def _rollback(self, slot_id: str, valid_len: int) -> None:
        super()._rollback(slot_id, valid_len)
        index = self.lookups.get(slot_id)
        if index is not None and index.indexed > valid_len:  # a gateway's rollback past accepted tokens
            del self.lookups[slot_id]

    def _own_guess(self, item: ProposeItem, after: list[int], limit: int) -> list[int]:
        """Up to `limit` tokens that followed the end of the slot's cached tokens and `after`
        earlier in its accepted tokens, where the real match is at least
        `lookup_guess_min_match` tokens; none without `lookup_guesses`."""
        index = self.lookups.get(item.slot_id) if item.lookup_guesses else None
        if index is None or limit <= 0:
            return []
        match = index.propose([*self.tokens[item.slot_id], *after], limit)
        return list(match.tokens) if match is not None and match.match_len >= self.guess_min_match else []

    def _is_short(self, feed_len: int) -> bool:
        """At most what a round can add (K + 1 tokens): not a prompt."""
        return feed_len <= self.config.max_speculative_tokens + 1

    def _feed(self, chunks: list[tuple[str, list[int]]], tails: list[int]) -> list[torch.Tensor]:
        """The logits of each chunk's last `tails[i]` positions after feeding it ([tails[i], vocab]),
        in chunk order.

        Lazy prefills (whole prompts) and the usual few accepted tokens (with a guess) run as
        separate forwards: padded into one [B, T] batch, every short feed would pay for the
        longest prompt's width. The short feeds run as a step, as the drafting steps do (on
        CUDA, replayed from a graph: an eager forward there costs a few graph replays).
        """
        short = [self._is_short(len(tokens) - tail + 1) for (_, tokens), tail in zip(chunks, tails)]
        groups = [[i for i in range(len(chunks)) if short[i]], [i for i in range(len(chunks)) if not short[i]]]
        out: list[torch.Tensor | None] = [None] * len(chunks)
        for group, prompt in zip(groups, (False, True)):
            if group:
                every = any(tails[i] > 1 for i in group)
                rows = self._run([chunks[i] for i in group], logits="all" if every else "last", prompt=prompt)
                for i, row in zip(group, rows):
                    out[i] = row[-tails[i]:] if every else row[None]
        return [row for row in out if row is not None]

    def _validate(self, items: list[ProposeItem]) -> list[str]:
        """Check the whole batch; return the slot ids seen for the first time."""
        self._check_batch([item.slot_id for item in items])
        new_slots = []
        for item in items:
            if item.slot_id in self.tokens:
                self._check_rollback(item.slot_id, item.valid_len, "valid_len")
            elif item.valid_len != 0:
                raise InvalidArgumentError(
                    f"valid_len: slot {item.slot_id!r} is new to the draft, so valid_len must be 0 "
                    f"(got {item.valid_len})", field="valid_len"
                )
            else:
                new_slots.append(item.slot_id)
                self._check_max_len(item.slot_id, item.max_len)
            if not item.new_tokens:
                raise InvalidArgumentError(f"new_tokens: slot {item.slot_id!r} sent none "
                                           "(at least the last accepted token is needed)", field="new_tokens")
            self._check_tokens("new_tokens", item.slot_id, item.new_tokens)
            self._check_tokens("guess_tokens", item.slot_id, item.guess_tokens)
            self._check_tokens("stop_token_ids", item.slot_id, item.stop_token_ids)
            if len(item.guess_tokens) > item.num_speculative_tokens:
                raise InvalidArgumentError(f"guess_tokens: {len(item.guess_tokens)} for slot {item.slot_id!r}, more "
                                           f"than its num_speculative_tokens ({item.num_speculative_tokens})",
                                           field="guess_tokens")
            self._check_sampling(item.slot_id, item.sampling)
            if item.grammar is not None:
                _check_grammar(item)
            if not 1 <= item.num_speculative_tokens <= self.config.max_speculative_tokens:
                raise InvalidArgumentError(f"num_speculative_tokens: {item.num_speculative_tokens} for slot "
                                           f"{item.slot_id!r} is outside [1, {self.config.max_speculative_tokens}]",
                                           field="num_speculative_tokens")
            self._check_length(item.slot_id, item.valid_len + len(item.new_tokens), "new_tokens")
            # The k-th drafted token is returned but not cached: its position must still fit.
            self._check_length(item.slot_id, item.valid_len + len(item.new_tokens) + item.num_speculative_tokens,
                               "num_speculative_tokens")
        self._check_new_slots(len(new_slots))
        return new_slots

    def _draft(
        self, items: list[ProposeItem], logits: list[torch.Tensor], guesses: list[Guess],
        walks: list[SlotGrammar | None], probs_dtype: torch.dtype,
    ) -> list[Proposal]:
        """K draws per item, one batched step at a time. `logits[i]` holds item i's next-token
        logits after its feed and after each of its fed guessed tokens ([1 + len(guesses[i]), vocab]):
        while the drawn tokens equal the guess the next row is already there, and the first draw
        that differs drops the rest of the guess from the cache and is fed as usual, with a
        guess of the draft's own where the item allows one (`_step_guesses`). An item stops at
        its first drawn stop token, which like a K-th token is not fed. A structured-output
        item's `walks` entry masks its draws and moves past each drawn token."""
        drafted: list[list[int]] = [[] for _ in items]
        q_rows: list[list[torch.Tensor]] = [[] for _ in items]
        saved, forced = [0] * len(items), [0] * len(items)  # steps the guesses saved: lookups', grammars'
        own_fed, forced_fed = [0] * len(items), [0] * len(items)
        for i, guess in enumerate(guesses):
            guess.count(i, own_fed, forced_fed)
        pending = {i: list(rows.unbind(0)) for i, rows in enumerate(logits)}  # item -> its next rows, [vocab] each
        unchecked = dict(enumerate(guesses))  # item -> its fed guessed tokens not drawn yet, one a pending row
        limits = [item.num_speculative_tokens for item in items]  # cut to the step of a drawn stop token
        stops = [frozenset(item.stop_token_ids) for item in items]
        for step in range(max(limits)):
            rows = [i for i in range(len(items)) if limits[i] > step]
            if not rows:
                break
            positions = [len(self.tokens[items[i].slot_id]) - len(pending[i]) + 1 for i in rows]
            step_logits = masked(torch.stack([pending[i].pop(0) for i in rows]), [walks[i] for i in rows])
            tokens, probs = self._draw(items, rows, positions, step_logits, probs_dtype)
            feed = []
            for n, (i, token) in enumerate(zip(rows, tokens)):
                drafted[i].append(token)
                if probs is not None and not items[i].sampling.is_greedy:
                    q_rows[i].append(probs[n])
                if token in stops[i]:
                    limits[i] = step + 1
                if (walk := walks[i]) is not None and limits[i] > step + 1:
                    walk.draw(token, items[i].stop_token_ids)
                if unchecked[i].tokens and token == unchecked[i].tokens[0] and limits[i] > step + 1:
                    unchecked[i] = unchecked[i].rest()  # the guess holds: its next row is this token's successor
                    (forced if unchecked[i].kind is GuessKind.FORCED else saved)[i] += 1
                    continue
                if unchecked[i].tokens:  # the guess parted here, or the item stops: its tokens from here on go
                    self._rollback(items[i].slot_id, positions[n])
                    pending[i], unchecked[i] = [], Guess([])
                if limits[i] > step + 1:  # the last drafted token is not fed
                    feed.append(i)
            if feed:
                unchecked.update(self._step_guesses(items, feed, drafted, step, walks))
                for i in feed:
                    unchecked[i].count(i, own_fed, forced_fed)
                every = any(unchecked[i].tokens for i in feed)
                chunks = [(items[i].slot_id, [drafted[i][-1], *unchecked[i].tokens]) for i in feed]
                out = self._run(chunks, logits="all" if every else "last", prompt=False)
                pending.update((i, list(rows.unbind(0)) if every else [rows]) for i, rows in zip(feed, out))
        return [
            Proposal(
                slot_id=item.slot_id,
                tokens=drafted[i],
                probs=SparseRows.from_dense(torch.stack(q_rows[i]).to(probs_dtype)) if q_rows[i] else None,
                cached_len=len(self.tokens[item.slot_id]),
                saved_steps=saved[i],
                own_guess_tokens=own_fed[i],
                forced_steps=forced[i],
                forced_tokens=forced_fed[i],
            )
            for i, item in enumerate(items)
        ]

    def _step_guesses(
        self, items: list[ProposeItem], feed: list[int], drafted: list[list[int]], step: int,
        walks: list[SlotGrammar | None],
    ) -> dict[int, Guess]:
        """The draft's own guess for each item of `feed` after its latest drawn token (the tokens
        its grammar forces, else its lookup's): at most the draws it has left but one, and at
        most `lookup_guess_tokens` // len(feed), since the step's forward pads every row to the widest."""
        share = self.guess_tokens // len(feed)
        guesses = {}
        for i in feed:
            limit = min(share, items[i].num_speculative_tokens - step - 2)
            walk = walks[i]
            forced = walk.forced(limit) if walk is not None else []
            guesses[i] = (Guess(forced, GuessKind.FORCED) if forced
                          else Guess(self._own_guess(items[i], drafted[i][-1:], limit)))
        return guesses

    def _draw(
        self, items: list[ProposeItem], rows: list[int], positions: list[int], step_logits: torch.Tensor,
        probs_dtype: torch.dtype,
    ) -> tuple[list[int], torch.Tensor | None]:
        """One token per row of `step_logits` ([n, vocab]) for items[rows[j]] at sequence position
        positions[j], and q ([n, vocab], None when every row is greedy by argmax)."""
        params = [items[i].sampling for i in rows]
        if all(p.greedy_by_raw_argmax for p in params):
            # Only argmax rows: no distribution to build (greedy rows send no q). In fp32: the
            # cast is exact and torch's CPU argmax is faster on fp32 than on bf16
            # (docs/performance.md#draft-argmax-in-fp32).
            return drawn_tokens(step_logits.float().argmax(dim=-1)), None  # one host sync per step
        # The tokens before each position: all of the slot's, except while a guess is cached past it.
        histories = [self.tokens[items[i].slot_id] for i in rows]
        context = [tokens if len(tokens) == position else tokens[:position]
                   for tokens, position in zip(histories, positions)]
        probs = cut_tail(logits_to_probs(step_logits, params, context))  # [n, vocab] f32
        probs = probs.to(probs_dtype).float()  # what the gateway will see; sample from exactly that
        # A seeded request's proposal for position j shares the uniform of the target's draw
        # there (`position_generator`): equal distributions then propose the target's token.
        generators = [position_generator(p, position, probs.device) or self.generators.get(items[i].slot_id)
                      for i, p, position in zip(rows, params, positions)]
        return drawn_tokens(pick_tokens(probs, params, generators)), probs


class GuessKind(enum.Enum):
    """Where a guess comes from: the draft's own lookup, the gateway's (`ProposeItem.guess_tokens`),
    or the tokens a grammar forces (certain: each is drawn)."""

    OWN = "own"
    GATEWAY = "gateway"
    FORCED = "forced"


@dataclass(frozen=True)
class Guess:
    """Tokens fed as a guess at the next draws."""

    tokens: list[int]
    kind: GuessKind = GuessKind.OWN

    def rest(self) -> Guess:
        return dataclasses.replace(self, tokens=self.tokens[1:])

    def count(self, item: int, own_fed: list[int], forced_fed: list[int]) -> None:
        """Add the tokens fed to the item's tally of its kind (the gateway's guesses are not counted)."""
        if self.kind is GuessKind.FORCED:
            forced_fed[item] += len(self.tokens)
        elif self.kind is GuessKind.OWN:
            own_fed[item] += len(self.tokens)


def _check_grammar(item: ProposeItem) -> None:
    """A grammar needs its text, and an answer that starts within the slot's tokens after the feed."""
    assert item.grammar is not None
    if not item.grammar.text:
        raise InvalidArgumentError(f"grammar.text: empty for slot {item.slot_id!r}", field="grammar.text")
    if not 0 <= item.grammar.start <= item.valid_len + len(item.new_tokens):
        raise InvalidArgumentError(f"grammar.start: {item.grammar.start} for slot {item.slot_id!r} is outside "
                                   f"[0, {item.valid_len + len(item.new_tokens)}]", field="grammar.start")
