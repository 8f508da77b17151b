"""Command lines built from the config dataclasses: every field is a flag, defaults agree,
and a config survives the trip through a child process's flags."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from specdec.cli.main import SERVE_HTTP_PORT, build_parser, serve_configs
from specdec.draft_server.config import DraftConfig
from specdec.errors import InvalidArgumentError
from specdec.flags import add_flags, inherit, is_advanced, option, parse_config, to_argv
from specdec.gateway.config import DEFAULT_FIXED_K, GatewayConfig
from specdec.model.choices import DEFAULT_MODEL
from specdec.serving.config import ModelServiceConfig
from specdec.target_server.config import TargetConfig

#: What `specdec serve --help` may list before its advanced groups (the issue asks for ~25).
MAX_EVERYDAY_SERVE_FLAGS = 25


def serve_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def serve_parser() -> argparse.ArgumentParser:
    return build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr,no-any-return]


def flags_by_group(parser: argparse.ArgumentParser) -> dict[str, list[str]]:
    """Each `--help` group's title and its flags' first spellings, in the order `--help` lists them."""
    return {
        str(group.title): [action.option_strings[0] for action in group._group_actions if action.dest != "help"]
        for group in parser._action_groups
    }


@pytest.mark.parametrize("config", [
    TargetConfig(),
    DraftConfig(model="x.gguf", quantization="int8", measure_costs=False, threads=2, cpu_cores="0", num_layers=2),
    GatewayConfig(target_address="a:1", draft_address="b:2", adaptive_k=False, max_queue=3, num_speculative_tokens=6,
                  default_max_new_tokens=9, draft_probs_dtype="bfloat16", metrics_port=0),
    GatewayConfig(target_address="a:1", speculative=False),
])
def test_a_config_survives_its_own_flags(config: object) -> None:
    assert parse_config(type(config), to_argv(config)) == config


def test_serve_defaults_are_the_services_own_defaults() -> None:
    target, draft, gateway = serve_configs(serve_args())
    assert target == TargetConfig(port=0)
    assert draft == DraftConfig(port=0, model=DEFAULT_MODEL)
    # ... but for the HTTP front, which `specdec serve` turns on (docs/openai.md).
    assert gateway == GatewayConfig(target_address="-", draft_address="-", http_port=SERVE_HTTP_PORT)


def test_serve_reaches_every_field_of_every_config() -> None:
    target, draft, gateway = serve_configs(serve_args(
        "--host", "0.0.0.0", "--max-queue", "7", "--no-adaptive-k", "--num-speculative-tokens", "3",
        "--target-model", "t.gguf", "--target-kv-token-budget", "512", "--no-target-measure-costs",
        "--draft-quantization", "int8", "--draft-threads", "1", "--draft-num-layers", "2",
    ))
    assert (target.host, target.model, target.kv_token_budget) == ("0.0.0.0", "t.gguf", 512)
    assert not target.measure_costs
    assert draft is not None
    assert (draft.model, draft.quantization, draft.threads, draft.num_layers) == ("t.gguf", "int8", 1, 2)
    assert (gateway.host, gateway.max_queue, gateway.num_speculative_tokens) == ("0.0.0.0", 7, 3)
    assert not gateway.adaptive_k
    flags = {o for a in serve_parser()._actions for o in a.option_strings}
    for prefix, cls in (("--target-", TargetConfig), ("--draft-", DraftConfig)):
        names = {f.name.replace("_", "-") for f in dataclasses.fields(cls)} - {"host", "port"}
        assert {f"{prefix}{name}" for name in names} <= flags
    gateway_fields = {f.metadata["flag"] or f.name.replace("_", "-") for f in dataclasses.fields(GatewayConfig)}
    assert {f"--{name}" for name in gateway_fields - {"target-address", "draft-address"}} <= flags


def test_serve_without_speculation_starts_no_draft() -> None:
    _, draft, gateway = serve_configs(serve_args("--no-speculative"))
    assert draft is None and not gateway.speculative and gateway.draft_address == ""


def test_serve_with_draft_model_none_starts_no_draft_and_speculates_with_lookups() -> None:
    _, draft, gateway = serve_configs(serve_args("--draft-model", "none"))
    assert draft is None and gateway.speculative and gateway.draft_address == ""
    assert gateway.speculation_method == "auto"
    with pytest.raises(InvalidArgumentError, match="speculation_method model needs a draft"):
        serve_configs(serve_args("--draft-model", "none", "--speculation-method", "model"))


def test_a_field_without_help_is_refused() -> None:
    @dataclasses.dataclass(frozen=True)
    class Bare:
        documented: int = option(1, "has help")
        undocumented: int = 2

    with pytest.raises(TypeError, match="undocumented has no help"):
        add_flags(argparse.ArgumentParser(), Bare)


def test_lookup_settings_come_from_the_gateway_flags_and_are_checked() -> None:
    gateway = GatewayConfig(target_address="a:1", lookup_edits=3, ngram_max=5)
    assert (gateway.lookup_settings().max_edits, gateway.lookup_settings().max_n) == (3, 5)
    with pytest.raises(InvalidArgumentError, match="lookup_edits must be >= 0"):
        GatewayConfig(target_address="a:1", lookup_edits=-1)


def test_the_gateway_pings_no_more_often_than_the_services_accept_by_default() -> None:
    # A service closes the connection of a client that pings more often than it allows.
    gateway = GatewayConfig(target_address="a:1", draft_address="b:2")
    assert gateway.keepalive_s >= TargetConfig().min_ping_interval_s
    assert gateway.keepalive_s >= DraftConfig().min_ping_interval_s
    assert gateway.keepalive_timeout_s < gateway.keepalive_s


@pytest.mark.parametrize(
    "fields", [dict(keepalive_s=-1.0), dict(keepalive_s=float("nan")), dict(keepalive_timeout_s=0.0)],
)
def test_keepalive_settings_that_are_not_durations_are_refused(fields: dict[str, float]) -> None:
    with pytest.raises(InvalidArgumentError, match="keepalive"):
        GatewayConfig(target_address="a:1", draft_address="b:2", **fields)  # type: ignore[arg-type]


def test_serve_help_lists_the_everyday_flags_first_and_the_rest_as_advanced() -> None:
    groups = flags_by_group(serve_parser())
    titles = list(groups)
    advanced = [title for title in titles if title.startswith("advanced")]
    everyday = [flag for title in titles if title not in advanced for flag in groups[title]]
    assert len(advanced) == 3 and titles.index(advanced[0]) > max(titles.index(t) for t in titles if t not in advanced)
    assert len(everyday) <= MAX_EVERYDAY_SERVE_FLAGS, everyday
    assert {
        "--log-level", "--port", "--speculative", "--num-speculative-tokens", "--adaptive-k", "--max-batch-size",
        "--target-model", "--target-dtype", "--draft-model", "--draft-quantization", "--target-kv-token-budget",
        "--tls-cert", "--auth-token-file",
    } <= set(everyday)
    # The model services' own everyday TLS and metrics flags are advanced here: the gateway's serve for all three.
    assert {"--target-tls-cert", "--draft-metrics-port", "--decode-steps", "--draft-compile"} <= {
        flag for title in advanced for flag in groups[title]
    }


@pytest.mark.parametrize("cls", [TargetConfig, DraftConfig, GatewayConfig])
def test_a_services_own_help_lists_its_advanced_flags_last(cls: type) -> None:
    parser = argparse.ArgumentParser()
    add_flags(parser, cls)
    groups = flags_by_group(parser)
    assert list(groups)[-1] == "advanced options"
    fields = {f"--{f.metadata['flag'] or f.name.replace('_', '-')}": f for f in dataclasses.fields(cls)}
    assert all(is_advanced(fields[flag]) for flag in groups["advanced options"])
    assert not any(is_advanced(fields[flag]) for title, flags in groups.items() if title != "advanced options"
                   for flag in flags)
    if issubclass(cls, ModelServiceConfig):  # what the service is about first, its TLS mixin's flags after
        assert groups["options"][:2] == ["--model", "--dtype"]


def test_advanced_flags_go_to_the_group_given_and_demote_moves_more() -> None:
    @dataclasses.dataclass(frozen=True)
    class Service:
        port: int = option(1, "everyday")
        knob: int = option(2, "tuning", advanced=True)
        limit: int = option(3, "everyday elsewhere")

    parser = argparse.ArgumentParser()
    mine, tuning = parser.add_argument_group("mine"), parser.add_argument_group("mine, advanced")
    add_flags(mine, Service, advanced=tuning, prefix="x-", demote=("limit",))
    groups = flags_by_group(parser)
    assert groups["mine"] == ["--x-port"] and groups["mine, advanced"] == ["--x-knob", "--x-limit"]
    plain = argparse.ArgumentParser()
    add_flags(plain.add_argument_group("one group"), Service)
    assert flags_by_group(plain)["one group"] == ["--port", "--knob", "--limit"]  # no advanced group: all in it


def test_inherit_keeps_help_and_can_move_a_field_to_advanced() -> None:
    @dataclasses.dataclass(frozen=True)
    class Base:
        workers: int = option(1, "worker threads")

    @dataclasses.dataclass(frozen=True)
    class Tuned(Base):
        workers: int = inherit(Base, "workers", advanced=True)

    @dataclasses.dataclass(frozen=True)
    class Bigger(Base):
        workers: int = inherit(Base, "workers", 4)

    (tuned,), (bigger,) = dataclasses.fields(Tuned), dataclasses.fields(Bigger)
    assert is_advanced(tuned) and tuned.default == 1 and tuned.metadata["help"] == "worker threads"
    assert not is_advanced(bigger) and bigger.default == 4
    assert not is_advanced(dataclasses.fields(Base)[0])


def test_serve_takes_the_log_level_after_the_command_too() -> None:
    assert serve_args("--log-level", "INFO").log_level == "INFO"
    assert build_parser().parse_args(["--log-level", "DEBUG", "serve"]).log_level == "DEBUG"
    assert serve_args().log_level == "WARNING"


def test_the_default_k_is_the_services_largest_under_adaptive_k_else_a_fixed_one() -> None:
    adaptive = GatewayConfig(target_address="a:1", draft_address="b:2")
    assert adaptive.num_speculative_tokens == 0 and adaptive.k_for(16) == 16 and adaptive.k_for(4) == 4
    assert adaptive.k_for(16, costs_known=False) == DEFAULT_FIXED_K  # nothing to adapt by: K stays fixed
    fixed = GatewayConfig(target_address="a:1", draft_address="b:2", adaptive_k=False)
    assert fixed.k_for(16) == DEFAULT_FIXED_K and fixed.k_for(4) == 4
    assert GatewayConfig(target_address="a:1", num_speculative_tokens=6).k_for(16) == 6
