"""The `specdec` command: `specdec serve` runs the trio, `specdec generate` streams from it,
`specdec info` shows what its gateway reports (the planner's state included). Installed packages
add subcommands through the `specdec.commands` entry points: the benchmark harness
(benchmarks/specdec_bench) adds `specdec bench`, which measures its speed."""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points

from specdec.cli.generate import add_generate_flags, generate
from specdec.cli.health import add_health_flags, health
from specdec.cli.info import add_info_flags, info
from specdec.cli.launcher import ServiceProcess, start_service
from specdec.draft_server.config import DraftConfig
from specdec.errors import SpecdecError
from specdec.flags import add_flags, from_args, to_argv
from specdec.gateway.config import GatewayConfig
from specdec.serving.config import ModelServiceConfig
from specdec.serving.logs import LOG_LEVELS, configure_logging
from specdec.target_server.config import TargetConfig

#: `specdec serve` is the one-command way to try the server, so it answers OpenAI clients at
#: once, on the port vLLM and SGLang use; `--http-port -1` turns it off.
SERVE_HTTP_PORT = 8000
#: `--draft-model none`: serve target and gateway alone, drafting with lookups.
NO_DRAFT = "none"
#: Each model service binds the gateway's host on a free port; the gateway finds them itself.
_CHILD_SKIP = ("host", "port")
#: Entry points that add subcommands: each names a `register(commands)` that adds its parser
#: and sets the parser's `run` default, a `run(args, argv) -> exit status`.
COMMAND_GROUP = "specdec.commands"
#: What `specdec bench` needs where no installed package registers it.
BENCH_MISSING = (
    "specdec bench is the benchmark harness's command (benchmarks/specdec_bench), registered when the "
    "package is installed from a checkout: pip install -e '.[bench]' (make setup)"
)
Command = Callable[[argparse.Namespace, Sequence[str]], int]


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
    # The gateway (and with it torch) loads here, not with this module: `specdec serve --help`
    # and the other commands' parsers stay light.
    from specdec.gateway.entrypoint import start_gateway

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


def _bench_missing(args: argparse.Namespace, argv: Sequence[str]) -> int:
    print(f"error: {BENCH_MISSING}", file=sys.stderr)
    return 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description="Speculative-decoding LLM server")
    parser.add_argument("--log-level", default="WARNING", choices=LOG_LEVELS)
    commands = parser.add_subparsers(dest="command", required=True)
    _serve_flags(commands.add_parser("serve", help="start draft, target and gateway; stop all on Ctrl-C / SIGTERM"))
    add_generate_flags(commands.add_parser("generate", help="stream a generation from a running gateway"))
    add_info_flags(commands.add_parser(
        "info", help="print what a running gateway reports: models, K, and the planner's draft sources",
    ))
    add_health_flags(commands.add_parser("health", help="check a service with grpc.health.v1; exit 0 when SERVING"))
    for entry in entry_points(group=COMMAND_GROUP):
        entry.load()(commands)
    if "bench" not in commands.choices:  # says how to get it, whatever flags follow (`main`)
        commands.add_parser("bench", help="(not installed)", add_help=False).set_defaults(run=_bench_missing)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and getattr(args, "run", None) is not _bench_missing:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")  # as parse_args does
    configure_logging(args.log_level)
    if args.command == "serve":
        return serve(args)
    run: Command | None = getattr(args, "run", None)
    if run is not None:
        return run(args, sys.argv[1:] if argv is None else argv)
    if args.command == "health":
        return health(args)
    if args.command == "info":
        return info(args)
    return generate(args)


if __name__ == "__main__":
    sys.exit(main())
