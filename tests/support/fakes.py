"""Fake model services for unit tests of the gateway's own logic (no models, no gRPC server).

A toy language model over a 40-token vocabulary: after token t the target's greedy choice
is `next_token(t)`. Tokens 0..30 cycle among themselves and never reach EOS; tokens 31..38
count up to EOS (39), so a prompt ending in 35 generates 36, 37, 38 and stops. The fake
target keeps real per-slot caches and checks every valid length it is sent, like the real
service; the fake draft follows the same rule except at the draft positions it is told to
get wrong, so tests can steer acceptance exactly.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import torch

from specdec.cost_model import ForwardCost
from specdec.gateway.deadlines import Deadlines
from specdec.gateway.draft_sources import SpeculationMethod
from specdec.gateway.intake import RequestPolicy
from specdec.gateway.model_clients import Timed
from specdec.gateway.planner import Planner
from specdec.gateway.pools import PoolLimits
from specdec.gateway.proposers import LookupProposer
from specdec.gateway.scheduler import Scheduler
from specdec.gateway.stats import GatewayStats
from specdec.model.tokenizer_info import TokenizerInfo
from specdec.prompt_lookup import common_prefix_length
from specdec.sampling.draws import pick_tokens, position_generator, sample
from specdec.sampling.params import SamplingParams
from specdec.sampling.rejection_sampler import draw_candidates, token_probs
from specdec.sampling.sparse_probs import SparseRows
from specdec.sampling.transforms import chunk_logits_to_probs, logits_to_probs
from specdec.wire.items import (
    ArgmaxMode,
    DecodeMode,
    DrawnMode,
    LogitsMode,
    PrefillItem,
    Proposal,
    ProposeItem,
    SampledMode,
    ScoredChunk,
    VerifiedArgmax,
    VerifiedChunk,
    VerifiedDecode,
    VerifiedDrawn,
    VerifiedLogits,
    VerifiedSampled,
    VerifyItem,
)
from specdec.wire.model_info import ModelInfo
from tests.support.planner_rounds import still

VOCAB = 40
EOS = 39
_CYCLE = 31


def next_token(token: int) -> int:
    """The toy target's greedy continuation."""
    return (3 * token + 1) % _CYCLE if token < _CYCLE else min(token + 1, EOS)


def greedy_reference(prompt: list[int], n: int) -> list[int]:
    out = [next_token(prompt[-1])]
    while len(out) < n:
        out.append(next_token(out[-1]))
    return out


def decode_reference(context: list[int], n: int, sampling: SamplingParams | None) -> list[int]:
    """The n tokens a plain item decodes on the target after `context`: greedy, or chosen with
    `sampling` as the target chooses (a generator per position, seeded from the seed)."""
    if sampling is None:
        return greedy_reference(context, n)
    tokens = list(context)
    for _ in range(n):
        probs = logits_to_probs(logits_after(tokens[-1])[None], [sampling], [tokens])  # [1, vocab]
        generator = position_generator(sampling, len(tokens), "cpu")
        tokens.append(int(pick_tokens(probs, [sampling], [generator])[0]))
    return tokens[len(context):]


def logits_after(token: int) -> torch.Tensor:
    row = torch.zeros(VOCAB)  # [vocab]
    row[next_token(token)] = 10.0
    return row


async def until(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    """Yield to the event loop until `condition()` holds; fail after `timeout` seconds.

    For what the scheduler does in the background (a release, a retry): a fixed sleep before
    the assertion races a loaded machine, this waits as long as it takes."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        assert loop.time() < deadline, f"condition not met within {timeout} s"
        await asyncio.sleep(0.001)


async def _answer_within(delay_s: float, timeout: float) -> None:
    """Take `delay_s` like a real call (yielding to the event loop); past `timeout`, fail
    as gRPC does with DEADLINE_EXCEEDED."""
    await asyncio.sleep(min(delay_s, timeout))
    if delay_s > timeout:
        raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def model_info(max_speculative_tokens: int = 8, forward_costs: tuple[ForwardCost, ...] = ()) -> ModelInfo:
    return ModelInfo(
        model_id="toy", model_name="toy", tokenizer=TokenizerInfo(VOCAB, (EOS,), "toy"), max_seq_len=256,
        block_size=16, free_kv_tokens=4096, total_kv_tokens=4096, max_slots=64, active_slots=0,
        max_speculative_tokens=max_speculative_tokens, dtype="float32", device="cpu", quantization="",
        forward_costs=forward_costs,
    )


@dataclass
class FakeTarget:
    slots: dict[str, list[int]] = field(default_factory=dict)
    released: list[str] = field(default_factory=list)
    #: ("prefill" | "release", slot id) in the order they happened.
    events: list[tuple[str, str]] = field(default_factory=list)
    verify_batches: list[list[VerifyItem]] = field(default_factory=list)
    #: The tokens each Prefill sent, by slot id.
    prefilled: dict[str, list[int]] = field(default_factory=dict)
    #: Raise this from the next Verify.
    fail_verify: BaseException | None = None
    #: Seconds every Verify takes (a hung service when above the call's deadline).
    verify_delay_s: float = 0.0
    #: Seconds every Prefill takes.
    prefill_delay_s: float = 0.0
    #: Seconds every Release takes.
    release_delay_s: float = 0.0
    #: Slot ids of every Prefill, recorded as it starts.
    prefills_started: list[list[str]] = field(default_factory=list)
    #: When given, a Prefill waits for this event after it started (`open_gate` lets the
    #: waiting ones through), so a test can act "during a Prefill" without racing a timer.
    prefill_gate: asyncio.Event | None = None
    #: Fail this many Release calls with UNAVAILABLE before answering them.
    failing_releases: int = 0
    #: Decode at most this many tokens of a multi-step item, as the real target does when
    #: the call's deadline is near.
    max_decoded: int | None = None

    async def info(self, timeout: float = 120.0) -> ModelInfo:
        return model_info()

    async def serving(self, timeout: float) -> bool:
        return True

    async def renew_lease(self, timeout: float) -> int:
        return 0

    async def prefill(self, items: list[PrefillItem], timeout: float) -> Timed[dict[str, ScoredChunk]]:
        self.prefills_started.append([item.slot_id for item in items])
        if self.prefill_gate is not None:
            await self.prefill_gate.wait()
        await _answer_within(self.prefill_delay_s, timeout)
        out = {}
        for item in items:
            assert item.slot_id not in self.slots
            self.events.append(("prefill", item.slot_id))
            self.prefilled[item.slot_id] = list(item.prompt_tokens)
            self.slots[item.slot_id] = list(item.prompt_tokens)
            out[item.slot_id] = ScoredChunk(item.slot_id, logits_after(item.prompt_tokens[-1]), len(item.prompt_tokens))
        return Timed(out, 0.001, 0.002)

    def open_gate(self, *, for_good: bool = False) -> None:
        """Let the Prefills waiting at `prefill_gate` through; later ones wait again unless `for_good`."""
        assert self.prefill_gate is not None
        self.prefill_gate.set()
        if for_good:
            self.prefill_gate = None
        else:
            self.prefill_gate.clear()  # the woken waiters go on; the next Prefill waits

    async def verify(self, items: list[VerifyItem], timeout: float) -> Timed[dict[str, VerifiedChunk]]:
        await _answer_within(self.verify_delay_s, timeout)
        if self.fail_verify is not None:
            raise self.fail_verify
        self.verify_batches.append(items)
        out = {}
        for item in items:
            cache = self.slots[item.slot_id]
            assert 0 <= item.valid_len <= len(cache), (item, len(cache))
            del cache[item.valid_len :]
            cache.extend(item.tokens)
            rows = torch.stack([logits_after(t) for t in item.tokens])  # [K+1, vocab]
            out[item.slot_id] = self._answer(item, cache, rows)
        return Timed(out, 0.001, 0.002)

    def _answer(self, item: VerifyItem, cache: list[int], rows: torch.Tensor) -> VerifiedChunk:
        """The answer of the item's mode, as the real target computes it."""
        match item.mode:
            case SampledMode(sampling, draft_probs):  # candidates and p_i(t_i), as the target draws them
                assert len(item.tokens) > 1, item
                p, generators = _position_probs(item, cache, rows, sampling)
                candidates = draw_candidates(p, draft_probs.distributions(VOCAB, extra_rows=1), generators)
                target_probs = token_probs(p[None], torch.tensor([item.tokens[1:]]))[0].tolist()
                return VerifiedSampled(item.slot_id, len(cache), candidates.tolist(), target_probs)
            case DecodeMode(steps, sampling):  # decode on, caching all but the last token
                assert len(item.tokens) == 1, item
                decoded = decode_reference(cache, min(steps, self.max_decoded or steps), sampling)
                cache.extend(decoded[:-1])
                return VerifiedDecode(item.slot_id, len(cache), decoded)
            case ArgmaxMode():
                return VerifiedArgmax(item.slot_id, len(cache), rows.argmax(dim=-1).tolist())
            case DrawnMode(sampling):  # each row's draw from p, seeded by its position
                p, generators = _position_probs(item, cache, rows, sampling)
                return VerifiedDrawn(item.slot_id, len(cache), sample(p, generators).tolist())
            case LogitsMode():
                return VerifiedLogits(item.slot_id, len(cache), rows)

    async def release(self, slot_id: str, timeout: float) -> None:
        await asyncio.sleep(self.release_delay_s)
        if self.failing_releases > 0:
            self.failing_releases -= 1
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses")
        if self.slots.pop(slot_id, None) is None:
            raise rpc_error(grpc.StatusCode.NOT_FOUND, f"slot {slot_id!r} not found")
        self.released.append(slot_id)
        self.events.append(("release", slot_id))

    async def close(self) -> None:
        pass


def _position_probs(item: VerifyItem, cache: list[int], rows: torch.Tensor,
                    sampling: SamplingParams) -> tuple[torch.Tensor, list[torch.Generator | None]]:
    """p [K+1, vocab] of an item's rows (the penalty context growing through its draft tokens) and
    each row's position generator, as the real target computes them."""
    p = chunk_logits_to_probs(rows[None], [sampling], [cache[: item.valid_len + 1]], [item.tokens[1:]])[0]
    return p, [position_generator(sampling, item.valid_len + 1 + i, "cpu") for i in range(len(item.tokens))]


@dataclass
class FakeDraft:
    #: Draft positions (1-based within a round) at which the draft proposes a wrong token.
    wrong_at: set[int] = field(default_factory=set)
    slots: dict[str, list[int]] = field(default_factory=dict)
    released: list[str] = field(default_factory=list)
    #: Every Propose received, failed ones included.
    calls: list[list[ProposeItem]] = field(default_factory=list)
    #: Call number (1-based) at which `fault` strikes once, so it lands mid-stream whatever
    #: the scheduler's pace (a test polling for the right moment raced a short request's end):
    #: an error the call raises, how far off the cached length it reports (a draft that
    #: lost track of a slot), "bad_q": q rows that give the drafted tokens no chance, or
    #: "short": a token fewer than asked, with no stop token to end it.
    fault_on_call: int = 0
    fault: grpc.aio.AioRpcError | int | str | None = None
    #: Seconds every Propose takes (a hung draft when above the call's deadline), and what
    #: its health check says.
    propose_delay_s: float = 0.0
    healthy: bool = True
    health_checks: int = 0

    async def info(self, timeout: float = 120.0) -> ModelInfo:
        return model_info()

    async def serving(self, timeout: float) -> bool:
        self.health_checks += 1
        return self.healthy

    async def renew_lease(self, timeout: float) -> int:
        return 0

    async def propose(self, items: list[ProposeItem], timeout: float) -> Timed[dict[str, Proposal]]:
        await _answer_within(self.propose_delay_s, timeout)
        self.calls.append(items)
        fault = self.fault if len(self.calls) == self.fault_on_call else None
        if isinstance(fault, grpc.aio.AioRpcError):
            raise fault
        length_error = fault if isinstance(fault, int) else 0
        out = {}
        for item in items:
            cache = self.slots.setdefault(item.slot_id, [])
            assert 0 <= item.valid_len <= len(cache), (item, len(cache))
            del cache[item.valid_len :]
            cache.extend(item.new_tokens)
            drafted: list[int] = []
            for position in range(1, item.num_speculative_tokens + 1):
                guess = next_token((drafted or cache)[-1])
                drafted.append((guess + 1) % _CYCLE if position in self.wrong_at else guess)
                if drafted[-1] in item.stop_token_ids:
                    break  # as the real draft: no token after a stop token could be kept
            if fault == "short" and len(drafted) > 1:
                drafted.pop()
            cache.extend(drafted[:-1])  # the last drafted token is not fed back
            # A sampled request's q: the draft is sure of its guesses (q one-hot).
            support = [(t + 1) % VOCAB for t in drafted] if fault == "bad_q" else drafted
            q = None if item.sampling.is_greedy else SparseRows((1,) * len(drafted), torch.tensor(support),
                                                                torch.ones(len(drafted)))
            # As the real draft counts them: the leading fed guessed tokens it drew too.
            fed = item.guess_tokens[: item.num_speculative_tokens - 1]
            saved = common_prefix_length(fed, drafted)
            out[item.slot_id] = Proposal(item.slot_id, drafted, q, len(cache) + length_error, saved)
        return Timed(out, 0.0005, 0.001)

    async def release(self, slot_id: str, timeout: float) -> None:
        self.slots.pop(slot_id, None)
        self.released.append(slot_id)

    async def close(self) -> None:
        pass


class ToyTokenizer:
    """Characters 'a'.. map to token ids 0..; enough for `new_request` and the detokenizer."""

    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) - ord("a") for c in text]}

    def decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + t) for t in tokens if not (skip_special_tokens and t == EOS))


def policy(
    *, speculative: bool = True, k: int = 4, max_new_tokens: int = 16, slot_prefix: str = "",
    method: SpeculationMethod = SpeculationMethod.MODEL, has_draft: bool | None = None,
) -> RequestPolicy:
    """Requests draft with the model by default (`method`); `has_draft` defaults to `speculative`."""
    return RequestPolicy(
        tokenizer=ToyTokenizer(),  # type: ignore[arg-type]
        vocab_size=VOCAB, eos_token_ids=frozenset({EOS}), max_seq_len=256, max_speculative_tokens=8,
        has_draft=speculative if has_draft is None else has_draft, speculative=speculative,
        num_speculative_tokens=k, adaptive_k=False, default_max_new_tokens=max_new_tokens, slot_prefix=slot_prefix,
        default_method=method,
    )


def scheduler(target: FakeTarget, draft: FakeDraft | None, *, kv_tokens: int = 4096, max_batch_size: int = 8,
              max_queue: int = 8, deadline_s: float = 5.0, decode_steps: int = 1,
              lookup: LookupProposer | None = None) -> Scheduler:
    pools = [PoolLimits("target", kv_tokens, 16, 64)] + ([PoolLimits("draft", kv_tokens, 16, 64)] if draft else [])
    return Scheduler(
        target, draft, pools, max_seq_len=min(256, kv_tokens), max_batch_size=max_batch_size, max_queue=max_queue,
        planner=Planner([], [], clock=still), stats=GatewayStats(8),
        deadlines=Deadlines(floor_s=deadline_s, factor=1.0),
        decode_steps=decode_steps, lookup=lookup,
    )
