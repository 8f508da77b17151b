"""What one forward pass costs on this machine, measured at start-up.

Speculation pays only when the draft is cheap next to the target and a (K+1)-token verify
costs little more than a 1-token step; both ratios depend on the CPU or GPU, its kernels and
its thread count. So each service times its own forward over a small grid of batch sizes and
chunk widths, on temporary slots with a short context, and advertises the table
(`ModelInfo.forward_costs`); the gateway plans K from it (`specdec.cost_model`) and rescales
its level online.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Generator, Sequence

from specdec.cost_model import ForwardCost
from specdec.kv_cache.paged_cache import PagedKVCache
from specdec.model.llama import PagedLlama
from specdec.tuning.timing import interleaved_samples, interleaved_times, run_to_end, synchronizer

log = logging.getLogger(__name__)

#: Requests per forward and new tokens per request that the profile times (up to the widest
#: verify a service accepts, K = 16: the planner prices long rounds from a measured point).
BATCH_SIZES = (1, 4, 16)
CHUNK_WIDTHS = (1, 2, 3, 5, 9, 17)
#: A prompt-sized chunk, timed at batch 1 only: what a prefill or a draft catching up on a
#: prompt costs (extrapolated from the verify-sized points, it came out about twice too high:
#: docs/performance.md#start-up-cost-profile).
PREFILL_WIDTH = 64
#: Largest forward the profile times (batch × tokens); the cost table extends past it linearly.
#: It reaches a K = 8 verify of 16 requests: extrapolated from the 2- and 3-token points, that
#: verify came out 1.5× too dear and the planner drafted short at 16 requests
#: (docs/performance.md#start-up-cost-profile).
MAX_ROWS = 160
#: Cached tokens each profiling slot holds before the timed forwards (a short chat prompt).
CONTEXT_LEN = 48
#: The context a few points are timed at again, so the gateway can price longer contexts
#: (`specdec.cost_model.CostTable`): the narrowest and widest chunk of each batch size.
#: Its extra positions are appended without a forward (attention's cost does not depend on
#: what the cached K/V hold), so the longer context costs no prefill at start-up.
LONG_CONTEXT_LEN = CONTEXT_LEN + 256
#: A third context, timed at batch 1 only (the same two chunks): past a few hundred tokens the
#: cached K/V outgrow the CPU's caches and each token costs more than the first 256 said, so a
#: long prompt's steps are priced from a measured point (docs/performance.md#context-cost).
LONGEST_CONTEXT_LEN = CONTEXT_LEN + 2048
_SLOT_PREFIX = "\x00profile-"  # never a gateway slot id: those are printable
#: Timed passes over the whole grid (after one warm-up pass); each point reports its median.
REPEATS = 5
#: Timed 1-token steps of the check of a cached table (`step_seconds`).
SPOT_REPEATS = 5


def filler_prompt(vocab_size: int, length: int) -> list[int]:
    """Arbitrary token ids spread over the vocabulary, for timing forwards (speed does not
    depend on which tokens they are)."""
    return [(i * 7919) % vocab_size for i in range(length)]


def measure_forward_costs(
    forward: PagedLlama, cache: PagedKVCache, *, max_batch: int, max_tokens: int, repeats: int = REPEATS
) -> list[ForwardCost]:
    """Median seconds of one forward over `b` slots × `t` new tokens, for the grid within limits,
    plus one `PREFILL_WIDTH`-token chunk at batch 1, every slot holding `CONTEXT_LEN` cached
    tokens; and the narrowest and widest chunk of each batch size again at `LONG_CONTEXT_LEN`,
    of batch 1 also at `LONGEST_CONTEXT_LEN`.

    The grid is timed in `repeats` interleaved passes (`interleaved_samples`), not point by
    point: on a shared machine the speed drifts over seconds, and the planner compares points (a
    (K+1)-token verify with a 1-token step, a draft step with a target step) and rescales
    their level online, so what must hold is their ratios.

    Uses (and afterwards frees) temporary slots in `cache`; grid points that do not fit the
    pool are skipped. Token ids are arbitrary: the cost does not depend on them.
    """
    return run_to_end(forward_cost_steps(forward, cache, max_batch=max_batch, max_tokens=max_tokens, repeats=repeats))


def forward_cost_steps(
    forward: PagedLlama, cache: PagedKVCache, *, max_batch: int, max_tokens: int, repeats: int = REPEATS
) -> Generator[None, None, list[ForwardCost]]:
    """`measure_forward_costs` one timed forward at a time: yields after each, so a serving
    process can time its table again between requests (`specdec.serving.model_service`). Its
    temporary slots live until the generator ends or is closed."""
    grid = _grid(cache, max_batch, max_tokens)
    if not grid:
        log.warning("forward costs not measured: a KV pool of %d tokens is too small to profile", cache.capacity_tokens)
        return []
    with cache.temporary_slots(_SLOT_PREFIX, max(batch for batch, _, _ in grid)) as slots:
        prompt = filler_prompt(forward.vocab_size, max(CONTEXT_LEN, PREFILL_WIDTH))
        forward.run(cache, [(slot, prompt[:CONTEXT_LEN]) for slot in slots])

        def setup(point: tuple[int, int, int]) -> None:
            batch, _, context = point
            for slot in slots[:batch]:
                cache.blocks.truncate_to(slot, CONTEXT_LEN)
            if context > CONTEXT_LEN:
                cache.blocks.append_many([(slot, context - CONTEXT_LEN) for slot in slots[:batch]])

        def forward_of(batch: int, width: int) -> None:
            # A verify chunk returns logits for every token, a prefill for its last one only.
            prefill = width == PREFILL_WIDTH
            forward.run(cache, [(slot, prompt[:width]) for slot in slots[:batch]], logits="last" if prefill else "all",
                        prompt=prefill)

        candidates = {(b, t, n): (lambda b=b, t=t: forward_of(b, t)) for b, t, n in grid}
        sync = synchronizer(forward.embed_tokens.weight.device)
        samples = yield from interleaved_samples(candidates, repeats=repeats, setup=setup, sync=sync)
    return [ForwardCost(b, t, statistics.median(samples[(b, t, n)]), context=n) for b, t, n in grid]


def one_token_step(costs: Sequence[ForwardCost]) -> float | None:
    """A table's 1-token step of one request, at the shortest context it was timed at."""
    steps = [c for c in costs if (c.batch_size, c.tokens) == (1, 1)]
    return min(steps, key=lambda c: c.context).seconds if steps else None


def step_seconds(forward: PagedLlama, cache: PagedKVCache, repeats: int = SPOT_REPEATS) -> float | None:
    """Median seconds of a 1-token step of one request with `CONTEXT_LEN` cached tokens, the
    table's (1, 1) point (None when the pool has no room): a quick check of a cached table."""
    if cache.blocks.free_tokens // 2 < CONTEXT_LEN + cache.block_size:
        return None
    with cache.temporary_slots(_SLOT_PREFIX, 1) as (slot,):
        prompt = filler_prompt(forward.vocab_size, CONTEXT_LEN + 1)
        forward.run(cache, [(slot, prompt[:CONTEXT_LEN])])

        def step() -> None:
            cache.blocks.truncate_to(slot, CONTEXT_LEN)
            forward.run(cache, [(slot, prompt[CONTEXT_LEN:])], prompt=False)

        sync = synchronizer(forward.embed_tokens.weight.device)
        return interleaved_times({"step": step}, repeats=repeats, sync=sync)["step"]


def _grid(cache: PagedKVCache, max_batch: int, max_tokens: int) -> list[tuple[int, int, int]]:
    """The (batch size, tokens, context) points that fit in half of `cache`'s free tokens, sorted."""
    batches = [b for b in BATCH_SIZES if b <= max_batch]
    widths = [t for t in CHUNK_WIDTHS if t <= max_tokens]

    def tokens_needed(batch: int, prefill: bool, context: int = CONTEXT_LEN) -> int:
        """Every slot's widest chunk (and slot 0's prefill)."""
        return batch * (context + widths[-1] + cache.block_size) + (PREFILL_WIDTH if prefill else 0)

    room = cache.blocks.free_tokens // 2  # leave at least half the pool free whatever its size
    while batches and tokens_needed(batches[-1], False) > room:
        batches.pop()
    if not batches:
        return []
    short = [(batch, width) for batch in batches for width in widths if width == 1 or batch * width <= MAX_ROWS]
    grid = [(batch, width, CONTEXT_LEN) for batch, width in short]
    if tokens_needed(batches[-1], True) <= room:
        grid.append((1, PREFILL_WIDTH, CONTEXT_LEN))
    for batch in batches:
        if tokens_needed(batch, False, LONG_CONTEXT_LEN) <= room:
            widest = max(width for b, width in short if b == batch)
            grid += [(batch, width, LONG_CONTEXT_LEN) for width in sorted({1, widest})]
            if batch == 1 and tokens_needed(batch, False, LONGEST_CONTEXT_LEN) <= room:
                grid += [(batch, width, LONGEST_CONTEXT_LEN) for width in sorted({1, widest})]
    return sorted(grid)  # by batch size, then width, then context
