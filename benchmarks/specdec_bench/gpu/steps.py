"""In-process step timing of a model, against the memory-bandwidth roofline.

At batch 1 a decode step reads every weight once and does little arithmetic with it, so its
floor is weight bytes ÷ memory bandwidth (the roofline); a (K+1)-token verify reads the same
weights, so on a GPU it should cost little more than a step. The steps run as an engine runs
them (block bookkeeping, batch tensors, the forward), every request holding the same cached
context, either eagerly or, as the services run steps on CUDA, padded to a bucket and replayed
from a CUDA graph (`specdec.model.cuda_graphs`; off CUDA the padded steps run eagerly). They
are timed with the project's one timing helper: interleaved rounds after a warm-up, the
device synchronized around each call, the median kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from specdec.model.cuda_graphs import StepGraphs
from specdec.model.llama import PagedLlama
from specdec.tuning.cost_profile import filler_prompt
from specdec.tuning.timing import interleaved_times, synchronizer

#: Nominal memory bandwidth (bytes/s) by a substring of the CUDA device name, the first match
#: winning: the vendors' datasheet figures. An assumption the results state, not a measurement.
NOMINAL_BANDWIDTH: tuple[tuple[str, float], ...] = (
    ("H200", 4.8e12),
    ("H100 NVL", 3.9e12),
    ("H100 PCIe", 2.0e12),
    ("H100", 3.35e12),  # SXM ("NVIDIA H100 80GB HBM3")
)
#: Bytes the copy-bandwidth probe moves each way.
COPY_BYTES = 1 << 30


@dataclass(frozen=True)
class StepTiming:
    """Median seconds of one forward over `batch` requests of `tokens` new tokens each."""

    batch: int
    tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.batch * self.tokens / self.seconds


def nominal_bandwidth(device_name: str) -> float | None:
    """The datasheet bandwidth of a device named `device_name` (None: not in the table)."""
    return next((bandwidth for key, bandwidth in NOMINAL_BANDWIDTH if key in device_name), None)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters, each tensor once (a tied embedding and output head
    count once: the head reads the whole matrix, the embedding only a few rows of it)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def copy_bandwidth(device: torch.device) -> float:
    """Bytes/s a device-to-device copy reaches, counting bytes read and written (median of 5)."""
    source = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    times = interleaved_times({"copy": lambda: target.copy_(source)}, repeats=5, warmup=2,
                              sync=synchronizer(device))
    return 2 * COPY_BYTES / times["copy"]


def time_steps(
    forward: PagedLlama, *, batches: tuple[int, ...], widths: tuple[int, ...], context: int, warmup: int,
    repeats: int, graphs: bool = False,
) -> list[StepTiming]:
    """Median seconds of a forward over each (batch, width) pair, every request of it
    `context` tokens deep; the pairs are timed in interleaved rounds. With `graphs`, each step
    runs padded to its bucket from a CUDA graph (captured in the warm-up; eager off CUDA)."""
    block_size = 16
    per_slot = context + max(widths) + block_size
    cache = forward.new_cache(token_budget=max(batches) * per_slot, block_size=block_size)
    prompt = filler_prompt(forward.vocab_size, context + max(widths))
    replays = StepGraphs(forward, cache, max_requests=max(batches), max_tokens=max(widths),
                         max_blocks=-(-per_slot // block_size), capture=True) if graphs else None
    with cache.temporary_slots("\x00step-", max(batches)) as slots:
        for slot in slots:  # one prefill a slot: a batch of long prompts would need far more memory
            forward.run(cache, [(slot, prompt[:context])])

        def setup(point: tuple[int, int]) -> None:
            for slot in slots[: point[0]]:
                cache.truncate(slot, context)

        def step(batch: int, width: int) -> None:
            chunks = [(slot, prompt[context : context + width]) for slot in slots[:batch]]
            if replays is None:
                forward.run(cache, chunks, logits="all", prompt=False)
                return
            cache.blocks.append_many([(slot, width) for slot, _ in chunks])
            shape = replays.shape_for(chunks)
            assert shape is not None, "the buckets are sized for every timed step"
            forward.compute_fixed(cache, chunks, shape, replays.run)

        candidates = {(b, w): (lambda b=b, w=w: step(b, w)) for b in batches for w in widths}
        device = forward.embed_tokens.weight.device
        times = interleaved_times(candidates, repeats=repeats, warmup=warmup, setup=setup, sync=synchronizer(device))
    return [StepTiming(b, w, times[(b, w)]) for b, w in candidates]

