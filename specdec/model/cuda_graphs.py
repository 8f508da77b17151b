"""Verify and decode steps replayed from CUDA graphs.

A decode or verify step launches a few hundred small kernels; on a GPU at small batch their
launch cost, not the GPU's work, sets the step's time. A CUDA graph records a step's kernels
once and replays them with one launch. A graph replays fixed shapes at fixed addresses, so
each step is padded to a `StepShape` bucket (requests, tokens and key blocks rounded up to
powers of two) and its inputs are copied into the bucket's own tensors before the replay.
A bucket is captured the first time a step needs it. Off CUDA the same padded path runs eagerly,
which is what the CPU tests check.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specdec.kv_cache.paged_cache import PagedKVCache
from specdec.model.forward_batch import ForwardBatch, StepShape
from specdec.model.llama import PagedLlama

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

log = logging.getLogger(__name__)

#: The most graphs one model keeps; a step of a shape past it runs eagerly.
MAX_GRAPHS = 64


def round_up(n: int, limit: int) -> int:
    """The smallest power of two at least `n`, but at most `limit` (n ≤ limit)."""
    return min(1 << (n - 1).bit_length(), limit)


@dataclass
class _Step:
    """One captured shape: the tensors its graph reads and writes, and the graph."""

    inputs: ForwardBatch  # the graph reads these tensors; each replay's inputs are copied in
    rows: torch.Tensor  # [R*T] every row of the step: the output head scores them all
    logits: torch.Tensor | None  # [R*T, vocab] what the graph writes (None until captured)
    graph: torch.cuda.CUDAGraph | None


class StepGraphs:
    """The padded shapes and captured graphs of one model's verify and decode steps.

    `max_requests`, `max_tokens` and `max_blocks` bound the buckets (a service's slots, its
    K_max + 1 and its longest sequence in blocks); `capture` False runs the padded steps
    eagerly, as off CUDA.
    """

    def __init__(
        self, model: PagedLlama, cache: PagedKVCache, *, max_requests: int, max_tokens: int, max_blocks: int,
        capture: bool,
    ) -> None:
        self.model, self.cache = model, cache
        self.limits = StepShape(max_requests, max_tokens, max_blocks)
        self.capture = capture
        self._steps: dict[StepShape, _Step] = {}
        self._pool: _POOL_HANDLE | None = None  # the memory pool every graph shares

    def shape_for(self, chunks: list[tuple[str, list[int]]]) -> StepShape | None:
        """The bucket these chunks run in, or None (run them the ordinary way): past a limit, or a
        new shape once `MAX_GRAPHS` are kept."""
        tokens = max(len(chunk) for _, chunk in chunks)
        blocks = -(-max(self.cache.blocks.length(slot_id) for slot_id, _ in chunks) // self.cache.block_size)
        limits = self.limits
        if len(chunks) > limits.requests or tokens > limits.tokens or blocks > limits.blocks:
            return None
        # Key positions at least twice the tokens: attention then takes its masked layout at every
        # step of the bucket (`specdec.model.attention.SdpaAttention.prepare`).
        min_blocks = -(-2 * tokens // self.cache.block_size)
        shape = StepShape(
            round_up(len(chunks), limits.requests), round_up(tokens, limits.tokens),
            round_up(max(blocks, min_blocks), limits.blocks),
        )
        return shape if shape in self._steps or len(self._steps) < MAX_GRAPHS else None

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits `[R*T, vocab]` of a batch padded to a bucket's shape: its inputs copied into the
        bucket's tensors, then its graph replayed (captured first if new)."""
        requests, tokens = batch.input_ids.shape
        shape = StepShape(requests, tokens, batch.block_tables.shape[1])
        step = self._steps.get(shape)
        if step is None:
            step = self._steps[shape] = self._new_step(batch)
        else:
            _copy_inputs(step.inputs, batch)
        if step.graph is None:
            return self.model.forward(step.inputs, self.cache, step.rows)
        assert step.logits is not None
        step.graph.replay()
        return step.logits

    def _new_step(self, batch: ForwardBatch) -> _Step:
        """A bucket whose tensors are `batch`'s own, captured as a graph on CUDA."""
        rows = torch.arange(batch.input_ids.numel(), device=batch.input_ids.device)  # [R*T]
        if not (self.capture and batch.input_ids.device.type == "cuda"):
            return _Step(batch, rows, None, None)
        # A first run on a side stream lets libraries make their handles and workspaces outside
        # the capture; it writes the keys and values the replay writes again.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.model.forward(batch, self.cache, rows)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self.model.forward(batch, self.cache, rows)  # [R*T, vocab]
        self._pool = graph.pool()
        log.info("captured a CUDA graph for steps of %d x %d tokens over %d blocks (%d graphs)",
                 *batch.input_ids.shape, batch.block_tables.shape[1], len(self._steps) + 1)
        return _Step(batch, rows, logits, graph)


def _copy_inputs(static: ForwardBatch, batch: ForwardBatch) -> None:
    """`batch`'s tensors into `static`'s, which have the same shapes (device to device, no sync)."""
    for name in ("input_ids", "positions", "kv_rows", "write_index", "block_tables", "context_lens"):
        getattr(static, name).copy_(getattr(batch, name), non_blocking=True)
