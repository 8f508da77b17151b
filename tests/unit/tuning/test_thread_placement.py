"""Which OpenMP binding a model service asks for (`specdec.tuning.thread_placement`)."""

from __future__ import annotations

import argparse

import pytest

from specdec.errors import InvalidArgumentError
from specdec.flags import add_flags, from_args
from specdec.serving.config import ModelServiceConfig
from specdec.tuning.thread_placement import ThreadPlacement, openmp_binding, parse_cores


def test_binding_is_on_by_default_one_place_per_core() -> None:
    assert openmp_binding(ThreadPlacement(), {}) == {"OMP_PROC_BIND": "close", "OMP_PLACES": "cores"}


def test_given_cores_become_the_places_in_order() -> None:
    assert openmp_binding(ThreadPlacement(cpu_cores="3,0-1"), {})["OMP_PLACES"] == "{0},{1},{3}"


@pytest.mark.parametrize("environ", [{"OMP_PROC_BIND": "false"}, {"OMP_PLACES": "threads"}])
def test_the_operators_own_openmp_setting_wins(environ: dict[str, str]) -> None:
    assert openmp_binding(ThreadPlacement(), environ) == {}


def test_the_flag_turns_binding_off() -> None:
    parser = argparse.ArgumentParser()
    add_flags(parser, ModelServiceConfig)
    assert from_args(ModelServiceConfig, parser.parse_args([])).bind_threads
    config = from_args(ModelServiceConfig, parser.parse_args(["--no-bind-threads"]))
    assert openmp_binding(config, {}) == {}


def test_core_lists_parse_or_fail_clearly() -> None:
    assert parse_cores("") == set() and parse_cores("0, 2-3") == {0, 2, 3}
    for bad in ("0-x", "3-1", "-1"):
        with pytest.raises(InvalidArgumentError, match="cpu_cores"):
            parse_cores(bad)
