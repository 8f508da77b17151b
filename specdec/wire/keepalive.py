"""HTTP/2 keepalive and reconnection between the gateway and the model services.

A service that vanishes without closing its connections (a failed node, a partition) leaves
TCP "established" for minutes, and every call on it waits out its deadline. With keepalive the
gateway pings each connection every `interval_s` seconds and closes it when no answer comes
within `timeout_s`: calls in flight fail UNAVAILABLE at once, and the next call reconnects.

A gRPC server closes the connection of a client that pings more often than its policy allows
(GOAWAY "too_many_pings"), so the services state the interval they accept and the gateway must
not ping more often.

A channel whose service went away tries to reconnect with a growing backoff: gRPC's default
grows it 1.6x a try up to 120 s, so a target that was down for a minute came back to a gateway
that did not try it again for many seconds more, while its requests waited. The gateway's
channels retry at most `RECONNECT_MAX_S` apart; a refused connection costs next to nothing.

A plain module with no gRPC import, like `specdec.wire.limits`.
"""

from __future__ import annotations

#: The longest a gateway's channel waits between tries to reach a service that went away.
RECONNECT_MAX_S = 1.0


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def client_reconnect_options(max_backoff_s: float = RECONNECT_MAX_S) -> list[tuple[str, int]]:
    """Channel options that try a lost service again after 0.1 s, then at most `max_backoff_s` apart."""
    first = min(0.1, max_backoff_s)
    return [
        ("grpc.initial_reconnect_backoff_ms", _ms(first)),
        ("grpc.min_reconnect_backoff_ms", _ms(first)),
        ("grpc.max_reconnect_backoff_ms", _ms(max_backoff_s)),
    ]


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
