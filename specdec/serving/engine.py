"""What the draft and target engines share: a model, its paged KV pool and the slot table.

An engine is synchronous and single-threaded (the service runs it on its model worker
thread). Slot ids are chosen by the gateway and opaque here. Every public method validates
its whole batch before changing anything, so a bad request fails alone and never frees or
corrupts what belongs to other requests.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

import torch

from specdec.cost_model import ForwardCost
from specdec.errors import CapacityExhaustedError, DrainingError, InvalidArgumentError, SlotNotFoundError
from specdec.model.cuda_graphs import StepGraphs
from specdec.model.forward_batch import StepShape
from specdec.model.llama import LogitRows
from specdec.model.loader import weights_fingerprint
from specdec.model.runtime import ModelRuntime
from specdec.model.tokenizer_info import TokenizerInfo
from specdec.sampling.params import SamplingParams
from specdec.serving.config import ModelServiceConfig
from specdec.serving.leases import LeaseTable
from specdec.serving.reservations import Reservations
from specdec.tuning.openmp import release_threads
from specdec.tuning.startup import StartupTuner
from specdec.wire.items import Lease
from specdec.wire.kv_transfer import ImportHeader
from specdec.wire.model_info import KVLayout, ModelInfo, PoolRoom

log = logging.getLogger(__name__)


class ModelEngine:
    """A model over a paged KV pool, with per-slot token histories."""

    def __init__(self, runtime: ModelRuntime, config: ModelServiceConfig) -> None:
        self.runtime = runtime
        self.config = config
        self.model = runtime.model
        self.cache = self.model.new_cache(token_budget=config.kv_token_budget, block_size=config.block_size)
        self.tokenizer_info = TokenizerInfo.of(runtime.loaded.model, runtime.loaded.tokenizer)
        model_limit = int(getattr(runtime.loaded.model.config, "max_position_embeddings", 0) or 0)
        limits = [self.cache.capacity_tokens] + [n for n in (config.max_seq_len, model_limit) if n > 0]
        self.max_seq_len = min(limits)
        #: Token ids held in each slot's cache, in order (the draft's penalty context).
        self.tokens: dict[str, list[int]] = {}
        #: Prompt tokens new slots asked for, and those found in the prefix cache (`_allocate`).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        #: Which gateway holds which slot; a silent gateway's slots expire (see `leases`).
        self.leases = LeaseTable(config.lease_ttl_s)
        #: The blocks each slot declared it will grow into, kept from other holders' new slots.
        self.reservations = Reservations(self.max_seq_len)
        #: Stopping (SIGTERM): the slots held are served to their end, no new one is taken.
        self.draining = False
        #: The start-up choices: the runtime's tuner (a fresh one, without a cache, when it has none).
        self.tuner = runtime.tuner if isinstance(runtime.tuner, StartupTuner) else StartupTuner()
        self.tuner.attention(self.model, config.attention)
        self.tuner.note("prefill_chunk_tokens", config.prefill_chunk_tokens, "flag")
        # Before anything is timed: on CUDA an uncompiled step is served from its graph.
        self.model.step_graphs = self._step_graphs(config)
        self.tuner.layer_path(self.model, self.cache, config.compile, config.compile_budget_s, config.measure_costs)
        self.tuner.native_steps(self.model, self.cache, config.native_steps, config.measure_costs)
        #: The one shape of every verify and decode forward, or None: each forward its own
        #: (`specdec.model.forward_batch.StepShape`; the target's --batch-invariant).
        self.step_shape: StepShape | None = None
        self._note_graphs(config)
        #: Forward costs measured on this machine at start-up (empty when disabled).
        self.forward_costs: tuple[ForwardCost, ...] = self.tuner.forward_costs(
            self.model, self.cache, max_batch=config.max_slots, max_tokens=config.max_speculative_tokens + 1,
            enabled=config.measure_costs,
        )
        _, _, kv_heads, head_dim = self.cache.kv[0].shape
        self.kv_layout = KVLayout(weights_fingerprint(runtime.loaded.model_id), len(self.cache.kv), kv_heads, head_dim)
        log.info(
            "%s: KV pool of %d tokens (%d blocks of %d), %.0f MiB; max_seq_len %d",
            runtime.loaded.name, self.cache.capacity_tokens, self.cache.blocks.num_blocks, self.cache.block_size,
            self.cache.capacity_tokens * self.cache.bytes_per_token() / 2**20, self.max_seq_len,
        )

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    def info(self) -> ModelInfo:
        return ModelInfo(
            model_id=self.runtime.loaded.model_id,
            model_name=self.runtime.loaded.name,
            tokenizer=self.tokenizer_info,
            max_seq_len=self.max_seq_len,
            block_size=self.cache.block_size,
            free_kv_tokens=self.cache.blocks.free_tokens,
            total_kv_tokens=self.cache.capacity_tokens,
            max_slots=self.config.max_slots,
            active_slots=len(self.tokens),
            max_speculative_tokens=self.config.max_speculative_tokens,
            dtype=str(self.model.dtype).removeprefix("torch."),
            device=str(self.cache.device),
            quantization="" if self.runtime.quantization == "none" else self.runtime.quantization,
            forward_costs=self.forward_costs,
            compiled_steps=self.tuner.compiled_steps(self.model),
            tuning=tuple(self.tuner.choices),
            pending_graphs=len(self.tuner.pending),
            kv_layout=self.kv_layout,
        )

    def room(self, slot_ids: Sequence[str]) -> PoolRoom:
        """The pool's room now (after a call on `slot_ids`): free blocks and slots, the blocks
        and slots of the lease holder that owns the first of `slot_ids`, and the free blocks a
        new slot of that holder may not take (`kept_free`)."""
        blocks = self.cache.blocks
        held = [slot for slot in self.leases.slots_held_with(slot_ids[0]) if blocks.has_slot(slot)] if slot_ids else []
        held_blocks = len({block for slot in held for block in blocks.block_table(slot)})  # a shared prefix counts once
        free_slots = max(0, self.config.max_slots - len(self.tokens))
        holder = self.leases.holder_of(slot_ids[0]) if slot_ids else None
        return PoolRoom(blocks.num_free_blocks, free_slots, held_blocks, len(held), self.kept_free(holder))

    def kept_free(self, holder: str | None) -> int:
        """Free blocks a new slot of `holder` may not take (None: a caller without a lease):
        every slot's reserved growth while another holder shares the pool, else none
        (`specdec.serving.reservations`)."""
        return self.reservations.kept_free(self.cache.blocks, holder, self.leases.owners)

    def export_kv(self, slot_id: str, start: int, end: int, num_layers: int, dtype: torch.dtype) -> torch.Tensor:
        """The keys and values the slot holds for positions [start, end) of its first
        `num_layers` layers, in `dtype`: [num_layers, end - start, 2, kv_heads, head_dim]."""
        cached = len(self._require_slot(slot_id))
        if not 0 <= start <= end <= cached:
            raise InvalidArgumentError(f"start, end: [{start}, {end}) is outside [0, {cached}] "
                                       f"(cached length of slot {slot_id!r})")
        if not 1 <= num_layers <= len(self.cache.kv):
            raise InvalidArgumentError(f"num_layers: {num_layers} is outside [1, {len(self.cache.kv)}]",
                                       field="num_layers")
        rows = torch.tensor(self.cache.blocks.positions(slot_id, start, end), device=self.cache.device)
        return torch.stack([pool.index_select(0, rows) for pool in self.cache.kv[:num_layers]]).to("cpu", dtype)

    def import_shape(self, header: ImportHeader) -> tuple[int, int, int, int, int]:
        """The [layers, positions, 2, kv_heads, head_dim] shape an import of `header` fills."""
        layout = self.kv_layout
        return (layout.num_layers, len(header.tokens), 2, layout.num_kv_heads, layout.head_dim)

    def import_kv(self, header: ImportHeader, kv: torch.Tensor) -> int:
        """Roll the slot back to `header.valid_len` (or create it, under the header's lease)
        and append `header.tokens` with the keys and values `kv` ([layers, tokens, 2, kv_heads,
        head_dim], computed elsewhere from the same weights) instead of computing them; a new
        slot keeps what its prefix cache holds. Returns the slot's cached length."""
        slot_id, tokens = header.slot_id, header.tokens
        new = self.check_import(header)
        if tuple(kv.shape) != self.import_shape(header):
            raise InvalidArgumentError(f"KV import of shape {list(kv.shape)} for slot {slot_id!r}: this cache "
                                       f"takes {list(self.import_shape(header))}")
        if new:
            rest = self._allocate({slot_id: tokens}, header.lease, {slot_id: header.max_len})[slot_id]
            skip = len(tokens) - len(rest)
        else:
            self._rollback(slot_id, header.valid_len)
            skip = 0
        try:
            rows = torch.tensor(self.cache.blocks.append(slot_id, len(tokens) - skip), device=self.cache.device)
            for layer, pool in enumerate(self.cache.kv):
                pool.index_copy_(0, rows, kv[layer, skip:].to(pool.device, pool.dtype))
        except BaseException:
            if new:
                self._free_quietly([slot_id])
            else:
                self.cache.truncate(slot_id, header.valid_len)
            raise
        self.tokens[slot_id].extend(tokens[skip:])
        if self.config.prefix_caching:
            self.cache.blocks.register_full_blocks(slot_id, self.tokens[slot_id])
        return len(self.tokens[slot_id])

    def check_import(self, header: ImportHeader) -> bool:
        """Validate an import's header without changing anything; returns whether its slot is new."""
        slot_id = header.slot_id
        if not slot_id:
            raise InvalidArgumentError("slot_id: must not be empty", field="slot_id")
        new = slot_id not in self.tokens
        if new and header.valid_len != 0:
            raise InvalidArgumentError(f"valid_len: slot {slot_id!r} is new here, so valid_len must be 0 "
                                       f"(got {header.valid_len})", field="valid_len")
        if new:
            self.leases.check(header.lease)
            self._check_max_len(slot_id, header.max_len)
            self._check_new_slots(1)
        else:
            self._check_rollback(slot_id, header.valid_len, "valid_len")
        if not header.tokens:
            raise InvalidArgumentError(f"tokens: slot {slot_id!r} sent none to import", field="tokens")
        self._check_tokens("tokens", slot_id, header.tokens)
        self._check_length(slot_id, header.valid_len + len(header.tokens))
        return new

    def truncate(self, slot_id: str, new_len: int) -> int:
        """Explicit rollback: keep the first `new_len` cached tokens. Returns the new length."""
        self._check_rollback(slot_id, new_len, "new_len")
        self._rollback(slot_id, new_len)
        return new_len

    def release(self, slot_id: str) -> None:
        """Free every block of the slot and forget it."""
        self._require_slot(slot_id)
        self.cache.blocks.free(slot_id)
        del self.tokens[slot_id]
        self.leases.forget(slot_id)
        self.reservations.forget(slot_id)

    def free_stale(self, holder: str, stale: Sequence[str]) -> None:
        """Free the slots a restarted holder's earlier incarnation left (see `LeaseTable.renew`)."""
        self._free_quietly(stale)
        log.warning("%s restarted: freed %d slot(s) of its previous incarnation", holder, len(stale))

    def expire_leases(self) -> int:
        """Free the slots of every holder whose lease ran out; returns how many."""
        expired = self.leases.expired()
        self._free_quietly(expired)
        if expired:
            log.warning("freed %d slot(s) of gateway(s) that stopped renewing their lease", len(expired))
        return len(expired)

    # -- validation (no side effects) -------------------------------------------------

    def _require_slot(self, slot_id: str) -> list[int]:
        if not slot_id:  # the same answer as an empty id inside a Prefill or Propose batch
            raise InvalidArgumentError("slot_id: must not be empty", field="slot_id")
        try:
            return self.tokens[slot_id]
        except KeyError:
            raise SlotNotFoundError(f"slot {slot_id!r} not found") from None

    @staticmethod
    def _check_batch(slot_ids: Sequence[str]) -> None:
        if not slot_ids:
            raise InvalidArgumentError("items: batch is empty", field="items")
        if any(not slot_id for slot_id in slot_ids):
            raise InvalidArgumentError("slot_id: must not be empty", field="slot_id")
        duplicates = [slot for slot, n in Counter(slot_ids).items() if n > 1]
        if duplicates:
            raise InvalidArgumentError(f"slot_id: {duplicates[0]!r} appears more than once in the batch",
                                       field="slot_id")

    def _check_tokens(self, field: str, slot_id: str, tokens: Iterable[int]) -> None:
        bad = [t for t in tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidArgumentError(
                f"{field}: token id {bad[0]} of slot {slot_id!r} is outside the vocabulary [0, {self.vocab_size})",
                field=field
            )

    def _check_sampling(self, slot_id: str, params: SamplingParams) -> None:
        """The sampling params' token ids (the logit bias's) must lie in the vocabulary."""
        self._check_tokens("sampling.logit_bias", slot_id, [token for token, _ in params.logit_bias])

    def _check_rollback(self, slot_id: str, valid_len: int, field: str) -> None:
        cached = len(self._require_slot(slot_id))
        if not 0 <= valid_len <= cached:
            raise InvalidArgumentError(
                f"{field}: {valid_len} is outside [0, {cached}] (cached length of slot {slot_id!r})", field=field
            )

    def _check_length(self, slot_id: str, total: int, field: str = "tokens") -> None:
        if total > self.max_seq_len:
            raise InvalidArgumentError(
                f"{field}: slot {slot_id!r} would reach {total} tokens, past max_seq_len {self.max_seq_len}",
                field=field
            )

    @staticmethod
    def _check_max_len(slot_id: str, max_len: int) -> None:
        if max_len < 0:
            raise InvalidArgumentError(f"max_len: slot {slot_id!r} declared {max_len} (0 reserves nothing)",
                                       field="max_len")

    def _check_new_slots(self, count: int) -> None:
        if self.draining and count:
            raise DrainingError("the service is stopping and takes no new slots: retry on another instance")
        if len(self.tokens) + count > self.config.max_slots:
            raise CapacityExhaustedError(
                f"slots: {len(self.tokens)} of {self.config.max_slots} in use, {count} more requested",
                resource="slots",
            )

    # -- mutation -----------------------------------------------------------------------

    def _allocate(self, prompts: dict[str, list[int]], lease: Lease | None,
                  max_lens: Mapping[str, int]) -> dict[str, list[int]]:
        """New slots for `lease` (checked beforehand with `leases.check`; the lease is renewed),
        each starting from the cached blocks that match its prompt (`--prefix-caching`) and
        reserving room up to its `max_lens` entry. Returns what each still has to feed: its
        prompt past the cached part."""
        self._free_quietly(self.leases.claim(list(prompts), lease))  # a restarted holder's old slots
        rest = {}
        for slot_id, prompt in prompts.items():
            self.reservations.reserve(slot_id, max_lens.get(slot_id, 0))
            prefix = self.cache.blocks.cached_prefix(prompt) if self.config.prefix_caching else []
            self.cache.blocks.allocate(slot_id, prefix)
            cached = len(prefix) * self.cache.block_size
            self.tokens[slot_id] = list(prompt[:cached])
            rest[slot_id] = list(prompt[cached:])
            self.prefix_cache_queries += len(prompt)
            self.prefix_cache_hits += cached
        return rest

    def _free_quietly(self, slot_ids: Sequence[str]) -> None:
        for slot_id in slot_ids:
            if slot_id in self.tokens:
                self.release(slot_id)

    def _rollback(self, slot_id: str, valid_len: int) -> None:
        self.cache.truncate(slot_id, valid_len)
        del self.tokens[slot_id][valid_len:]

    def _hand_over(self) -> None:
        """This call is followed by the other service's work: let the OpenMP threads go
        rather than spin on a core it needs (see `specdec.tuning.openmp`)."""
        if self.config.release_threads:
            release_threads()

    def _step_graphs(self, config: ModelServiceConfig) -> StepGraphs | None:
        """CUDA graphs of the verify and decode steps: on CUDA, unless --no-cuda-graphs. A step
        the layer runner compiles runs without them (`PagedLlama.replays`)."""
        if not (config.cuda_graphs and self.cache.device.type == "cuda"):
            return None
        return StepGraphs(
            self.model, self.cache, max_requests=config.max_slots, max_tokens=config.max_speculative_tokens + 1,
            max_blocks=-(-self.max_seq_len // self.cache.block_size), capture=True,
        )

    def _note_graphs(self, config: ModelServiceConfig) -> None:
        """The start-up line's cuda_graphs entry, once the compiled steps are chosen."""
        graphs = self.model.step_graphs is not None
        if not graphs:
            why = self.cache.device.type if config.cuda_graphs else ""
        else:
            compiled = self.tuner.compiled_steps(self.model)
            why = f"except the compiled {', '.join(compiled)}" if compiled else ""
        self.tuner.note("cuda_graphs", graphs, "fixed" if config.cuda_graphs else "flag", why)

    def _forward(self, chunks: list[tuple[str, list[int]]], logits: LogitRows, prompt: bool) -> list[torch.Tensor]:
        """The forwards of `_run`: verify and decode steps in `step_shape` when there is one (from
        its CUDA graph where the step replays one), else as `PagedLlama.compute` runs them."""
        if prompt or self.step_shape is None:
            return self.model.compute(self.cache, chunks, logits=logits, prompt=prompt,
                                      chunk_tokens=self.config.prefill_chunk_tokens)
        graphs = self.model.step_graphs
        run = graphs.run if graphs is not None and self.model.replays(chunks) else None
        rows = self.model.compute_fixed(self.cache, chunks, self.step_shape, run)  # [len(tokens), vocab] each
        return rows if logits == "all" else [chunk_rows[-1] for chunk_rows in rows]

    def _run(
        self, chunks: list[tuple[str, list[int]]], logits: LogitRows, *, prompt: bool = True
    ) -> list[torch.Tensor]:
        """One batched forward that appends each chunk to its slot; all or nothing. `prompt`
        as in `PagedLlama.compute` (False for verify and decode steps)."""
        before = {slot_id: len(self.tokens[slot_id]) for slot_id, _ in chunks}
        self.cache.blocks.append_many([(slot_id, len(tokens)) for slot_id, tokens in chunks])  # all or nothing
        try:
            out = self._forward(chunks, logits, prompt)
        except BaseException:
            for slot_id, length in before.items():  # undo a partial append
                if self.cache.blocks.length(slot_id) > length:
                    self.cache.truncate(slot_id, length)
            raise
        for slot_id, tokens in chunks:
            self.tokens[slot_id].extend(tokens)
            if self.config.prefix_caching:
                self.cache.blocks.register_full_blocks(slot_id, self.tokens[slot_id])
        return out
