"""Measure what one forward pass costs on this machine, at start-up.

Speculation pays only when the draft is cheap next to the target and a (K+1)-token verify
costs little more than a 1-token step; both ratios depend on the CPU or GPU, its kernels
and its thread count. So each service times its own forward over a small grid of batch
sizes and chunk widths, on temporary slots with a short context, and advertises the table
(`ModelInfo.forward_costs`); the gateway plans K from it (`specdec.cost_model`).
"""

from __future__ import annotations

import logging
import statistics
import time

from specdec.cost_model import ForwardCost
from specdec.kv_cache.paged_cache import PagedKVCache
from specdec.model.llama import PagedLlama

log = logging.getLogger(__name__)

#: Requests per forward and new tokens per request that the profile times.
BATCH_SIZES = (1, 4, 16)
CHUNK_WIDTHS = (1, 2, 3, 5, 9)
#: A prompt-sized chunk, timed at batch 1 only: what a prefill or a draft catching up on a
#: prompt costs. Extrapolated from the 5- and 9-token points instead, a 48-token catch-up
#: of the int4 draft came out at ~500 ms where it takes ~240 ms (AMD EPYC, AVX2), and the
#: K planner judged speculation not worth starting.
PREFILL_WIDTH = 64
#: Largest forward the profile times (batch × tokens); the cost table extends past it linearly.
MAX_ROWS = 64
#: Cached tokens each profiling slot holds before the timed forwards (a short chat prompt).
CONTEXT_LEN = 48
#: The context a few points are timed at again, so the gateway can price longer contexts
#: (`specdec.cost_model.CostTable`): the narrowest and widest chunk of each batch size.
#: Its extra positions are appended without a forward (attention's cost does not depend on
#: what the cached K/V hold), so the longer context costs no prefill at start-up.
LONG_CONTEXT_LEN = CONTEXT_LEN + 256
_SLOT_PREFIX = "\x00profile-"  # never a gateway slot id: those are printable


#: Timed passes over the whole grid (after one warm-up pass); each point reports its median.
REPEATS = 5



def filler_prompt(vocab_size: int, length: int) -> list[int]:
    """Arbitrary token ids spread over the vocabulary, for timing forwards (speed does not
    depend on which tokens they are)."""
    return [(i * 7919) % vocab_size for i in range(length)]

def measure_forward_costs(
    forward: PagedLlama, cache: PagedKVCache, *, max_batch: int, max_tokens: int, repeats: int = REPEATS
) -> list[ForwardCost]:
    """Median seconds of one forward over `b` slots × `t` new tokens, for the grid within limits,
    plus one `PREFILL_WIDTH`-token chunk at batch 1, every slot holding `CONTEXT_LEN` cached
    tokens; and the narrowest and widest chunk of each batch size again at `LONG_CONTEXT_LEN`.

    The grid is timed in `repeats` interleaved passes, not point by point: on a shared VM
    the machine's speed drifts by ±30 % over seconds (measured, AMD EPYC KVM guest), and
    timing each point's repeats back to back put that drift between points. The planner
    compares points (a (K+1)-token verify with a 1-token step, a draft step with a target
    step) and rescales their level online, so what must hold is their ratios.

    Uses (and afterwards frees) temporary slots in `cache`; grid points that do not fit the
    pool are skipped. Token ids are arbitrary: the cost does not depend on them.
    """
    batches = [b for b in BATCH_SIZES if b <= max_batch]
    widths = [t for t in CHUNK_WIDTHS if t <= max_tokens]
    def tokens_needed(batch: int, prefill: bool, context: int = CONTEXT_LEN) -> int:  # every slot's widest chunk (and slot 0's prefill)
        return batch * (context + widths[-1] + cache.block_size) + (PREFILL_WIDTH if prefill else 0)

    room = cache.blocks.free_tokens // 2  # leave at least half the pool free whatever its size
    while batches and tokens_needed(batches[-1], False) > room:
        batches.pop()
    if not batches:
        log.warning("forward costs not measured: a KV pool of %d tokens is too small to profile", cache.capacity_tokens)
        return []
    with_prefill = tokens_needed(batches[-1], True) <= room
    with cache.temporary_slots(_SLOT_PREFIX, batches[-1]) as slots:
        prompt = filler_prompt(forward.vocab_size, max(CONTEXT_LEN, PREFILL_WIDTH))
        forward.run(cache, [(slot, prompt[:CONTEXT_LEN]) for slot in slots])
        short = [(batch, width) for batch in batches for width in widths if width == 1 or batch * width <= MAX_ROWS]
        grid = [(batch, width, CONTEXT_LEN) for batch, width in short]
        if with_prefill:
            grid.append((1, PREFILL_WIDTH, CONTEXT_LEN))
        for batch in batches:
            if tokens_needed(batch, False, LONG_CONTEXT_LEN) <= room:
                widest = max(width for b, width in short if b == batch)
                grid += [(batch, width, LONG_CONTEXT_LEN) for width in sorted({1, widest})]
        grid.sort()  # by batch size, then width, then context
        times: dict[tuple[int, int, int], list[float]] = {point: [] for point in grid}
        for timed_pass in range(repeats + 1):  # pass 0 warms up kernels and allocator
            for batch, width, context in grid:
                # A verify chunk returns logits for every token, a prefill for its last one only.
                logits = "last" if width == PREFILL_WIDTH else "all"
                for slot in slots[:batch]:
                    cache.blocks.truncate_to(slot, CONTEXT_LEN)
                if context > CONTEXT_LEN:
                    cache.blocks.append_many([(slot, context - CONTEXT_LEN) for slot in slots[:batch]])
                started = time.perf_counter()
                forward.run(cache, [(slot, prompt[:width]) for slot in slots[:batch]], logits=logits, prompt=width == PREFILL_WIDTH)
                if timed_pass:
                    times[(batch, width, context)].append(time.perf_counter() - started)
    costs = [ForwardCost(b, t, statistics.median(times[(b, t, n)]), context=n) for b, t, n in grid]
    single = {c.tokens: c.seconds * 1e3 for c in costs if c.batch_size == 1 and c.context == CONTEXT_LEN}
    log.info(
        "forward costs (batch 1): 1 token %.1f ms, %d tokens %.1f ms, %d-token prefill %s",
        single[1], widths[-1], single[widths[-1]], PREFILL_WIDTH,
        f"{single[PREFILL_WIDTH]:.1f} ms" if PREFILL_WIDTH in single else "not measured (small pool)",
    )
    return costs
