#!/bin/sh
# `make gpu-check`, also where there is no make: run on the GPU machine, in the repository's
# root, with that machine's own python3 (no venv, no package index). Installs the wheels that
# `make gpu-carry` packed into .gpu-carry/ beside the tree, puts the generated stubs in place,
# then runs every stage of the check (docs/gpu.md); arguments go to specdec_bench.gpu.check.
set -eu
PYTHON=${PYTHON:-python3}
CARRY=${GPU_CARRY:-.gpu-carry}
SITE=${GPU_SITE:-/tmp/specdec-gpu-site}
cd "$(dirname "$0")/.."
if [ ! -d "$CARRY/wheels" ]; then
    echo "no $CARRY/wheels: run 'make gpu-carry' where pip works, and carry $CARRY" >&2
    exit 1
fi
"$PYTHON" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target "$SITE" "$CARRY"/wheels/*.whl
cp -r "$CARRY/site/." "$SITE/"
cp "$CARRY"/stubs/specdec/v1/*_pb2* specdec/v1/
PYTHONPATH="$SITE:$PWD:$PWD/benchmarks" PYTHONUNBUFFERED=1 exec "$PYTHON" -m specdec_bench.gpu.check --carry "$CARRY" "$@"
