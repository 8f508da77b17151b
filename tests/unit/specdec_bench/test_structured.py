"""The structured workload on synthetic records: the answer check, the schemas against the
gateway's grammar, the figures, the page, the flags and the order of the requests. No services."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest

from specdec.cost_model import ForwardCost
from specdec.errors import InvalidArgumentError
from specdec_bench import structured_run
from specdec_bench.analysis import summarize
from specdec_bench.config import FULL, QUICK, add_bench_flags, config_from_args
from specdec_bench.report import render_page, summary_table
from specdec_bench.results import BenchResults, ServiceCosts
from specdec_bench.structured import (
    GROUP_SIZE,
    StructuredGroup,
    StructuredMode,
    StructuredRecord,
    StructuredRun,
    identical_outputs,
    summarize_structured,
)
from specdec_bench.structured_report import mask_share
from specdec_bench.structured_workload import (
    BOOKING,
    CONVERSION,
    PERSON,
    STRUCTURED_PROMPTS,
    TRIAGE,
    WEATHER,
    SchemaKind,
    answer_problem,
    schema_problems,
)
from specdec_bench.workloads import RunRecord

EXAMPLES: list[tuple[dict[str, Any], dict[str, Any]]] = [
    (PERSON, {"name": "Maria Lopez", "age": 34, "city": "Madrid", "occupation": "teacher", "employed": True}),
    (WEATHER, {"name": "get_weather", "arguments": {"location": "Paris", "unit": "celsius", "days": 3}}),
    (BOOKING, {"name": "book_table", "arguments": {"restaurant": "Luigi's", "party_size": 4, "time": "19:30"}}),
    (CONVERSION, {"name": "convert_currency", "arguments": {"amount": 250.5, "from": "USD", "to": "EUR"}}),
    (TRIAGE, {"category": "billing", "priority": "urgent", "sentiment": "negative", "language": "english",
              "needs_human": True, "product_area": "subscription"}),
]


def test_the_checker_accepts_the_examples_and_names_what_a_broken_answer_breaks() -> None:
    for schema, value in EXAMPLES:
        assert schema_problems(value, schema) == []
    person = EXAMPLES[0][1]
    cases = {
        "'city' is missing": {k: v for k, v in person.items() if k != "city"},
        "'email' is not allowed": person | {"email": "m@example.org"},
        "$.occupation: 'pilot' is not one of": person | {"occupation": "pilot"},
        "$.age: bool is not integer": person | {"age": True},
        "$.age: float is not integer": person | {"age": 34.5},
        "$.age: 130 > 120": person | {"age": 130},
        "longer than 24 characters": person | {"name": "M" * 25},
        "shorter than 1 characters": person | {"city": ""},
    }
    for expected, value in cases.items():
        assert any(expected in p for p in schema_problems(value, PERSON)), expected
    call = EXAMPLES[2][1]
    assert "is not 'book_table'" in schema_problems(call | {"name": "get_weather"}, BOOKING)[0]
    late = call | {"arguments": call["arguments"] | {"time": "7:30pm"}}
    assert "does not match" in schema_problems(late, BOOKING)[0]


def test_an_answer_must_parse_and_end_by_stop() -> None:
    text = json.dumps(EXAMPLES[0][1])
    assert answer_problem(text, "stop", PERSON) == ""
    assert answer_problem(text, "length", PERSON) == "finished by length, not stop"
    assert answer_problem(text[:-1], "stop", PERSON).startswith("not JSON")
    assert "'employed' is missing" in answer_problem('{"name": "A", "age": 3, "city": "B", "occupation": "chef"}',
                                                      "stop", PERSON)


def test_the_workload_has_three_kinds_and_enough_requests_at_the_recommended_repetitions() -> None:
    assert {p.kind for p in STRUCTURED_PROMPTS} == set(SchemaKind)
    per_mode = 2 * (len(STRUCTURED_PROMPTS) + GROUP_SIZE)
    assert per_mode >= 50
    help_text = next(f for f in dataclasses.fields(FULL) if f.name == "structured_repetitions").metadata["help"]
    assert f"2 gives {per_mode} constrained requests per mode" in help_text


def test_every_schema_compiles_for_the_gateway_and_its_example_walks_the_grammar() -> None:
    from specdec.gateway.grammar import JsonSchema
    from specdec.grammar import GrammarCompiler
    from specdec.model.choices import DEFAULT_MODEL
    from specdec.model.loader import load_tokenizer

    tokenizer = load_tokenizer(DEFAULT_MODEL)
    compiler = GrammarCompiler(tokenizer, 49152, [tokenizer.eos_token_id])
    assert {json.dumps(p.schema) for p in STRUCTURED_PROMPTS} == {json.dumps(s) for s, _ in EXAMPLES}
    for schema, value in EXAMPLES:
        grammar = compiler.compile(JsonSchema(json.dumps(schema)).grammar(), "json_schema")
        # The gateway's JSON is compact (`JSON_DEFAULTS`): no optional whitespace.
        tokens = list(tokenizer(json.dumps(value, separators=(",", ":")), add_special_tokens=False)["input_ids"])
        _, legal = grammar.masks_along([*tokens, tokenizer.eos_token_id])
        assert legal == len(tokens) + 1, schema


def _record(mode: StructuredMode, rate: float, *, prompt: int = 0, tokens: int = 30, output: str = "a",
            problem: str = "") -> StructuredRecord:
    run = RunRecord(phase="structured", prompt=prompt, k=mode.k, temperature=0.0, repetition=0, tokens_per_s=rate,
                    time_to_first_token_s=0.1, total_s=1.0, completion_tokens=tokens, num_rounds=5,
                    num_draft_tokens=20, num_accepted_tokens=15, anatomy={}, num_plain_rounds=0)
    return StructuredRecord(mode.value, "extraction", run, 96, "stop", problem, output)


def _group(mode: StructuredMode, slot: int, rate: float, *, level: int = 1, forced: int | None = 12,
           **extra: Any) -> StructuredGroup:
    requests = [_record(mode, rate, prompt=i, **extra) for i in range(level)]
    return StructuredGroup(mode.value, level, slot, level * 30 / rate, requests,
                           forced if mode is StructuredMode.SPECULATIVE else 0)


def _run() -> StructuredRun:
    rates = {StructuredMode.SPECULATIVE: 60.0, StructuredMode.PLAIN: 20.0, StructuredMode.NO_GRAMMAR_DRAFTS: 40.0,
             StructuredMode.FREE_SPECULATIVE: 30.0, StructuredMode.FREE_PLAIN: 20.5}
    groups = [_group(m, 0, r) for m, r in rates.items()]
    # Slot 1: plain at half speed (spec ÷ plain 6), and the no-grammar-drafts answer differs.
    groups += [_group(m, 1, r / 2 if m is StructuredMode.PLAIN else r,
                      output="b" if m is StructuredMode.NO_GRAMMAR_DRAFTS else "a") for m, r in rates.items()]
    # 16 at once: every constrained plain answer invalid; masks cost 2.5 % of a step (20.5 ÷ 20).
    groups += [_group(m, 2, 4 * r, level=GROUP_SIZE, problem="not JSON" if m is StructuredMode.PLAIN else "")
               for m, r in rates.items()]
    return StructuredRun({"repetitions": 1, "max_new_tokens": 96, "prompts": 12, "second_gateway":
                          "--no-grammar-drafts"}, groups)


def test_ratios_pair_the_slots_and_the_targets_stand_beside_them() -> None:
    s = summarize_structured(_run(), "Test CPU, 2 logical CPUs")
    plain = s.ratio(1, StructuredMode.SPECULATIVE, StructuredMode.PLAIN)
    assert plain is not None and plain.measured == pytest.approx((3.0 + 6.0) / 2) and plain.met
    drafts = s.ratio(1, StructuredMode.SPECULATIVE, StructuredMode.NO_GRAMMAR_DRAFTS)
    assert drafts is not None and drafts.measured == pytest.approx(1.5) and drafts.minimum == 1.2 and drafts.met
    mask = s.ratio(GROUP_SIZE, StructuredMode.PLAIN, StructuredMode.FREE_PLAIN)
    assert mask is not None and mask.measured == pytest.approx(20 / 20.5) and mask.met
    assert mask_share(s, GROUP_SIZE) == pytest.approx(0.025)
    together = s.ratio(GROUP_SIZE, StructuredMode.SPECULATIVE, StructuredMode.PLAIN)
    assert together is not None and together.met is None  # no target at 16
    row = s.row(1, StructuredMode.SPECULATIVE)
    assert row is not None and row.forced_share == pytest.approx(12 / 30) and row.acceptance_rate == 0.75
    row = s.row(GROUP_SIZE, StructuredMode.SPECULATIVE)
    assert row is not None and row.forced_share == pytest.approx(12 / (GROUP_SIZE * 30))
    assert (s.valid, s.constrained) == (3 * (2 + GROUP_SIZE) - GROUP_SIZE, 3 * (2 + GROUP_SIZE))
    assert s.problems == [f"constrained plain, prompt {i} at 16: not JSON" for i in range(5)]
    assert s.identical == {1: (1, 2), GROUP_SIZE: (GROUP_SIZE, GROUP_SIZE)}
    assert s.free_identical[1] == (2, 2)


def test_identity_needs_every_mode_of_the_slot() -> None:
    groups = [_group(StructuredMode.SPECULATIVE, 0, 10.0), _group(StructuredMode.PLAIN, 0, 10.0)]
    assert identical_outputs(groups, 1, (StructuredMode.SPECULATIVE, StructuredMode.PLAIN)) == (1, 1)
    assert identical_outputs(groups, 1, (StructuredMode.SPECULATIVE, StructuredMode.FREE_PLAIN)) == (0, 0)
    unread = summarize_structured(StructuredRun({}, [_group(StructuredMode.SPECULATIVE, 0, 10.0, forced=None)]), "")
    assert math.isnan(unread.rows[0].forced_share)


def test_the_page_the_summary_table_and_the_json(tmp_path: Path) -> None:
    costs = ServiceCosts(target=[ForwardCost(1, 1, 0.05)], draft=[ForwardCost(1, 1, 0.01)],
                         default_num_speculative_tokens=4, max_speculative_tokens=8, adaptive_k=True)
    w1 = [_record(StructuredMode.FREE_PLAIN, 10.0).run, _record(StructuredMode.FREE_SPECULATIVE, 15.0).run]
    meta = {"config": {}, "machine": {"cpu_model": "Test CPU 9000", "cpus": 2}}
    path = tmp_path / "bench.json"
    BenchResults(meta, costs, w1, structured=_run()).save(path)
    loaded = BenchResults.load(path)
    assert loaded.structured == _run()
    summary = summarize(loaded)
    table = summary_table(summary)
    assert ("structured, 1 request: constrained speculative ÷ constrained plain (target ≥ 2×) | 4.500× (met)"
            in table)
    assert "constrained answers that parse and satisfy their schema (target 100 %) | 38 / 54 (missed)" in table
    assert "identical in the 3 constrained modes (target all) | 17 / 18 (missed)" in table
    plots = {name: tmp_path / f"{name}.png" for name in
             ("speedup_vs_k", "throughput_vs_concurrency", "acceptance_by_position", "round_anatomy")}
    page = render_page(loaded, summary, plots, tmp_path / "benchmarks.md", path)
    section = page[page.index("## Structured output"):]
    assert "CPU: **Test CPU 9000, 2 logical CPUs**" in section and "`--no-grammar-drafts`" in section
    assert "| 1 | constrained speculative | 60.0 | 60.0–60.0 | 2 | 2 | 30.0 | 40 % | 0.750 | 2 / 2 |" in section
    mask = "| 16 | constrained plain ÷ unconstrained plain | 0.976× | ≥ 0.952×, masks ≤ 5 % of a step | met |"
    assert mask in section
    assert "2.5 % of a decode step at 16 requests (target ≤ 5 % at 16)" in section
    without = dataclasses.replace(loaded, structured=None)
    assert "Structured output" not in render_page(without, summarize(without), plots, tmp_path / "b.md", path)


def test_flags_presets_and_checks() -> None:
    parser = argparse.ArgumentParser()
    add_bench_flags(parser)
    assert FULL.structured_repetitions == QUICK.structured_repetitions == 0
    config = config_from_args(parser.parse_args(["--quick", "--structured-repetitions", "2",
                                                 "--structured-tokens", "64"]))
    assert (config.structured_repetitions, config.structured_tokens) == (2, 64)
    with pytest.raises(InvalidArgumentError, match="structured_repetitions"):
        dataclasses.replace(FULL, structured_repetitions=-1)
    with pytest.raises(InvalidArgumentError):
        dataclasses.replace(FULL, structured_tokens=1)


def test_each_slot_runs_every_mode_once_in_rotating_order(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[StructuredMode, list[int], int]] = []

    def fake(plan: structured_run.Plan, mode: StructuredMode, prompts: list[int], *, slot: int,
             repetition: int) -> StructuredGroup:
        calls.append((mode, list(prompts), slot))
        return StructuredGroup(mode.value, len(prompts), slot, 1.0)

    class Bar:
        def update(self, n: float | None = 1) -> bool | None:
            return None

        def set_description(self, desc: str | None = None, refresh: bool | None = True) -> None:
            pass

    monkeypatch.setattr(structured_run, "run_structured_group", fake)
    plan = structured_run.Plan({}, 96, {0: 20})
    groups = structured_run.structured_groups(plan, 2, Bar())
    count, modes = len(STRUCTURED_PROMPTS), len(StructuredMode)
    assert len(groups) == 2 * (count + 1) * modes
    slots = sorted({slot for _, _, slot in calls})
    assert slots == list(range(2 * (count + 1)))
    for slot in slots:
        assert sorted(m.value for m, _, s in calls if s == slot) == sorted(m.value for m in StructuredMode)
    assert [m for m, _, s in calls if s == 1][0] is not [m for m, _, s in calls if s == 0][0]
    together = [prompts for _, prompts, _ in calls if len(prompts) > 1]
    assert len(together) == 2 * modes and all(len(p) == GROUP_SIZE for p in together)
    assert together[0] != together[-1]  # the second repetition's group starts further on
    # Unconstrained requests get the constrained plain answer's length; constrained ones the budget.
    assert plan.budget(StructuredMode.FREE_PLAIN, 0) == 20 and plan.budget(StructuredMode.PLAIN, 0) == 96
    assert plan.budget(StructuredMode.FREE_SPECULATIVE, 5) == 96
