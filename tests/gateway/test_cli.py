"""The `specdec` command line: generate (streaming and --json), info, and serve (the whole trio)."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Iterable
from pathlib import Path

import pytest

from specdec.cli.main import build_parser
from specdec.client import SpecdecClient
from specdec.serving.ready import ReadyLine, parse_ready_line

CLI = [sys.executable, "-m", "specdec.cli"]


def _generate(address: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, "generate", "--gateway", address, *args], capture_output=True, text=True, timeout=180)


def test_generate_json_prints_one_object(int8_stack) -> None:  # type: ignore[no-untyped-def]
    done = _generate(int8_stack.address, "Name three fruits.", "--max-new-tokens", "12", "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert set(result) >= {
        "text", "token_ids", "finish_reason", "acceptance_rate", "mean_acceptance_length", "tokens_per_s",
    }
    assert len(result["token_ids"]) == 12 and result["finish_reason"] == "length"
    with int8_stack.client() as client:
        same = client.generate([{"role": "user", "content": "Name three fruits."}], max_new_tokens=12)
    assert result["token_ids"] == same.token_ids and result["text"] == same.text


def test_generate_streams_text_and_prints_statistics(int8_stack) -> None:  # type: ignore[no-untyped-def]
    done = _generate(int8_stack.address, "Say hi.", "--max-new-tokens", "8", "--temperature", "0.8", "--seed", "3",
                     "--min-p", "0.05", "--presence-penalty", "0.5", "--frequency-penalty", "0.3",
                     "--logit-bias", "28=2", "--logit-bias", "30=-100")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()
    assert "acceptance rate" in done.stderr and "tok/s" in done.stderr


def test_generate_structured_output_flags(int8_stack, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    schema = tmp_path / "answer.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                                  "additionalProperties": False}))
    done = _generate(int8_stack.address, "Is water wet?", "--json-schema", f"@{schema}", "--json")
    assert done.returncode == 0, done.stderr
    assert set(json.loads(json.loads(done.stdout)["text"])) == {"ok"}
    chosen = _generate(int8_stack.address, "Pick one.", "--choice", "left", "--choice", "right", "--json")
    assert json.loads(chosen.stdout)["text"] in ("left", "right")
    both = _generate(int8_stack.address, "x", "--regex", "a+", "--json-object")
    assert both.returncode == 2 and "not allowed with" in both.stderr


def test_generate_logit_bias_flags_parse_to_pairs(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["generate", "hi", "--logit-bias", "42=-100", "--logit-bias", "7=0.5"])
    assert dict(args.logit_bias) == {42: -100.0, 7: 0.5}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "hi", "--logit-bias", "42"])
    assert "TOKEN_ID=BIAS" in capsys.readouterr().err


def test_generate_error_exits_non_zero_with_status(int8_stack) -> None:  # type: ignore[no-untyped-def]
    done = _generate(int8_stack.address, "hi", "--num-speculative-tokens", "99", "--json")
    assert done.returncode != 0
    assert "INVALID_ARGUMENT" in done.stderr and "num_speculative_tokens" in done.stderr
    assert done.stdout == ""


def test_info_prints_the_models_and_the_planner(int8_stack) -> None:  # type: ignore[no-untyped-def]
    with int8_stack.client() as client:
        client.generate("Name three fruits.", max_new_tokens=4)  # a round, so the planner has reported
        info = client.info()
    done = subprocess.run([*CLI, "info", "--gateway", int8_stack.address, "--json"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    printed = json.loads(done.stdout)
    assert printed["target"]["model_name"] == info.target.model_name and printed["draft"] is not None
    planner = printed["planner"]
    assert set(planner) == {"sources", "draft_cost_ratio", "expected_speedup", "off_seconds"}
    for source in planner["sources"]:
        assert source["source"] in {"model", "prompt_lookup", "suffix"}, source
        assert source["state"] in {"drafting", "off", "probing"}, source
    done = subprocess.run([*CLI, "info", "--gateway", int8_stack.address], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"target       {info.target.model_name} (" in done.stdout and "planner      " in done.stdout


def test_gateway_runs_alone_against_running_services(int8_stack) -> None:  # type: ignore[no-untyped-def]
    target, draft = (f"127.0.0.1:{s.port}" for s in int8_stack.servers)
    gateway = subprocess.Popen(
        [
            sys.executable, "-m", "specdec.gateway", "--target-address", target, "--draft-address", draft,
            "--port", "0", "--log-level", "WARNING",
        ],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert gateway.stdout is not None
        line = gateway.stdout.readline()
        ready = parse_ready_line(line)
        assert ready is not None and ready.name == "gateway", line
        done = _generate(ready.address, "Name three fruits.", "--max-new-tokens", "6", "--json")
        assert done.returncode == 0, done.stderr
        assert len(json.loads(done.stdout)["token_ids"]) == 6
        gateway.send_signal(signal.SIGTERM)
        assert gateway.wait(30) == 0
    finally:
        if gateway.poll() is None:
            gateway.kill()
    int8_stack.wait_until_idle()


def test_serve_help_lists_the_everyday_flags_before_the_advanced_ones() -> None:
    done = subprocess.run([*CLI, "serve", "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    text = done.stdout.split("\noptions:", 1)[1]  # the groups, past the usage line
    order = ["--num-speculative-tokens", "--draft-quantization", "advanced: gateway:", "--decode-steps",
             "advanced: target service:", "--target-compile-budget-s"]
    assert [text.index(item) for item in order] == sorted(text.index(item) for item in order)


@pytest.mark.slow
def test_serve_runs_the_trio_and_stops_it_on_sigterm() -> None:
    serve = subprocess.Popen(
        # Without the start-up cost profiles (~10 s each; covered by test_faults and
        # test_streaming): without costs K cannot adapt, so every round drafts. Untuned
        # kernels and no compiled graphs: the same choices on every machine, no timing at
        # start-up, and no minutes of compiling on a cold cache.
        [*CLI, "serve", "--port", "0", "--metrics-port", "0", "--target-kv-token-budget", "2048",
         "--draft-kv-token-budget", "2048", "--no-target-measure-costs", "--no-draft-measure-costs",
         "--no-target-tune-kernels", "--no-draft-tune-kernels", "--target-compile", "off", "--draft-compile", "off"],
        stdout=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        assert serve.stdout is not None
        ready = _first_ready_line(serve.stdout, timeout=600)  # a cold machine loads and tunes both models
        assert ready is not None and ready.name == "gateway", "specdec serve never became ready"
        address, metrics_port = ready.address, ready.metrics_port
        with SpecdecClient(address, timeout=120) as client:
            result = client.generate([{"role": "user", "content": "Hello!"}], max_new_tokens=10)
            info = client.info()
        assert result.completion_tokens == 10 and result.num_draft_tokens > 0 and info.draft.quantization == "int4"
        import urllib.request

        metrics = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
        assert "specdec_spec_decode_num_draft_tokens_total" in metrics
        children = _children(serve.pid)
        assert len(children) == 2, children  # draft_server and target_server
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(60) == 0
        for pid in children:
            assert not _alive(pid), f"child {pid} survived"
    finally:
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGKILL)


def _first_ready_line(lines: Iterable[str], timeout: float) -> ReadyLine | None:
    """The first ready line among `lines`, read on a thread: None at the end of the output or
    after `timeout` seconds, so a start-up that hangs fails the test instead of the session."""
    found: queue.Queue[ReadyLine | None] = queue.Queue()
    threading.Thread(target=lambda: found.put(next(filter(None, map(parse_ready_line, lines)), None)),
                     daemon=True).start()
    try:
        return found.get(timeout=timeout)
    except queue.Empty:
        return None


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for our purposes.
    state = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True).stdout.strip()
    return bool(state) and not state.startswith("Z")


def test_health_exits_zero_only_when_serving(int8_stack) -> None:  # type: ignore[no-untyped-def]
    def health(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*CLI, "health", *args], capture_output=True, text=True, timeout=60)

    ok = health(int8_stack.address)
    assert ok.returncode == 0 and "SERVING" in ok.stdout, ok.stderr
    assert health(int8_stack.address, "--service", "specdec.v1.Gateway").returncode == 0
    unknown = health(int8_stack.address, "--service", "no.such.Service")
    assert unknown.returncode == 1 and "NOT_FOUND" in unknown.stderr
    closed = health("127.0.0.1:1", "--timeout", "2")
    assert closed.returncode == 1 and "UNAVAILABLE" in closed.stderr
