"""The fields of a body that say how to generate: the sampling transforms, the stop strings and
the `speculation` extension (docs/openai.md#request-fields)."""

from __future__ import annotations

from typing import Any

from specdec.gateway.intake import METHOD_FROM_PB, VERIFICATION_FROM_PB
from specdec.gateway.openai.errors import invalid_field
from specdec.gateway.openai.fields import INT32_MAX, boolean, integer, number
from specdec.v1 import common_pb2, gateway_pb2

UINT64_MAX = 2**64 - 1
#: OpenAI's default temperature (the gRPC API's unset temperature is greedy instead).
DEFAULT_TEMPERATURE = 1.0
#: The extension's names ("auto", "drawn", ...) for the gRPC API's values, as `intake` reads them.
SPECULATION_METHODS = {method.value: pb for pb, method in METHOD_FROM_PB.items() if method is not None}
VERIFICATIONS = {verification.value: pb for pb, verification in VERIFICATION_FROM_PB.items()
                 if verification is not None}
SPECULATION_FIELDS = ("enabled", "num_speculative_tokens", "adaptive", "method", "verification")


def sampling_from_body(body: dict[str, Any]) -> common_pb2.SamplingParams:
    """The sampling transforms, their ranges checked by `SamplingParams` (top_p's and
    repetition_penalty's here as well)."""
    sampling = common_pb2.SamplingParams(temperature=DEFAULT_TEMPERATURE)
    if (temperature := number(body, "temperature")) is not None:
        sampling.temperature = temperature
    if (top_p := number(body, "top_p")) is not None:
        if not 0 < top_p <= 1:
            raise invalid_field("top_p", f"must be in (0, 1], got {top_p}")
        sampling.top_p = top_p
    if (top_k := integer(body, "top_k", low=-1)) is not None:
        sampling.top_k = max(min(top_k, INT32_MAX), 0)  # -1 or 0: off (vLLM's and the gRPC API's "off")
    if (penalty := number(body, "repetition_penalty")) is not None:
        if not penalty > 0:
            raise invalid_field("repetition_penalty", f"must be > 0, got {penalty}")
        sampling.repetition_penalty = penalty
    if (seed := integer(body, "seed", low=0, high=UINT64_MAX)) is not None:
        sampling.seed = seed
    for name in ("min_p", "presence_penalty", "frequency_penalty"):
        if (value := number(body, name)) is not None:
            setattr(sampling, name, value)
    sampling.logit_bias.update(logit_bias_from_body(body.get("logit_bias")))
    return sampling


def logit_bias_from_body(bias: object) -> dict[int, float]:
    """OpenAI's `logit_bias`: token ids (JSON object keys, so strings) to a bias; the ranges and
    the vocabulary are checked with the other sampling fields (`SamplingParams`, `intake`)."""
    if bias is None:
        return {}
    if not isinstance(bias, dict):
        raise invalid_field("logit_bias", "must be an object mapping token ids to biases")
    out = {}
    for key in bias:
        if not (isinstance(key, str) and key.isdigit() and int(key) <= INT32_MAX):
            raise invalid_field("logit_bias", f"keys must be token ids, got {key!r}")
        if (value := number(bias, key, "logit_bias.")) is not None:
            out[int(key)] = value
    return out


def stop_from_body(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return stop
    raise invalid_field("stop", "must be a string or a list of strings")


def speculation_from_body(options: object) -> gateway_pb2.SpeculationOptions:
    """The `speculation` extension object (docs/openai.md); absent: the gateway's defaults."""
    speculation = gateway_pb2.SpeculationOptions()
    if options is None:
        return speculation
    if not isinstance(options, dict):
        raise invalid_field("speculation", "must be an object")
    for name in options:
        if name not in SPECULATION_FIELDS:
            raise invalid_field(f"speculation.{name}", f"unknown field; known: {', '.join(SPECULATION_FIELDS)}")
    if (enabled := boolean(options, "enabled", "speculation.")) is not None:
        speculation.enabled = enabled
    k = integer(options, "num_speculative_tokens", "speculation.", low=0, high=INT32_MAX)
    if k is not None:
        speculation.num_speculative_tokens = k
    if (adaptive := boolean(options, "adaptive", "speculation.")) is not None:
        speculation.adaptive = adaptive
    for name, choices in (("method", SPECULATION_METHODS), ("verification", VERIFICATIONS)):
        value = options.get(name)
        if value is None:
            continue
        if value not in choices:
            raise invalid_field(f"speculation.{name}", f"must be one of {', '.join(choices)}, got {value!r}")
        setattr(speculation, name, choices[value])
    return speculation
