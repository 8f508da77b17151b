"""`specdec health HOST:PORT`: the grpc.health.v1 check Docker and compose health checks run.

Kept free of torch and transformers (it imports only grpc), so a check every few seconds
costs a fraction of a second, not the seconds the full command line takes to import.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.serving.security import channel_credentials


def add_health_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("address", help="HOST:PORT of any specdec service")
    parser.add_argument("--service", default="", help="service name to check (default: the whole server)")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the answer (default: 5)")
    parser.add_argument("--tls-ca", default="", help="PEM CA of the server's certificate: check over TLS")
    parser.add_argument(
        "--tls-cert", default="", help="PEM client certificate, for a server that demands one (mutual TLS)",
    )
    parser.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")


def health(args: argparse.Namespace) -> int:
    """Exit 0 when the server reports SERVING (Docker and Kubernetes health checks run this)."""
    credentials = channel_credentials(args.tls_ca, args.tls_cert, args.tls_key)
    channel = grpc.secure_channel(args.address, credentials) if credentials else grpc.insecure_channel(args.address)
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout
            )
        except grpc.RpcError as error:
            print(f"{args.address}: {error.code().name}: {error.details()}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{args.address}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="specdec health", description="check a service with grpc.health.v1; exit 0 when SERVING",
    )
    add_health_flags(parser)
    return health(parser.parse_args(argv))
