"""What the target and draft servicers share: Info / Truncate / Release / RenewLease, start-up,
and the expiry of slots whose gateway stopped renewing its lease.

Both services hold slots in a `ModelEngine`, so these rpcs are the same on both; each
service adds its own work rpcs (Prefill / Verify, or Propose) on top.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections.abc import Awaitable, Callable, Generator, Sequence
from typing import TypeVar

import grpc
import torch

from specdec.cost_model import ForwardCost
from specdec.errors import InvalidArgumentError
from specdec.model.runtime import ModelRuntime, build_runtime
from specdec.serving.call_merger import CallMerger, WorkCall
from specdec.serving.config import AUTO, ModelServiceConfig
from specdec.serving.engine import ModelEngine
from specdec.serving.errors import grpc_errors
from specdec.serving.grpc_server import RunningServer, start_server
from specdec.serving.metrics import ServiceStats, service_endpoint
from specdec.serving.serial_executor import SerialExecutor, cancel_and_wait
from specdec.serving.streams import Req, Resp, answer_each
from specdec.tuning.cost_profile import one_token_step
from specdec.tuning.heap import retain_freed_memory
from specdec.tuning.inductor import use_compile_cache
from specdec.tuning.openmp import proc_bind
from specdec.tuning.startup import StartupTuner
from specdec.tuning.thread_placement import parse_cores
from specdec.tuning.timing import device_clock
from specdec.v1 import common_pb2
from specdec.wire.items import Lease

log = logging.getLogger(__name__)

E = TypeVar("E", bound=ModelEngine)
C = TypeVar("C", bound=ModelServiceConfig)
T = TypeVar("T")
Call = TypeVar("Call", bound=WorkCall)
Out = TypeVar("Out")
Response = TypeVar("Response")


class SlotServicer:
    """Info, Truncate and Release over an engine, run on the service's model worker."""

    def __init__(self, engine: ModelEngine, worker: SerialExecutor, stats: ServiceStats) -> None:
        self.engine = engine
        self.worker = worker
        self.stats = stats
        #: `grpc_errors` reports every call's latency and status here.
        self.rpc_observer = stats
        #: Set when the service stops: streamed rpcs waiting for their next request end.
        self.closing = asyncio.Event()

    def merged(
        self, method: str, compute: Callable[[Sequence[Call]], Sequence[Out]],
        encode: Callable[[Call, Out], Response],
        backoff_holds: tuple[int, int] | None = None,
    ) -> CallMerger[Call, Out, Response]:
        """The call merger of the work rpc `method`: several gateways' calls in one forward,
        held up to the service's `merge_wait_s` for a gateway that is due; one that misses a
        hold is not waited for during `backoff_holds` holds (the first miss's, the longest;
        None: the merger's own)."""
        wait = self.engine.config.merge_wait_s
        first, longest = (None, None) if backoff_holds is None else (h * wait for h in backoff_holds)
        return CallMerger(method, self.worker, compute, encode, self.engine.leases.holders_with_slots, self.stats,
                          wait, first_backoff_s=first, max_backoff_s=longest)

    async def answer_each(
        self, context: grpc.aio.ServicerContext, method: str, handle: Callable[[Req], Awaitable[Resp]]
    ) -> None:
        """Serve a streamed rpc: `handle` each request as the unary rpc `method` would."""
        await answer_each(context, method, handle, self.rpc_observer, self.closing)

    def end_streams(self) -> None:
        self.closing.set()

    @grpc_errors
    async def Info(self, request: common_pb2.InfoRequest, context: grpc.aio.ServicerContext) -> common_pb2.ModelInfo:
        # Answered on the event loop, not queued behind the running batch: `info()` only
        # reads counters (each read is atomic under the GIL), never tensors.
        return self.engine.info().to_pb()

    @grpc_errors
    async def Truncate(
        self, request: common_pb2.TruncateRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.TruncateResponse:
        length = await self.worker.run(self.engine.truncate, request.slot_id, request.new_len)
        return common_pb2.TruncateResponse(cached_len=length)

    @grpc_errors
    async def Release(
        self, request: common_pb2.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.ReleaseResponse:
        await self.worker.run(self.engine.release, request.slot_id)
        return common_pb2.ReleaseResponse()

    @grpc_errors
    async def RenewLease(
        self, request: common_pb2.RenewLeaseRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.RenewLeaseResponse:
        lease = Lease.from_pb(request.lease)
        if lease is None or not lease.holder or not lease.incarnation:
            raise InvalidArgumentError("lease: holder and incarnation must both be set", field="lease")
        # Recorded here on the event loop, at once: a renewal must not wait behind a long batch.
        stale = self.engine.leases.renew(lease)
        if stale:  # rare: the holder restarted; its old slots are freed on the worker
            await self.worker.run(self.engine.free_stale, lease.holder, stale)
        return common_pb2.RenewLeaseResponse(ttl_s=self.engine.leases.ttl_s, swept_slots=len(stale))


#: Seconds between tries to load a deferred graph while the KV pool has no room for its warm-up.
GRAPH_RETRY_S = 1.0
#: Seconds without a request (counted from start-up too) before each deferred graph loads: a
#: graph takes seconds to build and a request arriving meanwhile waits for it, so requests go
#: first, such as those a restarted service's gateways send it at once
#: (docs/deployment.md#behind-a-load-balancer).
IDLE_BEFORE_LOADING_S = 3.0
#: Seconds without a request before each forward of a cost table timed again: timed beside
#: requests, it would price the machine as the other service's work left it.
IDLE_BEFORE_TIMING_S = 1.0


async def load_graphs_after_start(engine: ModelEngine, worker: SerialExecutor) -> None:
    """Load the compiled graphs the start-up left for later (`StartupTuner.load_pending`), one
    per model-worker call once no request came for `IDLE_BEFORE_LOADING_S`: a request arriving
    meanwhile waits for at most one graph. Under steady load the steps stay eager until a pause."""
    started = time.perf_counter()
    if not engine.tuner.pending:
        return
    since = time.monotonic()
    while True:
        while (idle := min(worker.idle_for(), time.monotonic() - since)) < IDLE_BEFORE_LOADING_S:
            await asyncio.sleep(IDLE_BEFORE_LOADING_S - idle)
        if not await worker.run(engine.tuner.load_pending, engine.cache):
            break
        await asyncio.sleep(GRAPH_RETRY_S if engine.cache.blocks.free_tokens < engine.cache.capacity_tokens // 2 else 0)
    log.info("compiled steps loaded after start-up in %.1f s: %s%s", time.perf_counter() - started,
             ", ".join(engine.tuner.compiled_steps(engine.model)) or "none",
             f" (measured: {', '.join(engine.tuner.loaded_detail)})" if engine.tuner.loaded_detail else "")
    if engine.tuner.costs_outdated(engine.model):
        await time_costs_again(engine, worker)


async def time_costs_again(engine: ModelEngine, worker: SerialExecutor) -> None:
    """Time the forward cost table again with the steps the service now serves, one forward
    per model-worker call once no request came for `IDLE_BEFORE_TIMING_S` (a request arriving
    meanwhile waits for at most one forward, and the timings are not those of a busy machine),
    and publish it: the gateway adopts the new table from the next Info. Where the pool runs
    out of room on the way, the old table stays."""
    config, old = engine.config, engine.forward_costs
    steps = engine.tuner.remeasure_costs(engine.model, engine.cache, max_batch=config.max_slots,
                                         max_tokens=config.max_speculative_tokens + 1)
    started = time.perf_counter()
    try:
        while True:
            while (idle := worker.idle_for()) < IDLE_BEFORE_TIMING_S:
                await asyncio.sleep(IDLE_BEFORE_TIMING_S - idle)
            if (done := await worker.run(_advance, steps))[0]:
                break
    except Exception:  # noqa: BLE001 - the table timed at start-up still holds
        log.warning("forward costs not timed again after the compiled steps loaded", exc_info=True)
        await worker.run(steps.close)
        return
    costs = done[1]
    if costs:
        engine.forward_costs = costs
        log.info("forward costs timed again with the compiled steps in %.1f s: 1-token step %s ms, was %s ms",
                 time.perf_counter() - started, _step_ms(costs), _step_ms(old))


def _advance(steps: Generator[None, None, T]) -> tuple[bool, T | None]:
    """One step of `steps`: (False, None), or (True, its value) once it has ended."""
    try:
        next(steps)
    except StopIteration as stop:
        return True, stop.value
    return False, None


def _step_ms(costs: Sequence[ForwardCost]) -> str:
    step = one_token_step(costs)
    return "?" if step is None else f"{step * 1e3:.1f}"


#: Seconds between looks at the slots still held while a service drains.
DRAIN_POLL_S = 0.25


async def release_slots(engine: ModelEngine, timeout_s: float) -> None:
    """A stopping service's drain: no new slot from now on (`DrainingError`: UNAVAILABLE), and
    up to `timeout_s` for the gateways to release the slots they hold (their requests end, or
    their leases expire). Slots made without a lease (tests, admin tools) are nobody's to
    release: not waited for."""
    engine.draining = True
    started = time.monotonic()
    held = engine.leases.held_slots
    log.info("draining: %d slots held, up to %.0f s for their gateways to release them", held(), timeout_s)
    while held() and time.monotonic() - started < timeout_s:
        await asyncio.sleep(DRAIN_POLL_S)
    if held():
        log.warning("drain: %d slots still held after %.0f s are dropped", held(), timeout_s)
    else:
        log.info("drained in %.1f s", time.monotonic() - started)


async def expire_leases_forever(engine: ModelEngine, worker: SerialExecutor) -> None:
    """Free the slots of silent gateways, checking a few times per TTL (at least every second)."""
    interval = min(1.0, engine.leases.ttl_s / 4)
    while True:
        await asyncio.sleep(interval)
        try:
            await worker.run(engine.expire_leases)
        except Exception:  # noqa: BLE001 - a bug here must not end expiry for good
            log.exception("lease expiry failed")


#: The service flags a start-up measurement depends on besides model, dtype, quantization,
#: device and threads (`specdec.tuning.store.TuningKey.settings`).
TUNING_SETTINGS = (
    "num_layers", "group_size", "int4_kernel", "compile", "compile_budget_s", "measure_costs",
    "max_slots", "max_speculative_tokens", "kv_token_budget", "block_size", "cpu_cores", "attention",
    "prefill_chunk_tokens", "tune_kernels", "native_steps",
)


def build_engine(engine_cls: Callable[[ModelRuntime, C], E], config: C) -> E:
    """Apply the memory, thread and core settings, load the configured model and wrap an engine
    of `engine_cls` around it (on the model worker thread, which runs all torch work); log
    every start-up choice in one line and keep the measured ones for the next start."""
    heap = config.retain_freed_memory and retain_freed_memory()
    cores = parse_cores(config.cpu_cores)
    if cores:
        os.sched_setaffinity(0, cores)
    if threads := config.threads or len(cores):
        torch.set_num_threads(threads)
    settings = {name: getattr(config, name) for name in TUNING_SETTINGS}
    precision = config.precision()
    tuner = StartupTuner.for_service(
        model=config.model, dtype=precision.dtype, quantization=precision.quantization, device=config.device,
        settings=settings, reuse=config.tuning_cache,
    )
    for name in ("dtype", "quantization"):
        chosen = getattr(config, name) != AUTO
        tuner.note(name, getattr(precision, name), "flag" if chosen else "fixed",
                   "" if chosen else f"auto on {torch.device(config.device).type}")
    tuner.note("heap", "retained" if heap else "default", "flag" if config.retain_freed_memory == heap else "fixed")
    tuner.note("threads", torch.get_num_threads(), "flag" if config.threads or cores else "fixed",
               f"cores {config.cpu_cores}" if cores else "")
    tuner.note("openmp_binding", proc_bind(), "flag")
    tuner.note("release_threads", "on" if config.release_threads else "off", "flag")
    cache_dir, reason = use_compile_cache()
    tuner.note("compile_cache", cache_dir, reason)
    runtime = build_runtime(
        config.model, dtype=precision.dtype, device=config.device,
        quantization=precision.quantization, num_layers=config.num_layers, group_size=config.group_size,
        int4_kernel=config.int4_kernel, tuner=tuner if config.tune_kernels else None,
    )
    if not config.tune_kernels:  # the later choices (compiled layers, costs) are still the tuner's
        tuner.note("kernels", "untuned defaults", "flag")
        runtime = dataclasses.replace(runtime, tuner=tuner)
    engine = engine_cls(runtime, config)
    tuner.save()
    log.info("%s", tuner.line())
    return engine


async def start_model_service(
    config: C,
    engine: E | None,
    engine_cls: Callable[[ModelRuntime, C], E],
    make_servicer: Callable[[E, SerialExecutor, ServiceStats], SlotServicer],
    add_servicer: Callable[[SlotServicer, grpc.aio.Server], None],
    service_name: str,
    work_methods: Sequence[str],
) -> RunningServer:
    """Build the engine (unless given) on the model worker and start serving.

    All torch work of a service happens on its one worker thread, model loading included:
    a second thread that has run OpenMP kernels (e.g. the main thread, had it loaded the
    model) keeps its own thread team, which roughly halves small-kernel speed on 2 cores.
    Its compute times wait for the configured device.
    """
    worker = SerialExecutor(service_name.rsplit(".", 1)[-1], clock=device_clock(config.device))
    if engine is None:
        engine = await worker.run(build_engine, engine_cls, config)
    label = service_name.rsplit(".", 1)[-1].removesuffix("Service").lower()  # "target" / "draft"
    stats = ServiceStats(label, ["Info", "Truncate", "Release", "RenewLease", *work_methods], work_methods)
    endpoint = service_endpoint(stats, engine, config.metrics_prefix)
    servicer = make_servicer(engine, worker, stats)
    expiry = asyncio.create_task(expire_leases_forever(engine, worker), name="specdec-lease-expiry")
    graphs = asyncio.create_task(load_graphs_after_start(engine, worker), name="specdec-graphs")

    async def stop() -> None:
        await cancel_and_wait(graphs)
        await cancel_and_wait(expiry)
        endpoint.close()
        await asyncio.to_thread(worker.shutdown)  # waits for the running batch off the loop

    try:
        running = await start_server(
            lambda server: add_servicer(servicer, server),
            [service_name],
            host=config.host,
            port=config.port,
            max_message_bytes=config.max_message_bytes,
            on_stop=stop,
            on_drain=servicer.end_streams,
            credentials=config.server_credentials(),
            token=config.token(),
            min_ping_interval_s=config.min_ping_interval_s,
        )
    except BaseException:  # e.g. the port is taken
        await stop()
        raise
    running.finish_work = lambda: release_slots(engine, config.drain_timeout_s)
    if config.metrics_port >= 0:
        running.metrics_port = endpoint.serve(config.metrics_port, config.host)
    return running
