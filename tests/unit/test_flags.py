"""Command lines built from the config dataclasses: every field is a flag, defaults agree,
and a config survives the trip through a child process's flags."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from specdec.cli.main import build_parser, serve_configs
from specdec.draft_server.config import DraftConfig
from specdec.errors import InvalidArgumentError
from specdec.flags import add_flags, option, parse_config, to_argv
from specdec.gateway.config import GatewayConfig
from specdec.model.loader import DEFAULT_MODEL
from specdec.target_server.config import TargetConfig


def serve_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


@pytest.mark.parametrize("config", [
    TargetConfig(),
    DraftConfig(model="x.gguf", quantization="int8", measure_costs=False, threads=2, cpu_cores="0", num_layers=2),
    GatewayConfig(target_address="a:1", draft_address="b:2", adaptive_k=False, max_queue=3, num_speculative_tokens=6,
                  max_new_tokens_default=9, draft_probs_dtype="bfloat16", metrics_port=0),
    GatewayConfig(target_address="a:1", speculative=False),
])
def test_a_config_survives_its_own_flags(config: object) -> None:
    assert parse_config(type(config), to_argv(config)) == config


def test_serve_defaults_are_the_services_own_defaults() -> None:
    target, draft, gateway = serve_configs(serve_args())
    assert target == TargetConfig(port=0)
    assert draft == DraftConfig(port=0, model=DEFAULT_MODEL)
    assert gateway == GatewayConfig(target_address="-", draft_address="-")


def test_serve_reaches_every_field_of_every_config() -> None:
    target, draft, gateway = serve_configs(serve_args(
        "--host", "0.0.0.0", "--max-queue", "7", "--no-adaptive-k", "--num-speculative-tokens", "3",
        "--target-model", "t.gguf", "--target-kv-token-budget", "512", "--no-target-measure-costs",
        "--draft-quantization", "int8", "--draft-threads", "1", "--draft-num-layers", "2",
    ))
    assert (target.host, target.model, target.kv_token_budget, target.measure_costs) == ("0.0.0.0", "t.gguf", 512, False)
    assert draft is not None and (draft.model, draft.quantization, draft.threads, draft.num_layers) == ("t.gguf", "int8", 1, 2)
    assert (gateway.host, gateway.max_queue, gateway.adaptive_k, gateway.num_speculative_tokens) == ("0.0.0.0", 7, False, 3)
    flags = {o for a in build_parser()._subparsers._group_actions[0].choices["serve"]._actions for o in a.option_strings}  # type: ignore[union-attr]
    for prefix, cls in (("--target-", TargetConfig), ("--draft-", DraftConfig)):
        assert {f"{prefix}{f.name.replace('_', '-')}" for f in dataclasses.fields(cls) if f.name not in ("host", "port")} <= flags
    gateway_fields = {f.metadata["flag"] or f.name.replace("_", "-") for f in dataclasses.fields(GatewayConfig)}
    assert {f"--{name}" for name in gateway_fields - {"target-address", "draft-address"}} <= flags


def test_serve_without_speculation_starts_no_draft() -> None:
    _, draft, gateway = serve_configs(serve_args("--no-speculative"))
    assert draft is None and not gateway.speculative and gateway.draft_address == ""


def test_a_field_without_help_is_refused() -> None:
    @dataclasses.dataclass(frozen=True)
    class Bare:
        documented: int = option(1, "has help")
        undocumented: int = 2

    with pytest.raises(TypeError, match="undocumented has no help"):
        add_flags(argparse.ArgumentParser(), Bare)


def test_the_gateway_pings_no_more_often_than_the_services_accept_by_default() -> None:
    # A service closes the connection of a client that pings more often than it allows.
    gateway = GatewayConfig(target_address="a:1", draft_address="b:2")
    assert gateway.keepalive_s >= TargetConfig().min_ping_interval_s
    assert gateway.keepalive_s >= DraftConfig().min_ping_interval_s
    assert gateway.keepalive_timeout_s < gateway.keepalive_s


@pytest.mark.parametrize("fields", [dict(keepalive_s=-1.0), dict(keepalive_s=float("nan")), dict(keepalive_timeout_s=0.0)])
def test_keepalive_settings_that_are_not_durations_are_refused(fields: dict[str, float]) -> None:
    with pytest.raises(InvalidArgumentError, match="keepalive"):
        GatewayConfig(target_address="a:1", draft_address="b:2", **fields)  # type: ignore[arg-type]
