"""Configuration shared by the two model services; its fields are their command-line flags."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from specdec.errors import InvalidArgumentError
from specdec.flags import inherit, option
from specdec.model.choices import (
    COMPILE_MODES,
    DEFAULT_COMPILE_BUDGET_S,
    DEFAULT_MODEL,
    DEFAULT_PREFILL_CHUNK_TOKENS,
    DTYPE_NAMES,
    INT4_KERNELS,
    NATIVE_STEP_MODES,
    QUANTIZATIONS,
    AttentionKernel,
    device_type,
)
from specdec.serving.security import ServerSecurity
from specdec.stats import DEFAULT_PREFIX, check_metrics_prefix
from specdec.tuning.thread_placement import ThreadPlacement, parse_cores
from specdec.wire.limits import DEFAULT_MAX_MESSAGE_BYTES

#: The `--dtype` / `--quantization` value that leaves the choice to the device (`ModelServiceConfig.precision`).
AUTO = "auto"
#: On SIGTERM, how long a server waits for its work to end (`--drain-timeout-s`): a gateway for
#: its streams, a model service for its slots. Kubernetes' `terminationGracePeriodSeconds` must
#: exceed it (deploy/k8s/base).
DEFAULT_DRAIN_TIMEOUT_S = 60.0
MODEL_HELP = (
    "embedded name (smollm2-135m), random weights in a published architecture (random:llama-3.2-1b, "
    "random:llama-3.2-3b; seed 0, or another with :seed=N), .gguf file, local directory or hub id"
)
DTYPE_HELP = "compute dtype of the forward pass"
QUANTIZATION_HELP = (
    "weight-only quantization: int8 per channel, or int4 in groups (from a GGUF's own Q4 blocks when it has them)"
)


@dataclass(frozen=True)
class Precision:
    """How a model runs: the dtype of its forward pass (one of `DTYPE_NAMES`) and its weights'
    quantization (one of `QUANTIZATIONS`)."""

    dtype: str
    quantization: str


@dataclass(frozen=True)
class AutoPrecision:
    """What `auto` means for one service: a precision on CPUs and one on every other device (GPUs)."""

    cpu: Precision
    accelerator: Precision

    def on(self, device: str) -> Precision:
        return self.cpu if device_type(device) == "cpu" else self.accelerator

    def help(self, text: str, field: str) -> str:
        """`text`, then what `auto` picks for `field` ("dtype" or "quantization")."""
        cpu, accelerator = getattr(self.cpu, field), getattr(self.accelerator, field)
        picks = cpu if cpu == accelerator else f"{cpu} on CPU, {accelerator} on GPUs"
        return f"{text}; auto: {picks}"


#: The model services' `auto`: on CPU fp32, whose greedy output is exact; on a GPU bf16,
#: which halves the bytes every step reads (exactness there needs --dtype float32).
MODEL_AUTO = AutoPrecision(cpu=Precision("float32", "none"), accelerator=Precision("bfloat16", "none"))


@dataclass(frozen=True)
class ModelServiceConfig(ServerSecurity, ThreadPlacement):
    """What a model service (draft or target) loads, how big its pools are, where it listens
    (and, from `ServerSecurity`, its TLS and token settings; from `ThreadPlacement`, which
    cores its threads run on)."""

    #: What `--dtype auto` and `--quantization auto` become, by device.
    AUTO_PRECISION: ClassVar[AutoPrecision] = MODEL_AUTO

    model: str = option(DEFAULT_MODEL, MODEL_HELP)
    dtype: str = option(AUTO, MODEL_AUTO.help(DTYPE_HELP, "dtype"), choices=(AUTO, *sorted(DTYPE_NAMES)))
    device: str = option("cpu", "torch device, e.g. cpu or cuda:0")
    quantization: str = option(
        AUTO, MODEL_AUTO.help(QUANTIZATION_HELP, "quantization"), choices=(AUTO, *QUANTIZATIONS),
        aliases=["--quantize"],
    )
    group_size: int = option(32, "weights per scale group of int4 quantization", advanced=True)
    int4_kernel: str = option(
        "auto", "int4 matmul kernel: int4dot (ours, needs AVX-512 BF16 or AVX2), int4pack (torch's), dequant (float "
        "weights), or auto (time those that run here at start-up, keep the fastest)",
        choices=("auto", *INT4_KERNELS), advanced=True,
    )
    num_layers: int = option(
        0, "keep only the first N decoder layers (0 = all; a weak draft, or a cheap random model, for tests; a "
        "random model builds only those)", advanced=True,
    )
    host: str = option("127.0.0.1", "address to bind")
    port: int = option(0, "port to bind (0 = any free port, printed at start)")
    max_slots: int = option(64, "concurrent request slots")
    kv_token_budget: int = option(16384, "KV-cache capacity in tokens over all slots")
    block_size: int = option(16, "tokens per KV-cache block", advanced=True)
    max_speculative_tokens: int = option(16, "largest K (draft tokens per request and round) accepted", advanced=True)
    max_seq_len: int = option(0, "longest sequence per slot (0 = the model's limit)")
    max_message_bytes: int = option(
        DEFAULT_MAX_MESSAGE_BYTES, "largest gRPC message sent or received", advanced=True,
    )
    prefix_caching: bool = option(
        True, "automatic prefix caching: a new prompt starts from the cached KV blocks of an earlier sequence with "
        "the same leading whole blocks", advanced=True,
    )
    measure_costs: bool = option(
        True, "time the forward pass at start-up so the gateway can plan K from real costs", advanced=True,
    )
    compile: str = option(
        "off", "torch.compile the decoder layers of the steps, verifies and guessed forwards of up to 17 tokens a "
        "request: on, off, or auto "
        "(compile, time both at start-up, keep the faster; eager with --no-measure-costs)",
        choices=COMPILE_MODES, advanced=True,
    )
    compile_budget_s: float = option(
        DEFAULT_COMPILE_BUDGET_S, "start-up seconds for compiled graphs: the first is always built, each further "
        "one only while those before took at most this long", advanced=True,
    )
    native_steps: str = option(
        "auto", "run the decoder layers of decoding forwards of up to 16 tokens (steps, round openings, guessed "
        "forwards) in one native call (an int4 bf16 model on a CPU with the int4dot kernel): on, off, or auto (time "
        "it per shape class against the other layer path at start-up, keep the faster)",
        choices=NATIVE_STEP_MODES, advanced=True,
    )
    attention: str = option(
        "auto", "attention kernel: sdpa (torch's fused attention, scores never materialised), gather (the reference: "
        "each context copied out of the KV pool, scores materialised), or auto (the device's default)",
        choices=("auto", *(kernel.value for kernel in AttentionKernel)), advanced=True,
    )
    cuda_graphs: bool = option(
        True, "on CUDA, replay verify and decode steps from CUDA graphs, captured once per padded shape "
        "(requests, tokens and key blocks rounded up to powers of two)", advanced=True,
    )
    prefill_chunk_tokens: int = option(
        DEFAULT_PREFILL_CHUNK_TOKENS, "most tokens of one request a forward computes: a longer prompt is prefilled "
        "in chunks of this many, one forward after another, in bounded memory and with the same results",
        advanced=True,
    )
    tuning_cache: bool = option(
        True, "reuse the start-up measurements (kernels, compiled steps, forward costs) cached for the same machine, "
        "torch, model, weights, dtype, code and flags; off: measure at every start", advanced=True,
    )
    tune_kernels: bool = option(
        True, "time the kernel candidates at start-up (int4 kernel, output head, dense and wide-input kernels), or "
        "reuse their cached timings; off: each takes its untuned default, the same on every machine, and the start "
        "skips the timing", advanced=True,
    )
    threads: int = option(0, "intra-op threads of the forward pass (0 = one per core)", advanced=True)
    release_threads: bool = option(
        True, "after a call that hands the cores to the other service (a Propose; a Verify of draft tokens), let the "
        "OpenMP threads go instead of spinning into its turn", advanced=True,
    )
    retain_freed_memory: bool = option(
        True, "keep freed memory in the process (glibc malloc thresholds raised) instead of returning it to the "
        "kernel and page-faulting it back at the next call", advanced=True,
    )
    metrics_port: int = option(-1, "Prometheus /metrics port (-1 = off, 0 = any free port)")
    metrics_prefix: str = option(DEFAULT_PREFIX, "prefix of every metric name", advanced=True)
    drain_timeout_s: float = option(
        DEFAULT_DRAIN_TIMEOUT_S, "on SIGTERM: seconds to wait for the gateways' slots to be released, taking no new "
        "ones (then the server stops)", advanced=True,
    )
    #: A gateway renews its lease every few seconds; one that stops (killed, partitioned)
    #: loses its slots this long after its last renewal.
    lease_ttl_s: float = option(
        30.0, "seconds after a gateway's last lease renewal at which its slots are freed", advanced=True,
    )
    #: Calls of several gateways that share these services run as one forward
    #: (`specdec.serving.call_merger`); one gateway's calls are never held. The target holds
    #: long: a gateway out of step is drafting, and its Verify follows its Propose. The draft
    #: holds briefly (`DraftConfig`).
    merge_wait_s: float = option(
        0.2, "longest a Verify or Propose is held for the call of another gateway that holds slots here, to run "
        "both in one forward (0 = merge only calls already waiting)", advanced=True,
    )
    #: gRPC's own policy allows one ping per 5 minutes and closes the connection of a client
    #: that pings more; the gateway's `--keepalive-s` must not be shorter than this.
    min_ping_interval_s: float = option(
        5.0, "shortest interval between a client's keepalive pings that the service accepts (more often: the "
        "connection is closed)", advanced=True,
    )
    bind_threads: bool = inherit(ThreadPlacement, "bind_threads", advanced=True)
    cpu_cores: str = inherit(ThreadPlacement, "cpu_cores", advanced=True)

    def precision(self) -> Precision:
        """The dtype and quantization this service runs with: each `auto` resolved by the device
        (`AUTO_PRECISION`), any other value as set."""
        auto = self.AUTO_PRECISION.on(self.device)
        return Precision(
            dtype=auto.dtype if self.dtype == AUTO else self.dtype,
            quantization=auto.quantization if self.quantization == AUTO else self.quantization,
        )

    def __post_init__(self) -> None:
        self.check_security()
        if self.dtype not in (AUTO, *DTYPE_NAMES):
            raise InvalidArgumentError(f"dtype must be {AUTO!r} or one of {sorted(DTYPE_NAMES)}, got {self.dtype!r}",
                                       field="dtype")
        if self.quantization not in (AUTO, *QUANTIZATIONS):
            raise InvalidArgumentError(
                f"quantization must be {AUTO!r} or one of {QUANTIZATIONS}, got {self.quantization!r}",
                field="quantization"
            )
        _check_device(self.device)
        if self.attention != "auto" and self.attention not in {kernel.value for kernel in AttentionKernel}:
            raise InvalidArgumentError(f"attention must be auto or one of {[k.value for k in AttentionKernel]}, "
                                       f"got {self.attention!r}", field="attention")
        if self.native_steps not in NATIVE_STEP_MODES:
            raise InvalidArgumentError(f"native_steps must be one of {NATIVE_STEP_MODES}, got {self.native_steps!r}",
                                       field="native_steps")
        if self.compile not in COMPILE_MODES:
            raise InvalidArgumentError(f"compile must be one of {COMPILE_MODES}, got {self.compile!r}", field="compile")
        if not 0 <= self.port <= 65535:
            raise InvalidArgumentError(f"port must be in 0..65535, got {self.port}", field="port")
        positive = ("group_size", "max_slots", "kv_token_budget", "block_size", "max_speculative_tokens",
                    "prefill_chunk_tokens")
        for name in (*positive, "max_message_bytes"):
            if getattr(self, name) <= 0:
                raise InvalidArgumentError(f"{name} must be > 0, got {getattr(self, name)}", field=name)
        if self.num_layers < 0:
            raise InvalidArgumentError(f"num_layers must be >= 0, got {self.num_layers}", field="num_layers")
        if self.threads < 0:
            raise InvalidArgumentError(f"threads must be >= 0, got {self.threads}", field="threads")
        if not self.compile_budget_s >= 0:  # also refuses NaN
            raise InvalidArgumentError(f"compile_budget_s must be >= 0, got {self.compile_budget_s}",
                                       field="compile_budget_s")
        parse_cores(self.cpu_cores)
        check_metrics_prefix(self.metrics_prefix)
        if not -1 <= self.metrics_port <= 65535:
            raise InvalidArgumentError(f"metrics_port must be in -1..65535, got {self.metrics_port}",
                                       field="metrics_port")
        if not self.drain_timeout_s >= 0:  # also refuses NaN
            raise InvalidArgumentError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}",
                                       field="drain_timeout_s")
        if not self.lease_ttl_s > 0:
            raise InvalidArgumentError(f"lease_ttl_s must be > 0, got {self.lease_ttl_s}", field="lease_ttl_s")
        if not 0 <= self.merge_wait_s < float("inf"):  # also refuses NaN
            raise InvalidArgumentError(f"merge_wait_s must be a finite number >= 0, got {self.merge_wait_s}",
                                       field="merge_wait_s")
        if not self.min_ping_interval_s > 0:
            raise InvalidArgumentError(f"min_ping_interval_s must be > 0, got {self.min_ping_interval_s}",
                                       field="min_ping_interval_s")
        if self.max_seq_len < 0:
            raise InvalidArgumentError(f"max_seq_len must be >= 0, got {self.max_seq_len}", field="max_seq_len")


def _check_device(device: str) -> None:
    """InvalidArgumentError unless torch takes `device`. torch is imported here, where a service
    starts, and not with this module: a command line builds its parser from these configs."""
    import torch

    try:
        torch.device(device)
    except RuntimeError as error:
        raise InvalidArgumentError(f"device {device!r} is not a torch device (cpu, cuda, cuda:0, ...)",
                                   field="device") from error
