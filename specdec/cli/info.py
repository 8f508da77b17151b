"""`specdec info`: what a running gateway reports of itself (`Gateway.Info`): its models, its
speculation settings, and the planner's state per draft source, so that "speculation is off:
since when, why" is one command away.

A client only, like `specdec generate`: it imports grpc and the generated stubs, never torch or
transformers. `--json` prints the whole GatewayInfo as one JSON object: every field, enums by
their lower-case names without the prefix (the metrics' label values: `"off"`,
`"prompt_lookup"`, `"catch_up"`), UNSPECIFIED, unknown figures (NaN) and unset messages as null.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Mapping, Sequence
from typing import Protocol

import grpc
from google.protobuf.message import Message

from specdec.cli.generate import DEFAULT_GATEWAY
from specdec.client import SpecdecClient
from specdec.serving.logs import configure_logging
from specdec.serving.security import read_token
from specdec.v1 import common_pb2, gateway_pb2


class _EnumValue(Protocol):
    @property
    def name(self) -> str: ...


class EnumType(Protocol):
    """A protobuf enum's descriptor (`field.enum_type`, `gateway_pb2.DraftSource.DESCRIPTOR`)."""

    @property
    def values_by_number(self) -> Mapping[int, _EnumValue]: ...


#: The planner table's columns.
SOURCE_COLUMNS = ("source", "state", "off (s)", "last switch", "acceptance", "next probe")


def add_info_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gateway", default=DEFAULT_GATEWAY, help=f"gateway address (default: {DEFAULT_GATEWAY})")
    parser.add_argument("--json", action="store_true", help="print the whole Info as one JSON object")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the answer (default: 10)")
    parser.add_argument("--tls-ca", default="", help="PEM CA of the gateway's certificate: connect over TLS")
    parser.add_argument("--tls-cert", default="", help="PEM client certificate, for a gateway that demands one")
    parser.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")
    parser.add_argument(
        "--token-file", default="", help="file holding the gateway's bearer token (default: $SPECDEC_AUTH_TOKEN)",
    )


def info(args: argparse.Namespace) -> int:
    """Print the gateway's Info (readable, or JSON with --json); 1 on an RPC error."""
    try:
        with SpecdecClient(
            args.gateway, timeout=args.timeout, tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key,
            token=read_token(args.token_file),
        ) as client:
            reply = client.info()
    except grpc.RpcError as error:
        print(f"error: {error.code().name}: {error.details()}", file=sys.stderr)
        return 1
    print(json.dumps(message_to_dict(reply), allow_nan=False) if args.json else format_info(reply, args.gateway))
    return 0


# -- JSON ---------------------------------------------------------------------------------


def message_to_dict(message: Message) -> dict[str, object]:
    """Every field of `message`, set or not (see the module docstring for the forms)."""
    out: dict[str, object] = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):  # a repeated field
            out[field.name] = [_plain(item, field.enum_type) for item in value]
        elif field.message_type is not None and not message.HasField(field.name):
            out[field.name] = None
        else:
            out[field.name] = _plain(value, field.enum_type)
    return out


def enum_label(enum: EnumType, number: int) -> str | None:
    """`DRAFT_SOURCE_STATE_OFF` -> "off": the name without the prefix its UNSPECIFIED value has."""
    if number == 0:
        return None
    prefix = enum.values_by_number[0].name.removesuffix("UNSPECIFIED")
    return enum.values_by_number[number].name.removeprefix(prefix).lower()


def _plain(value: object, enum: EnumType | None) -> object:
    if isinstance(value, Message):
        return message_to_dict(value)
    if enum is not None and isinstance(value, int):
        return enum_label(enum, value)
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


# -- text ---------------------------------------------------------------------------------


def format_info(reply: gateway_pb2.GatewayInfo, address: str) -> str:
    """The Info for people: models, speculation settings, and the planner's sources as a table."""
    draft = (_model_line("draft", reply.draft, reply.draft_available) if reply.HasField("draft")
             else "draft        none: the gateway drafts with lookups alone")
    return "\n".join([
        f"gateway      {address}",
        _model_line("target", reply.target, reply.target_available),
        draft,
        _speculation_line(reply),
        *planner_lines(reply.planner),
    ])


def planner_lines(planner: gateway_pb2.PlannerInfo) -> list[str]:
    """The planner's estimates in one line, then a row per draft source it reports."""
    off = f"speculation off for {planner.off_seconds:.1f} s of decoding" if planner.off_seconds > 0 else "drafting"
    summary = (f"planner      {off}; expected speedup {_number(planner.expected_speedup)}x, "
               f"draft cost ratio {_number(planner.draft_cost_ratio)}")
    if not planner.sources:
        return [summary, "             no draft source reported yet (none before the first round)"]
    return [summary, *_table([SOURCE_COLUMNS, *map(_source_row, planner.sources)])]


def _model_line(role: str, model: common_pb2.ModelInfo, available: bool) -> str:
    how = ", ".join(part for part in (model.dtype, model.device, model.quantization) if part)
    return f"{role:<13}{model.model_name} ({how}), {'available' if available else 'UNAVAILABLE'}"


def _speculation_line(reply: gateway_pb2.GatewayInfo) -> str:
    if not reply.speculative_enabled:
        return "speculation  off: plain decoding"
    method = enum_label(gateway_pb2.SpeculationMethod.DESCRIPTOR, reply.default_speculation_method)
    k = "adaptive K" if reply.adaptive_k else "fixed K"
    return (f"speculation  method {method}, K {reply.default_num_speculative_tokens} "
            f"(at most {reply.max_speculative_tokens}), {k}")


def _source_row(source: gateway_pb2.DraftSourceStatus) -> list[str]:
    probing_in = source.state == gateway_pb2.DRAFT_SOURCE_STATE_OFF and source.next_probe_rounds > 0
    return [
        enum_label(gateway_pb2.DraftSource.DESCRIPTOR, source.source) or "?",
        enum_label(gateway_pb2.DraftSourceState.DESCRIPTOR, source.state) or "?",
        f"{source.off_seconds:.1f}",
        enum_label(gateway_pb2.SwitchReason.DESCRIPTOR, source.reason) or "-",
        _number(source.acceptance),
        f"{source.next_probe_rounds} rounds" if probing_in else "-",
    ]


def _number(value: float) -> str:
    return f"{value:.2f}" if math.isfinite(value) else "-"


def _table(rows: list[Sequence[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]


def main(argv: Sequence[str]) -> int:
    """`specdec info ...` without the rest of the command line (`argv` after `info`)."""
    parser = argparse.ArgumentParser(prog="specdec info", description="print what a running gateway reports")
    add_info_flags(parser)
    args = parser.parse_args(argv)
    configure_logging("WARNING")
    return info(args)
