"""The `specdec` command: `specdec serve` runs the trio, `specdec generate` streams from it,
`specdec bench` measures its speed (the harness in benchmarks/specdec_bench)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import sys
from collections.abc import Sequence

import grpc

from specdec.cli.health import add_health_flags, health
from specdec.cli.launcher import ServiceProcess, start_service
from specdec.client import SpecdecClient, collect
from specdec.draft_server.config import DraftConfig
from specdec.errors import SpecdecError
from specdec.flags import add_flags, from_args, to_argv
from specdec.gateway.config import GatewayConfig
from specdec.gateway.draft_sources import SpeculationMethod
from specdec.gateway.entrypoint import start_gateway
from specdec.serving.config import ModelServiceConfig
from specdec.serving.entrypoint import LOG_LEVELS, configure_logging
from specdec.serving.security import read_token
from specdec.target_server.config import TargetConfig
from specdec_bench.config import add_bench_flags
from specdec_bench.config import config_from_args as bench_config_from_args

DEFAULT_GATEWAY = "127.0.0.1:50050"
#: `specdec serve` is the one-command way to try the server, so it answers OpenAI clients at
#: once, on the port vLLM and SGLang use; `--http-port -1` turns it off.
SERVE_HTTP_PORT = 8000
#: `--draft-model none`: serve target and gateway alone, drafting with lookups.
NO_DRAFT = "none"
#: Each model service binds the gateway's host on a free port; the gateway finds them itself.
_CHILD_SKIP = ("host", "port")


#: Flags of the model services that `specdec serve` lists as advanced although their own
#: command lines show them first: the gateway's own flags say the same for the whole server.
_CHILD_DEMOTE = ("tls_cert", "tls_key", "auth_token_file", "metrics_port", "max_seq_len")


def _serve_flags(parser: argparse.ArgumentParser) -> None:
    """The gateway's flags as they are, then the target's and the draft's with a prefix: the
    everyday ones of all three first, then their advanced ones."""
    parser.add_argument(
        "--log-level", default=argparse.SUPPRESS, choices=LOG_LEVELS,
        help="the gateway's log level; the model services log at INFO (default: WARNING)",
    )
    draft_title = "draft service (not started with --no-speculative or --draft-model none)"
    groups = [parser.add_argument_group(title) for title in ("gateway", "target service", draft_title)]
    advanced = [parser.add_argument_group(f"advanced: {group.title}") for group in groups]
    add_flags(groups[0], GatewayConfig, advanced=advanced[0], skip=("target_address", "draft_address"),
              defaults={"http_port": SERVE_HTTP_PORT})
    add_flags(groups[1], TargetConfig, advanced=advanced[1], prefix="target-", skip=_CHILD_SKIP, demote=_CHILD_DEMOTE)
    add_flags(
        groups[2], DraftConfig, advanced=advanced[2], prefix="draft-", skip=_CHILD_SKIP, demote=_CHILD_DEMOTE,
        defaults={"model": ""},
        helps={"model": "draft model; empty: the target model, in the draft's own dtype and quantization; "
                        f"'{NO_DRAFT}': no draft service, the gateway drafts with lookups alone"},
    )


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
    parser.add_argument("--min-p", type=float, default=0.0,
                        help="drop tokens below this share of the most likely one's probability; 0 = off")
    parser.add_argument("--presence-penalty", type=float, default=0.0,
                        help="subtracted from the logit of every token already generated, in [-2, 2]")
    parser.add_argument("--frequency-penalty", type=float, default=0.0,
                        help="subtracted from a token's logit once per time it was generated, in [-2, 2]")
    parser.add_argument("--logit-bias", type=_logit_bias, action="append", default=[], metavar="TOKEN_ID=BIAS",
                        help="add BIAS (in [-100, 100]) to a token's logit (repeatable)")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument(
        "--num-speculative-tokens", type=int, default=None, help="draft tokens per round for this request",
    )
    parser.add_argument("--no-speculative", action="store_true", help="plain decoding for this request")
    parser.add_argument(
        "--method", choices=[m.value for m in SpeculationMethod], default=None,
        help="what to draft with: auto (chosen per round), model (the draft model), ngram (lookups in the text "
        "seen), none (plain); default: the gateway's",
    )
    parser.add_argument(
        "--verification", choices=["rejection", "drawn"], default=None,
        help="how sampled draft tokens are judged: rejection (keeps the most) or drawn (the tokens plain decoding "
        "draws, so a seeded request's output depends on its seed alone); default: drawn when --seed is given",
    )
    parser.add_argument(
        "--logprobs", type=int, default=None, metavar="N",
        help="report each token's logprob and its N most likely alternatives (0-20; with --json)",
    )
    parser.add_argument(
        "--processed-logprobs", action="store_true",
        help="logprobs of the distribution after the request's transforms instead of the model's raw one",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object at the end instead of streaming")
    parser.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    parser.add_argument("--tls-ca", default="", help="PEM CA of the gateway's certificate: connect over TLS")
    parser.add_argument("--tls-cert", default="", help="PEM client certificate, for a gateway that demands one")
    parser.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")
    parser.add_argument(
        "--token-file", default="", help="file holding the gateway's bearer token (default: $SPECDEC_AUTH_TOKEN)",
    )


def _logit_bias(text: str) -> tuple[int, float]:
    """A `--logit-bias` value, TOKEN_ID=BIAS."""
    token, sep, bias = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected TOKEN_ID=BIAS, e.g. 42=-100, got {text!r}") from None


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through `finally`, which stops the children


def serve_configs(args: argparse.Namespace) -> tuple[TargetConfig, DraftConfig | None, GatewayConfig]:
    """What `specdec serve` runs: checked before any process starts. The gateway's service
    addresses are placeholders ("-") until the services are up."""
    target = from_args(TargetConfig, args, prefix="target-", host=args.host, port=0)
    draft = None
    if args.speculative and args.draft_model != NO_DRAFT:
        draft_model = args.draft_model or target.model
        draft = from_args(DraftConfig, args, prefix="draft-", host=args.host, port=0, model=draft_model)
    gateway = from_args(GatewayConfig, args, target_address="-", draft_address="-" if draft else "")
    return target, draft, gateway


def serve(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # while the children start; asyncio takes over later
    try:
        target_config, draft_config, gateway_config = serve_configs(args)
    except SpecdecError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    children: list[ServiceProcess] = []
    try:
        # One model after the other: each times its forward at start-up (the costs adaptive K
        # plans with), and two processes timing at once on the same cores skew both tables.
        try:
            target = _start(children, "specdec.target_server", target_config)
            draft = _start(children, "specdec.draft_server", draft_config) if draft_config else None
        except (RuntimeError, TimeoutError) as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
        return start_gateway(dataclasses.replace(
            gateway_config, target_address=target.address, draft_address=draft.address if draft else "",
        ))
    finally:
        for child in reversed(children):
            child.stop()


def _start(children: list[ServiceProcess], module: str, config: ModelServiceConfig) -> ServiceProcess:
    children.append(start_service(module, ["--host", config.host, *to_argv(config, skip=_CHILD_SKIP)]))
    return children[-1].wait_ready()


def generate(args: argparse.Namespace) -> int:
    if args.raw:
        prompt: str | list[dict[str, str]] = args.prompt
    else:
        prompt = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.prompt}
        ]
    options = dict(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        repetition_penalty=args.repetition_penalty, min_p=args.min_p, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, logit_bias=dict(args.logit_bias), seed=args.seed, stop=args.stop,
        speculative=False if args.no_speculative else None, num_speculative_tokens=args.num_speculative_tokens,
        method=args.method, verification=args.verification, logprobs=args.logprobs,
        processed_logprobs=args.processed_logprobs,
    )
    def echo(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    try:
        with SpecdecClient(
            args.gateway, timeout=args.timeout, tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key,
            token=read_token(args.token_file),
        ) as client:
            result = collect(client.stream(prompt, **options), on_text=None if args.json else echo)
    except grpc.RpcError as error:
        print(f"\nerror: {error.code().name}: {error.details()}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result.as_dict(), ensure_ascii=False))
    else:
        print(
            f"\n\n[{result.completion_tokens} tokens, finish: {result.finish_reason}, "
            f"acceptance rate {result.acceptance_rate:.2f}, "
            f"mean acceptance length {result.mean_acceptance_length:.2f}, "
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description="Speculative-decoding LLM server")
    parser.add_argument("--log-level", default="WARNING", choices=LOG_LEVELS)
    commands = parser.add_subparsers(dest="command", required=True)
    _serve_flags(commands.add_parser("serve", help="start draft, target and gateway; stop all on Ctrl-C / SIGTERM"))
    _generate_flags(commands.add_parser("generate", help="stream a generation from a running gateway"))
    add_health_flags(commands.add_parser("health", help="check a service with grpc.health.v1; exit 0 when SERVING"))
    add_bench_flags(commands.add_parser(
        "bench", help="measure speed: starts the trio, writes results JSON, plots and docs/benchmarks.md",
        description="Speed harness: W1 single requests (plain vs speculative), transformers' plain and assisted "
        "generate, fixed-K and concurrency sweeps, the services' measured costs. The last line printed is "
        "'speedup=… vs_hf_assisted=… efficiency=… alpha=… c=…'.",
    ))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    if args.command == "serve":
        return serve(args)
    if args.command == "bench":
        return bench(args, sys.argv[1:] if argv is None else argv)
    if args.command == "health":
        return health(args)
    return generate(args)


if __name__ == "__main__":
    sys.exit(main())
