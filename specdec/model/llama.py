"""Our Llama forward pass over a paged KV cache.

The weights are the ones `transformers` loaded (possibly with projections swapped for
quantized modules); the computation is ours so that one batched call can mix prefills, verify
chunks and single-token decodes, each request at its own position, with keys and values living
in the paged pool. Covers Llama 3.x (incl. the
`llama3` RoPE scaling, via the rotary inverse frequencies `transformers` computed), GQA,
tied embeddings and SmolLM2. Device-agnostic: nothing here names a device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from specdec.errors import InvalidArgumentError
from specdec.kv_cache.paged_cache import PagedKVCache
from specdec.model.attention import (
    AttentionInputs,
    PagedAttention,
    attention_dtype,
    default_kernel,
    make_attention,
)
from specdec.model.choices import DEFAULT_PREFILL_CHUNK_TOKENS
from specdec.model.forward_batch import (
    ForwardBatch,
    StepShape,
    build_forward_batch,
    check_chunks,
    chunk_rounds,
)
from specdec.model.linear import DenseLinear, fastest_wide_kernel, fuse

SUPPORTED_MODEL_TYPES = ("llama",)
#: Which positions of each chunk a forward scores: its last token's (a prefill, a decode step) or
#: every token's (a verify chunk, a draft that keeps each position's q).
LogitRows = Literal["last", "all"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32 and cast back before the weight, as Llama does (one fused kernel)."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@dataclass(frozen=True)
class DecoderLayer:
    """One decoder layer's weights as our forward uses them: q/k/v and gate/up fused."""

    input_norm: torch.Tensor  # [hidden]
    qkv: nn.Module  # hidden -> (H + 2·Hkv)·D
    o: nn.Module  # H·D -> hidden
    post_norm: torch.Tensor  # [hidden]
    gate_up: nn.Module  # hidden -> 2·intermediate
    down: nn.Module  # intermediate -> hidden

    @classmethod
    def of(cls, layer: Any) -> DecoderLayer:
        """From a transformers `LlamaDecoderLayer` (typed Any: nn.Module attributes are untyped)."""
        attn, mlp = layer.self_attn, layer.mlp
        return cls(
            input_norm=layer.input_layernorm.weight,
            qkv=fuse([attn.q_proj, attn.k_proj, attn.v_proj]),
            o=fuse([attn.o_proj]),
            post_norm=layer.post_attention_layernorm.weight,
            gate_up=fuse([mlp.gate_proj, mlp.up_proj]),
            down=fuse([mlp.down_proj]),
        )


class LayerInputs(NamedTuple):
    """What every decoder layer of one forward reads besides the hidden state and its own
    weights and pool (B requests, T = longest chunk, n real tokens)."""

    cos: torch.Tensor  # [B, T, 1, D] RoPE
    sin: torch.Tensor  # [B, T, 1, D]
    write_index: torch.Tensor  # [w] pool row each of `kv_rows` writes
    kv_rows: torch.Tensor  # [w] rows of the flattened [B*T] whose keys and values are written
    attention: AttentionInputs  # what the attention kernel reads of the block tables

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every tensor, those of `attention` included."""
        return self.cos, self.sin, self.write_index, self.kv_rows, *self.attention.tensors()


class LayerRunner(Protocol):
    """Runs every decoder layer of one forward: `hidden` [B, T, hidden] in, the same shape out."""

    def __call__(self, hidden: torch.Tensor, inputs: LayerInputs, cache: PagedKVCache) -> torch.Tensor: ...


class StepRunner(LayerRunner, Protocol):
    """A layer runner for some forwards only (`specdec.model.native_steps`): those it `takes`."""

    def takes(self, hidden: torch.Tensor, inputs: LayerInputs) -> bool: ...


@runtime_checkable
class CompilingRunner(LayerRunner, Protocol):
    """A layer runner that compiles some step shapes (`specdec.tuning.compiled_layers`)."""

    def compiles(self, requests: int, width: int) -> bool:
        """Whether a forward of `requests` chunks of up to `width` tokens runs compiled."""
        ...


class StepReplay(Protocol):
    """Verify and decode steps padded to a bucket and replayed (`specdec.model.cuda_graphs`)."""

    def shape_for(self, chunks: list[tuple[str, list[int]]]) -> StepShape | None: ...

    def run(self, batch: ForwardBatch) -> torch.Tensor: ...


class PagedLlama:
    """Runs a loaded Llama `transformers` model over a `PagedKVCache`.

    The `transformers` model keeps its modules (tests run its own forward for parity);
    fused dense weights share storage with them, so fusion costs no memory.
    """

    def __init__(self, model: PreTrainedModel) -> None:
        config = model.config
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise InvalidArgumentError(
                f"model type {config.model_type!r} is not supported (need one of {SUPPORTED_MODEL_TYPES})"
            )
        self.model = model
        self.config = config
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.eps = config.rms_norm_eps
        decoder = model.model
        self.embed_tokens = decoder.embed_tokens
        self.layers = [DecoderLayer.of(layer) for layer in decoder.layers]
        self.final_norm = decoder.norm
        head = model.lm_head
        self.lm_head = DenseLinear(head.weight.detach()) if isinstance(head, nn.Linear) and head.bias is None else head
        # inv_freq already carries the `llama3` (or linear, ...) rescaling of the config.
        self.inv_freq: torch.Tensor = decoder.rotary_emb.inv_freq  # [head_dim / 2]
        self.attention_scaling: float = float(decoder.rotary_emb.attention_scaling)
        #: What runs the decoder layers: `eager_layers`, or the compiled runner that
        #: `specdec.tuning.compiled_layers` installs for the drafting steps.
        self.layer_runner: LayerRunner = self.eager_layers
        #: Runs the forwards it takes in place of `layer_runner` (start-up installs one where it
        #: measures faster: `StartupTuner.native_steps`).
        self.step_runner: StepRunner | None = None
        #: Replays verify and decode steps from CUDA graphs (the engine installs them on CUDA,
        #: before start-up times anything, so every timing runs the steps as served).
        self.step_graphs: StepReplay | None = None
        #: The attention kernel of every layer (`specdec.model.attention`): the device's default
        #: until start-up chooses (`StartupTuner.attention`).
        self.attention: PagedAttention = make_attention(default_kernel(decoder.embed_tokens.weight.device))

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def new_cache(self, *, token_budget: int, block_size: int = 16) -> PagedKVCache:
        """A KV pool sized for this model, in its dtype and on its device."""
        return PagedKVCache.for_model(
            self.config, token_budget=token_budget, block_size=block_size,
            dtype=self.dtype, device=self.embed_tokens.weight.device,
        )

    def run(
        self, cache: PagedKVCache, chunks: list[tuple[str, list[int]]], logits: LogitRows = "last", *,
        prompt: bool = True, chunk_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS,
    ) -> list[torch.Tensor]:
        """Append each (slot, tokens) chunk to its slot (all or nothing), then `compute` them.

        A convenience for tests and benchmarks; engines allocate blocks themselves and
        call `compute`. Slots must exist and already be truncated to the chunk's start.
        """
        cache.blocks.append_many([(slot_id, len(tokens)) for slot_id, tokens in chunks])
        return self.compute(cache, chunks, logits, prompt=prompt, chunk_tokens=chunk_tokens)

    @torch.inference_mode()
    def compute(
        self, cache: PagedKVCache, chunks: list[tuple[str, list[int]]], logits: LogitRows = "last", *,
        prompt: bool = True, chunk_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS,
    ) -> list[torch.Tensor]:
        """Batched forwards over chunks already appended to their slots; writes their K/V.

        Returns one logits tensor per chunk: `[vocab]` for `logits="last"`, `[len(tokens), vocab]`
        for `logits="all"`. A chunk longer than `chunk_tokens` runs as pieces, one forward a
        piece (`chunk_rounds`), with the same results in bounded memory. `prompt=False` (verify and
        decode steps) lets wide inputs take the matmul kernel measured fastest; a prompt's keep
        the one whose rounding matches transformers' (`specdec.model.linear`). A step that
        `replays` runs padded to its bucket, from `step_graphs`.
        """
        check_chunks(chunks)
        replayed = None if prompt else self._replay(cache, chunks, logits)
        if replayed is not None:
            return replayed
        starts = [cache.blocks.length(slot_id) - len(tokens) for slot_id, tokens in chunks]
        out: list[list[torch.Tensor]] = [[] for _ in chunks]
        for pieces in chunk_rounds(chunks, starts, chunk_tokens):
            slot_ids = [chunks[piece.chunk][0] for piece in pieces]
            batch = build_forward_batch(cache, [(slot_id, p.tokens) for slot_id, p in zip(slot_ids, pieces)],
                                        [piece.start for piece in pieces])
            ending = sum(piece.ends_chunk for piece in pieces)  # they come first
            rows = batch.token_rows if logits == "all" else batch.last_rows[:ending]
            with fastest_wide_kernel(not prompt):
                scored = self.forward(batch, cache, rows)  # [n_rows, vocab]
            parts = scored.split(batch.chunk_lens, dim=0) if logits == "all" else scored.unbind(0)
            for piece, part in zip(pieces, parts):
                out[piece.chunk].append(part)
        return [parts[0] if len(parts) == 1 else torch.cat(parts) for parts in out]

    def _replay(self, cache: PagedKVCache, chunks: list[tuple[str, list[int]]], logits: LogitRows
                ) -> list[torch.Tensor] | None:
        """`compute`'s result for a step that `replays` and fits a bucket of `step_graphs`; None
        for any other step."""
        graphs = self.step_graphs
        if graphs is None or not self.replays(chunks):
            return None
        shape = graphs.shape_for(chunks)
        if shape is None:
            return None
        per_chunk = self.compute_fixed(cache, chunks, shape, graphs.run)  # [len(tokens), vocab] each
        return per_chunk if logits == "all" else [rows[-1] for rows in per_chunk]

    def replays(self, chunks: list[tuple[str, list[int]]]) -> bool:
        """Whether a step over `chunks` replays `step_graphs`: there are graphs, and the layer
        runner does not compile this step's shape (a compiled step makes no graph of its own)."""
        if self.step_graphs is None:
            return False
        runner = self.layer_runner
        width = max(len(tokens) for _, tokens in chunks)
        return not (isinstance(runner, CompilingRunner) and runner.compiles(len(chunks), width))

    @torch.inference_mode()
    def compute_fixed(
        self, cache: PagedKVCache, chunks: list[tuple[str, list[int]]], shape: StepShape,
        run: Callable[[ForwardBatch], torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """`compute(..., logits="all", prompt=False)` with every forward padded to `shape`: the
        chunks run `shape.requests` at a time and the output head scores every row, padding
        included, so each matmul has the same shape at every step. `run` computes a padded
        batch's `[R*T, vocab]` logits (`specdec.model.cuda_graphs.StepGraphs.run`; default: our
        forward). Returns `[len(tokens), vocab]` per chunk."""
        check_chunks(chunks)
        out: list[torch.Tensor] = []
        every = torch.arange(shape.requests * shape.tokens, device=cache.device)  # [R*T]
        for first in range(0, len(chunks), shape.requests):
            batch = build_forward_batch(cache, chunks[first : first + shape.requests], shape=shape)
            with fastest_wide_kernel(True):
                scored = run(batch) if run is not None else self.forward(batch, cache, every)  # [R*T, vocab]
            out.extend(scored.index_select(0, batch.token_rows).split(batch.chunk_lens, dim=0))
        return out

    def fixed_shape(self, requests: int, tokens: int, blocks: int) -> StepShape | None:
        """The shape of fixed steps of up to `requests` chunks of `tokens` tokens over `blocks`
        KV blocks: each chunk widened to the fewest tokens, at most twice `tokens`, at which
        every matmul gives a row the same bits in any position (`rows_invariant`); None where
        no width does."""
        for width in range(tokens, 2 * tokens + 1):
            if self.rows_invariant(requests * width):
                return StepShape(requests, width, blocks)
        return None

    def rows_invariant(self, rows: int) -> bool:
        """Whether every matmul of a forward over `rows` rows gives a row the same bits in every
        position. A BLAS library may run the rows past its kernel's row block through a tail
        kernel that sums in another order (MKL's fp32 GEMM on AVX2 does, at some row counts),
        which a fixed shape alone does not prevent. Checked on the first layer's matmuls and
        the head, as fixed steps run them: outputs of rows rolled by one position must be the
        outputs rolled, for two random inputs."""
        weight = self.embed_tokens.weight
        hidden, layer = weight.shape[1], self.layers[0]
        widths = ((layer.qkv, hidden), (layer.o, self.num_heads * self.head_dim), (layer.gate_up, hidden),
                  (layer.down, int(self.config.intermediate_size)), (self.lm_head, hidden))
        generator = torch.Generator(device=weight.device).manual_seed(0)
        with torch.inference_mode(), fastest_wide_kernel(True):
            for module, width in widths:
                for _ in range(2):
                    x = torch.randn(rows, width, generator=generator, device=weight.device).to(weight.dtype)
                    if not torch.equal(module(x.roll(1, 0)), module(x).roll(1, 0)):
                        return False
        return True

    def forward(self, batch: ForwardBatch, cache: PagedKVCache, logit_rows: torch.Tensor) -> torch.Tensor:
        """Logits `[len(logit_rows), vocab]` for the given rows of the flattened `[B*T]` batch.

        Everything shared by the layers — RoPE angles and the attention kernel's inputs — is
        built once here; a layer runs four matmuls, attention and a handful of elementwise ops,
        with no host synchronisation and no Python loop over requests.
        """
        bsz, width = batch.input_ids.shape
        hidden = self.embed_tokens(batch.input_ids)  # [B, T, hidden]
        cos, sin = self._rope(batch.positions, hidden.dtype)  # [B, T, 1, head_dim] each
        attention = self.attention.prepare(batch, self.num_heads // self.num_kv_heads, attention_dtype(hidden))
        inputs = LayerInputs(cos, sin, batch.write_index, batch.kv_rows, attention)
        step = self.step_runner
        runner = step if step is not None and step.takes(hidden, inputs) else self.layer_runner
        hidden = runner(hidden, inputs, cache)
        hidden = rms_norm(hidden, self.final_norm.weight, self.eps)
        selected = hidden.reshape(bsz * width, -1).index_select(0, logit_rows)  # [n_rows, hidden]
        return self.lm_head(selected)  # [n_rows, vocab]

    def eager_layers(self, hidden: torch.Tensor, inputs: LayerInputs, cache: PagedKVCache) -> torch.Tensor:
        """Every decoder layer, eager."""
        return self.layer_group(tuple(self.layers), hidden, inputs, tuple(cache.kv))

    def layer_group(
        self,
        layers: tuple[DecoderLayer, ...],
        hidden: torch.Tensor,  # [B, T, hidden]
        inputs: LayerInputs,
        kvs: tuple[torch.Tensor, ...],  # each [rows, 2, Hkv, D]: the layers' slices of the pool
    ) -> torch.Tensor:
        """Consecutive decoder layers: all of them in an eager forward, or a group of them,
        the unit `specdec.tuning.compiled_layers` compiles (only tensors and weights go in)."""
        for layer, kv in zip(layers, kvs):
            hidden = self._layer(layer, hidden, inputs, kv)
        return hidden

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq.float()  # [B, T, head_dim / 2]
        angles = torch.cat((freqs, freqs), dim=-1)  # [B, T, head_dim]
        cos = (angles.cos() * self.attention_scaling).to(dtype)
        sin = (angles.sin() * self.attention_scaling).to(dtype)
        return cos[:, :, None], sin[:, :, None]

    def _layer(
        self,
        layer: DecoderLayer,
        hidden: torch.Tensor,  # [B, T, hidden]
        inputs: LayerInputs,
        kv: torch.Tensor,  # [rows, 2, Hkv, D] this layer's slice of the paged pool
    ) -> torch.Tensor:
        """One decoder layer: writes the chunk's keys and values to `kv`, returns the new hidden state.

        Only tensors and the layer's weights go in, so the same function runs eager and
        under `torch.compile`.
        """
        attn_in = rms_norm(hidden, layer.input_norm, self.eps)
        hidden = hidden + self._attention(layer, attn_in, inputs, kv)
        mlp_in = rms_norm(hidden, layer.post_norm, self.eps)
        return hidden + self._mlp(layer, mlp_in)

    def _attention(self, layer: DecoderLayer, x: torch.Tensor, inputs: LayerInputs, kv: torch.Tensor) -> torch.Tensor:
        """Grouped-query attention of `x` [B, T, hidden] over each request's paged context in
        `kv`: projections and RoPE, the chunk's keys and values written to the pool, then the
        model's attention kernel (`specdec.model.attention`)."""
        bsz, width, _ = x.shape
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = layer.qkv(x).view(bsz, width, heads + 2 * kv_heads, dim)  # [B, T, H + 2·Hkv, D]
        qk = qkv[:, :, : heads + kv_heads]  # [B, T, H + Hkv, D]: RoPE on queries and keys at once
        qk = qk * inputs.cos + rotate_half(qk) * inputs.sin
        q = qk[:, :, :heads].transpose(1, 2)  # [B, H, T, D]
        new = torch.stack((qk[:, :, heads:], qkv[:, :, heads + kv_heads :]), dim=2)  # [B, T, 2, Hkv, D]
        kv.index_put_((inputs.write_index,), new.view(bsz * width, 2, kv_heads, dim).index_select(0, inputs.kv_rows))
        out = self.attention(q, new, kv, inputs.attention)  # [B, H, T, D]
        return layer.o(out.transpose(1, 2).reshape(bsz, width, heads * dim))

    @staticmethod
    def _mlp(layer: DecoderLayer, x: torch.Tensor) -> torch.Tensor:
        """SwiGLU: down(silu(gate(x)) * up(x)), with gate and up in one matmul."""
        gate, up = layer.gate_up(x).chunk(2, dim=-1)  # [B, T, intermediate] each
        return layer.down(F.silu(gate) * up)
