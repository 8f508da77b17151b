"""The one line `make gpu-check` ends with: the device, how many stages passed, the headline figures."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from specdec_bench.gpu.config import GpuCheckConfig, Stage

if TYPE_CHECKING:
    from specdec_bench.gpu.check import StageResult


#: Characters of a failed stage's error in the line (the JSON has all of it).
ERROR_CHARS = 80


def _num(value: Any, spec: str) -> str:
    return "?" if value is None else format(value, spec)


def _device_tests(figures: dict[str, Any], config: GpuCheckConfig) -> str:
    counts = figures.get("counts", {})
    return "tests " + (" ".join(f"{n} {word}" for word, n in counts.items()) or "?")


def _parity(figures: dict[str, Any], config: GpuCheckConfig) -> str:
    greedy = figures.get("greedy", {})
    sampled = "sampled ok" if figures.get("sampled", {}).get("finish_reason") in ("length", "stop") else "sampled ?"
    return (f"{config.dtype} spec!=plain {_num(greedy.get('mismatch_rate'), '.1%')} of {greedy.get('tokens', '?')} "
            f"tokens, {sampled}")


def _exact(figures: dict[str, Any], config: GpuCheckConfig) -> str:
    greedy = figures.get("greedy", {})
    verdict = "spec==plain" if greedy.get("tokens") and not greedy.get("mismatched_tokens") else "spec!=plain"
    return f"{config.exact_dtype} {verdict} ({greedy.get('tokens', '?')} tokens)"


def _invariant(figures: dict[str, Any], config: GpuCheckConfig) -> str:
    greedy = figures.get("greedy", {})
    verdict = "spec==plain" if greedy.get("tokens") and not greedy.get("mismatched_tokens") else "spec!=plain"
    return (f"invariant {config.dtype} {verdict} ({greedy.get('tokens', '?')} tokens, "
            f"plain {_num(greedy.get('plain_s'), '.1f')} s, spec {_num(greedy.get('speculative_s'), '.1f')} s)")


def _steps(figures: dict[str, Any], config: GpuCheckConfig) -> str:
    parts = []
    for key, label in (("steps", "eager"), ("graph_steps", "graphs")):
        if not (rows := figures.get(key, [])):
            continue
        first = rows[0]
        parts.append(f"{label} step b{first['batch']} {_num(first['step_s'] * 1e3, '.2f')} ms "
                     f"({_num(first.get('step_roofline_fraction'), '.0%')} of roofline), verify/step "
                     + "/".join(_num(r["verify_over_step"], ".2f") for r in rows)
                     + " at b" + "/".join(str(r["batch"]) for r in rows))
    return "; ".join(parts) or "steps ?"


def _stack(figures: dict[str, Any], config: GpuCheckConfig) -> str:
    plain = figures.get("plain_decode", {})
    parts = [f"plain {_num(plain.get('stack_tokens_per_s'), '.0f')} tok/s = "
             f"{_num(plain.get('stack_over_transformers'), '.2f')}x generate"]
    efficiency = figures.get("efficiency", {})
    for row in efficiency.get("by_k", []):
        parts.append(f"efficiency K={row['k']} {_num(row['efficiency'], '.2f')}")
    if efficiency:
        parts[-1] += f" (alpha {_num(efficiency.get('alpha'), '.3f')}, c {_num(efficiency.get('c'), '.2f')})"
    rows = figures.get("concurrency", [])
    if rows:
        levels = "/".join(str(r["concurrency"]) for r in rows)
        parts.append(f"conc {levels} plain " + "/".join(_num(r["plain_tokens_per_s"], ".0f") for r in rows)
                     + f" spec(K={rows[0]['k']}) " + "/".join(_num(r["speculative_tokens_per_s"], ".0f") for r in rows)
                     + " tok/s")
    return ", ".join(parts)


def _defaults(figures: dict[str, Any], config: GpuCheckConfig) -> str:
    info = figures.get("model_info", {})
    return (f"draft defaults {info.get('dtype', '?')}/{info.get('quantization', '?')} "
            f"ready in {_num(figures.get('ready_s'), '.0f')} s")


_BRIEFS: dict[Stage, Callable[[dict[str, Any], GpuCheckConfig], str]] = {
    Stage.DEVICE_TESTS: _device_tests, Stage.GREEDY_PARITY: _parity, Stage.GREEDY_EXACT: _exact,
    Stage.GREEDY_INVARIANT: _invariant,
    Stage.STEP_SPEED: _steps, Stage.STACK_SPEED: _stack, Stage.SERVICE_DEFAULTS: _defaults,
}


def summary_line(config: GpuCheckConfig, results: Sequence[StageResult]) -> str:
    """`gpu-check <device>: <n>/<m> stages ok | <figures of each stage that has some> | failed: ...`."""
    environment = next((r.figures for r in results if r.stage is Stage.PREFLIGHT), {})
    device = environment.get("device", {}).get("name", config.device)
    passed = sum(r.ok for r in results)
    parts = [f"gpu-check {device}: {passed}/{len(results)} stages ok"]
    for result in results:
        brief = _BRIEFS.get(result.stage)
        if brief is not None and result.figures:
            try:
                parts.append(brief(result.figures, config))
            except (KeyError, TypeError, ValueError) as error:  # a partial record: say so, keep the line
                parts.append(f"{result.stage.value} unreadable ({type(error).__name__})")
    failed = [f"{r.stage.value} {r.status.value} ({r.error[:ERROR_CHARS]})" for r in results if not r.ok]
    if failed:
        parts.append("not ok: " + ", ".join(failed))
    return " | ".join(parts)
