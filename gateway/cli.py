"""The `specdec` command: `specdec serve` runs the trio, `specdec generate` streams from it,
`specdec bench` measures its speed (the harness in benchmarks/specdec_bench)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
from collections.abc import Sequence

import grpc

from gateway.config import GatewayConfig
from gateway.launcher import ServiceProcess, start_service
from gateway.server import create_gateway
from specdec.client import SpecdecClient, collect
from specdec.errors import SpecdecError
from specdec.model.loader import DEFAULT_MODEL
from specdec.serving.grpc_server import serve_until_signal
from specdec_bench.config import add_bench_flags
from specdec_bench.config import config_from_args as bench_config_from_args

DEFAULT_GATEWAY = "127.0.0.1:50050"


def _serve_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address every service binds (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=50050, help="gateway port (default: 50050)")
    parser.add_argument("--metrics-port", type=int, default=-1, help="Prometheus /metrics port (-1 = off, 0 = any)")
    parser.add_argument("--target-model", default=DEFAULT_MODEL, help="target model (default: the embedded SmolLM2-135M)")
    parser.add_argument("--draft-model", default=None, help="draft model (default: the target model, int4-quantized)")
    parser.add_argument("--target-dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--draft-dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--draft-quantization", default="int4", choices=["none", "int8", "int4"])
    parser.add_argument("--device", default="cpu", help="torch device of both model services")
    parser.add_argument("--spec-length", type=int, default=4, help="draft tokens per round, K (default: 4)")
    parser.add_argument("--no-speculative", action="store_true", help="plain decoding; no draft service is started")
    parser.add_argument("--adaptive-k", action=argparse.BooleanOptionalAction, default=True,
                        help="choose K in 0..--spec-length each round from measured costs and acceptance (default: on)")
    parser.add_argument("--draft-probs-dtype", default="float32", choices=["float32", "bfloat16"],
                        help="wire precision of the draft's q vectors (exact either way; bf16 halves them)")
    parser.add_argument("--kv-token-budget", type=int, default=16384, help="KV tokens per model service")
    parser.add_argument("--max-batch-size", type=int, default=16, help="requests decoded together")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="default completion length")


def _generate_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the user message (or raw text with --raw)")
    parser.add_argument("--gateway", default=DEFAULT_GATEWAY, help=f"gateway address (default: {DEFAULT_GATEWAY})")
    parser.add_argument("--raw", action="store_true", help="send the prompt as raw text, not as a chat message")
    parser.add_argument("--system", default=None, help="system message for the chat")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--spec-length", type=int, default=None, help="draft tokens per round for this request")
    parser.add_argument("--no-speculative", action="store_true", help="plain decoding for this request")
    parser.add_argument("--json", action="store_true", help="print one JSON object at the end instead of streaming")
    parser.add_argument("--timeout", type=float, default=None, help="deadline in seconds")


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through `finally`, which stops the children


def serve(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # while the children start; asyncio takes over later
    common = ["--host", args.host, "--device", args.device, "--kv-token-budget", str(args.kv_token_budget)]
    children: list[ServiceProcess] = []
    try:
        # One model after the other: each times its forward at start-up (the costs adaptive K
        # plans with), and two processes timing at once on the same cores skew both tables.
        try:
            children.append(start_service("target_server", [*common, "--model", args.target_model, "--dtype", args.target_dtype]))
            target = children[0].wait_ready()
            drafts = []
            if not args.no_speculative:
                children.append(start_service("draft_server", [
                    *common, "--model", args.draft_model or args.target_model,
                    "--dtype", args.draft_dtype, "--quantization", args.draft_quantization,
                ]))
                drafts.append(children[1].wait_ready())
        except (RuntimeError, TimeoutError) as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
        draft_address = drafts[0].address if drafts else ""
        config = GatewayConfig(
            target_address=target.address, draft_address=draft_address, host=args.host, port=args.port,
            speculative=not args.no_speculative, spec_length=args.spec_length,
            adaptive_k=args.adaptive_k, draft_probs_dtype=args.draft_probs_dtype,
            max_new_tokens_default=args.max_new_tokens, max_batch_size=args.max_batch_size,
            metrics_port=args.metrics_port,
        )
        return start_gateway(config)
    finally:
        for child in reversed(children):
            child.stop()


async def run_gateway(config: GatewayConfig) -> None:
    """Start the gateway and serve until SIGINT / SIGTERM."""
    running = await create_gateway(config)
    extra = f", metrics on :{running.metrics_port}" if running.metrics_port is not None else ""
    print(f"specdec gateway listening on {config.host}:{running.port}{extra}", flush=True)
    await serve_until_signal(running, grace=5.0)


def start_gateway(config: GatewayConfig) -> int:
    """Run the gateway to the end; a refused start-up prints one line and returns 1."""
    try:
        asyncio.run(run_gateway(config))
    except SpecdecError as error:  # e.g. tokenizer mismatch, spec_length above the services' maximum
        print(f"error: gateway refused to start: {error}", file=sys.stderr)
        return 1
    except grpc.aio.AioRpcError as error:
        print(f"error: a model service did not answer: {error.code().name}: {error.details()}", file=sys.stderr)
        return 1
    return 0


def generate(args: argparse.Namespace) -> int:
    if args.raw:
        prompt: str | list[dict[str, str]] = args.prompt
    else:
        prompt = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.prompt}
        ]
    options = dict(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        repetition_penalty=args.repetition_penalty, seed=args.seed, stop=args.stop,
        speculative=False if args.no_speculative else None, spec_length=args.spec_length,
    )
    def echo(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    try:
        with SpecdecClient(args.gateway, timeout=args.timeout) as client:
            result = collect(client.stream(prompt, **options), on_text=None if args.json else echo)
    except grpc.RpcError as error:
        print(f"\nerror: {error.code().name}: {error.details()}", file=sys.stderr)  # type: ignore[attr-defined]
        return 1
    if args.json:
        print(json.dumps(result.as_dict(), ensure_ascii=False))
    else:
        print(
            f"\n\n[{result.completion_tokens} tokens, finish: {result.finish_reason}, "
            f"acceptance rate {result.acceptance_rate:.2f}, mean acceptance length {result.mean_acceptance_length:.2f}, "
            f"{result.tokens_per_s:.1f} tok/s, first token {result.time_to_first_token_s * 1000:.0f} ms]",
            file=sys.stderr,
        )
    return 0


def bench(args: argparse.Namespace, argv: Sequence[str]) -> int:
    try:
        config = bench_config_from_args(args)
    except SpecdecError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:  # tqdm and matplotlib (the `bench` extra) load only when benchmarking
        from specdec_bench.runner import run
    except ModuleNotFoundError as error:
        print(f"error: specdec bench needs {error.name}: pip install -e '.[bench]'", file=sys.stderr)
        return 1
    return run(config, argv)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specdec", description="Speculative-decoding LLM server")
    parser.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    commands = parser.add_subparsers(dest="command", required=True)
    _serve_flags(commands.add_parser("serve", help="start draft, target and gateway; stop all on Ctrl-C / SIGTERM"))
    _generate_flags(commands.add_parser("generate", help="stream a generation from a running gateway"))
    add_bench_flags(commands.add_parser(
        "bench", help="measure speed: starts the trio, writes results JSON, plots and docs/benchmarks.md",
        description="Speed harness: W1 single requests (plain vs speculative), transformers' plain and assisted "
        "generate, fixed-K and concurrency sweeps, the services' measured costs. The last line printed is "
        "'speedup=… vs_hf_assisted=… efficiency=… alpha=… c=…'.",
    ))
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "serve":
        return serve(args)
    if args.command == "bench":
        return bench(args, sys.argv[1:] if argv is None else argv)
    return generate(args)


if __name__ == "__main__":
    sys.exit(main())
