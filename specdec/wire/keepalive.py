"""HTTP/2 keepalive between the gateway and the model services.

A service that vanishes without closing its connections (a failed node, a partition) leaves
TCP "established" for minutes, and every call on it waits out its deadline. With keepalive the
gateway pings each connection every `interval_s` seconds and closes it when no answer comes
within `timeout_s`: calls in flight fail UNAVAILABLE at once, and the next call reconnects.

A gRPC server closes the connection of a client that pings more often than its policy allows
(GOAWAY "too_many_pings"), so the services state the interval they accept and the gateway must
not ping more often.

A plain module with no gRPC import, like `specdec.wire.limits`.
"""

from __future__ import annotations


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def client_keepalive_options(interval_s: float, timeout_s: float) -> list[tuple[str, int]]:
    """Channel options that ping every `interval_s` seconds, with calls in flight or not,
    and give up on a connection whose ping is unanswered after `timeout_s`; none for 0."""
    if interval_s <= 0:
        return []
    return [
        ("grpc.keepalive_time_ms", _ms(interval_s)),
        ("grpc.keepalive_timeout_ms", _ms(timeout_s)),
        # Every ping's timeout, not only keepalive's: a ping already unanswered when the
        # peer went silent (gRPC's own bandwidth probes send them too) held the keepalive
        # ping back, and a call waited out its whole deadline (grpcio 1.85, 60 s default).
        ("grpc.http2.ping_timeout_ms", _ms(timeout_s)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),  # keep pinging a connection that is idle
    ]


def server_keepalive_options(min_interval_s: float) -> list[tuple[str, int]]:
    """Server options that accept a client's pings as often as every `min_interval_s`
    seconds, on connections without calls too."""
    return [
        ("grpc.http2.min_ping_interval_without_data_ms", _ms(min_interval_s)),
        ("grpc.keepalive_permit_without_calls", 1),
    ]
