"""`specdec generate PROMPT`: stream one generation from a running gateway.

A client only: it imports grpc and the Python client, never torch or transformers, so it
starts in a fraction of a second. `specdec generate` is dispatched here before the full
command line (`specdec.cli.main`) is imported; that parser lists the same flags.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import grpc

from specdec.client import SpecdecClient, collect
from specdec.gateway.draft_sources import SpeculationMethod
from specdec.serving.logs import configure_logging
from specdec.serving.security import read_token

DEFAULT_GATEWAY = "127.0.0.1:50050"


def add_generate_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of `specdec generate`: the prompt, the gateway, and the request's options."""
    parser.add_argument("prompt", help="the user message (or raw text with --raw)")
    parser.add_argument("--gateway", default=DEFAULT_GATEWAY, help=f"gateway address (default: {DEFAULT_GATEWAY})")
    parser.add_argument("--raw", action="store_true", help="send the prompt as raw text, not as a chat message")
    parser.add_argument("--system", default=None, help="system message for the chat")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=None, help="nucleus mass in (0, 1] (default: 1, off)")
    parser.add_argument("--repetition-penalty", type=float, default=None, help="> 0 (default: 1, off)")
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
    output = parser.add_mutually_exclusive_group()
    output.add_argument("--json-schema", type=_text_or_file, default=None, metavar="SCHEMA",
                        help="the answer matches this JSON Schema (JSON text, or @FILE)")
    output.add_argument("--json-object", action="store_true", help="the answer is a JSON object")
    output.add_argument("--regex", default=None, help="the answer matches this regular expression")
    output.add_argument("--choice", action="append", default=None, help="the answer is one of these (repeatable)")
    output.add_argument("--grammar", type=_text_or_file, default=None, metavar="GRAMMAR",
                        help="the answer follows this Lark or GBNF grammar (text, or @FILE)")
    parser.add_argument("--json", action="store_true", help="print one JSON object at the end instead of streaming")
    parser.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    parser.add_argument("--tls-ca", default="", help="PEM CA of the gateway's certificate: connect over TLS")
    parser.add_argument("--tls-cert", default="", help="PEM client certificate, for a gateway that demands one")
    parser.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")
    parser.add_argument(
        "--token-file", default="", help="file holding the gateway's bearer token (default: $SPECDEC_AUTH_TOKEN)",
    )


def _text_or_file(text: str) -> str:
    """A `--json-schema` / `--grammar` value: the text itself, or the contents of @FILE."""
    if not text.startswith("@"):
        return text
    try:
        return Path(text[1:]).read_text()
    except OSError as error:
        raise argparse.ArgumentTypeError(f"cannot read {text[1:]!r}: {error.strerror}") from None


def _logit_bias(text: str) -> tuple[int, float]:
    """A `--logit-bias` value, TOKEN_ID=BIAS."""
    token, sep, bias = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected TOKEN_ID=BIAS, e.g. 42=-100, got {text!r}") from None


def generate(args: argparse.Namespace) -> int:
    """Stream the reply to stdout (or print one JSON object with --json); 1 on an RPC error."""
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
        processed_logprobs=args.processed_logprobs, json_schema=args.json_schema, json_object=args.json_object,
        regex=args.regex, choice=args.choice, grammar=args.grammar,
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


def main(argv: Sequence[str]) -> int:
    """`specdec generate ...` without the rest of the command line (`argv` after `generate`)."""
    parser = argparse.ArgumentParser(prog="specdec generate", description="stream a generation from a running gateway")
    add_generate_flags(parser)
    args = parser.parse_args(argv)
    configure_logging("WARNING")
    return generate(args)
