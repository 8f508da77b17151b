"""gRPC message-size limits every peer of the model services shares.

A plain module with no gRPC import, so configs can read the default without loading a server.
"""

from __future__ import annotations

#: Large enough for a verify reply of 32 requests x 9 positions x 128,256 fp32 logits (~148 MB).
DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024
#: What the gateway accepts from a client: a prompt of a million characters fits, a runaway does not.
DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024


def message_size_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """Channel / server options lifting gRPC's 4 MB default in both directions.

    Every peer of the model services needs them: a verify reply of a few requests is
    already several MB of logits.
    """
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]
