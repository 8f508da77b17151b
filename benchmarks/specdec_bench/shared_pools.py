"""Two gateways on one target/draft pair whose KV pools hold one gateway's full batch: what
clients see, and the throughput beside one gateway alone at the same total concurrency.

    python -m specdec_bench.shared_pools                  # 16 streams, batches of 8, 96 tokens
    python -m specdec_bench.shared_pools --streams 8 --batch 4 --rounds 1
    python -m specdec_bench.shared_pools --pools-hold 2    # pools for both: what two gateways cost alone
    python -m specdec_bench.shared_pools --k 4             # K pinned: the planners out of the comparison
    python -m specdec_bench.shared_pools --reserve-kv-growth  # admission that never preempts
    python -m specdec_bench.shared_pools --half-batches    # two gateways of 4: the split alone
    python -m specdec_bench.shared_pools --half-batches --gateway-args=--no-speculative

Each gateway admits as if the pools were its own; the services refuse what their real free
blocks cannot hold, and the gateways queue or preempt (docs/deployment.md#shared-pools).
Alternating rounds, each `streams` greedy requests at once: all on one gateway, then split
evenly over two. Counted: requests that failed (a RESOURCE_EXHAUSTED reaching a client is
one), whether every answer equals the one-gateway answer for its prompt, aggregate decode
throughput (completion tokens ÷ the round's wall time), the refusals and preemptions the
gateways counted, per layout how the planners speculated: mean K of the speculating
requests' rounds, the share of rounds a request could have drafted in but did not, and the
acceptance rate (all from the gateways' `/metrics`), and how the services merged the two
gateways' calls: the target's Verify and the draft's Propose runs, and the calls of them
that ran with the other gateway's (`specdec.serving.call_merger`, from the services' own).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
import urllib.request
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import grpc
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from specdec.cli.launcher import ServiceProcess
from specdec.client import GenerationResult, SpecdecClient
from specdec_bench.results import cpu_model
from specdec_bench.stack import running_stack, second_gateway
from specdec_bench.workloads import PROMPTS, chat

COUNTERS = (
    "specdec_num_pool_refusals_total", "specdec_num_preemptions_total", "specdec_spec_decode_num_drafts_total",
    "specdec_spec_decode_num_draft_tokens_total", "specdec_spec_decode_num_accepted_tokens_total",
    "specdec_spec_decode_off_rounds_total",
)


def _samples(metrics_port: int) -> Iterator[Sample]:
    """Every sample of the Prometheus endpoint at `metrics_port`."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    for family in text_string_to_metric_families(text):
        yield from family.samples


def _counters(metrics_port: int) -> dict[str, float]:
    out = dict.fromkeys(COUNTERS, 0.0)
    for sample in _samples(metrics_port):
        if sample.name in out:
            out[sample.name] += sample.value
    return out


#: (service, work rpc) whose runs and merged calls the summary counts, from the services' /metrics.
MERGED = (("target", "Verify"), ("draft", "Propose"))


def _merge_counters(ports: dict[str, int]) -> dict[str, float]:
    """Per service: its work rpc's runs (forwards) and the calls of them merged with another
    gateway's (`specdec.serving.call_merger`)."""
    out: dict[str, float] = {}
    for service, method in MERGED:
        out[f"{service} runs"] = out[f"{service} merged calls"] = 0.0
        for sample in _samples(ports[service]):
            if sample.labels.get("method") != method:
                continue
            if sample.name == "specdec_service_forward_batch_size_count":
                out[f"{service} runs"] += sample.value
            elif sample.name == "specdec_service_merged_calls_total":
                out[f"{service} merged calls"] += sample.value
    return out


def _metrics_port(service: ServiceProcess) -> int:
    port = service.ready.metrics_port if service.ready is not None else None
    if port is None:
        raise RuntimeError(f"{service.name}'s ready line names no metrics port")
    return port


def _gateways_counters(ports: list[int]) -> dict[str, float]:
    """`COUNTERS` summed over the gateways at `ports`."""
    each = [_counters(port) for port in ports]
    return {name: sum(c[name] for c in each) for name in COUNTERS}


def _speculation(counted: dict[str, float]) -> dict[str, float]:
    """How the planners speculated over the counted rounds (NaN where nothing was counted)."""
    drafts = counted["specdec_spec_decode_num_drafts_total"]
    tokens = counted["specdec_spec_decode_num_draft_tokens_total"]
    off = counted["specdec_spec_decode_off_rounds_total"]
    nan = float("nan")
    return {
        "mean_k": tokens / drafts if drafts else nan,
        "off_share": off / (off + drafts) if off + drafts else nan,
        "acceptance": counted["specdec_spec_decode_num_accepted_tokens_total"] / tokens if tokens else nan,
    }


def _round(addresses: list[str], prompts: list[str], tokens: int) -> tuple[float, list[GenerationResult | str]]:
    """All `prompts` at once, spread over `addresses` in turn: wall seconds, and each answer or its error."""
    def one(i: int) -> GenerationResult | str:
        with SpecdecClient(addresses[i % len(addresses)], timeout=600) as client:
            try:
                return client.generate(chat(prompts[i]), max_new_tokens=tokens)
            except grpc.RpcError as error:
                return f"{error.code().name}: {error.details()}"

    started = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(one, range(len(prompts))))
    return time.perf_counter() - started, results


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=16, help="requests at once, in all")
    parser.add_argument("--batch", type=int, default=8, help="each gateway's --max-batch-size")
    parser.add_argument("--tokens", type=int, default=96, help="new tokens per request")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of each layout, alternating")
    parser.add_argument("--pools-hold", type=int, default=1,
                        help="how many gateways' full batches the pools hold (2: the gateways never contend)")
    parser.add_argument("--reserve-kv-growth", action="store_true",
                        help="gateways reserve their requests' growth (no preemption; docs/deployment.md#shared-pools)")
    parser.add_argument("--k", type=int, default=0,
                        help="pin K on both gateways (--no-adaptive-k); 0 leaves it to their planners")
    parser.add_argument("--half-batches", action="store_true",
                        help="split over two more gateways of half the batch each: together they never hold more "
                        "than the pools do, so the split alone is measured (no preemption)")
    parser.add_argument("--service-args", default="",
                        help="more flags for both model services, e.g. '--threads 1'")
    parser.add_argument("--gateway-args", default="",
                        help="more flags for every gateway, e.g. '--no-speculative'")
    args = parser.parse_args(argv)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.streams)]
    # One gateway's full batch: `batch` requests of a chat prompt (under 64 tokens) and `tokens`
    # more, with a round's room; rounded up to whole blocks of 16.
    budget = args.pools_hold * args.batch * -(-(64 + args.tokens + 16) // 16) * 16
    pool = f"--kv-token-budget {budget} --metrics-port 0 {args.service_args}"
    gateway_args = f"--max-batch-size {args.batch} --max-queue {args.streams}"
    if args.k:
        gateway_args += f" --no-adaptive-k --num-speculative-tokens {args.k}"
    if args.reserve_kv_growth:
        gateway_args += " --reserve-kv-growth"
    gateway_args += f" {args.gateway_args}"
    rates: dict[str, list[float]] = {"one gateway": [], "two gateways": []}
    lost: dict[str, int] = dict.fromkeys(rates, 0)
    counted = {name: dict.fromkeys(COUNTERS, 0.0) for name in rates}
    merged: dict[str, dict[str, float]] = {name: {} for name in rates}
    answers: dict[str, list[int]] = {}
    unequal = 0
    half = ("--max-batch-size", str(max(1, args.batch // 2))) if args.half_batches else ()
    with running_stack(target_args=pool, draft_args=pool, gateway_args=gateway_args) as stack, \
            contextlib.ExitStack() as more:
        others = [more.enter_context(second_gateway(stack, gateway_args, *half)) for _ in range(2 if half else 1)]
        ports = [stack.metrics_port, *(_metrics_port(other) for other in others)]
        service_ports = {"target": _metrics_port(stack.target), "draft": _metrics_port(stack.draft)}
        pair = [other.address for other in others] if half else [stack.gateway.address, others[0].address]
        layouts = {"one gateway": [stack.gateway.address], "two gateways": pair}
        for _ in range(args.rounds):
            for name, addresses in layouts.items():
                before, merged_before = _gateways_counters(ports), _merge_counters(service_ports)
                wall, results = _round(addresses, prompts, args.tokens)
                after, merged_after = _gateways_counters(ports), _merge_counters(service_ports)
                for counter in COUNTERS:
                    counted[name][counter] += after[counter] - before[counter]
                for counter, value in merged_after.items():
                    merged[name][counter] = merged[name].get(counter, 0.0) + value - merged_before[counter]
                done = [r for r in results if isinstance(r, GenerationResult)]
                lost[name] += len(results) - len(done)
                rates[name].append(sum(r.completion_tokens for r in done) / wall)
                for prompt, result in zip(prompts, results):
                    if isinstance(result, GenerationResult):
                        unequal += answers.setdefault(prompt, result.token_ids) != result.token_ids
                    else:
                        print(f"{name}: lost a request: {result}")
    summary = {
        "cpu": cpu_model(), "streams": args.streams, "batch": args.batch, "tokens": args.tokens,
        "kv_token_budget": budget, "pools_hold": args.pools_hold, "rounds": args.rounds,
        "lost": lost, "unequal_answers": unequal,
        "tok_per_s": {name: statistics.median(v) for name, v in rates.items()},
        "two_over_one": statistics.median(b / a for a, b in zip(rates["one gateway"], rates["two gateways"])),
        "pool_refusals": sum(c[COUNTERS[0]] for c in counted.values()),
        "preemptions": sum(c[COUNTERS[1]] for c in counted.values()),
        "speculation": {name: _speculation(c) for name, c in counted.items()},
        "merged": merged, "k": args.k or "adaptive", "reserve_kv_growth": args.reserve_kv_growth,
        "half_batches": args.half_batches,
        "service_args": args.service_args,
        "gateway_args": args.gateway_args,
    }
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
