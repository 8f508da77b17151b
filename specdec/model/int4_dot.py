"""``"int4dot"``: our own 4-bit matmul for x86-64 CPUs with AVX-512 BF16 or AVX2 (`csrc/int4_dot.cpp`).

The draft's decode steps are 1-4 rows through small matrices, where
`torch._weight_int4pack_mm_for_cpu` is bound by its per-weight dequantization, not by memory.
The kernel here applies scales and zeros once per group, not per weight. With AVX-512 BF16 it
turns each 4-bit code into a bf16 number with one bitwise OR and multiplies 32 of them at a
time with ``vdpbf16ps``; with AVX2 it turns 8 codes into fp32 integers at a time and multiplies
them with one FMA (docs/performance.md#int4-kernels).

The library is compiled on first use with the machine's C++ compiler (the one torch.compile
uses) for the best instruction set the CPU has, into the specdec cache directory, keyed by the
source, the torch version and the flags, and loaded with `torch.ops.load_library`. Where the CPU
has neither instruction set, the compiler is missing or the build fails, `available` is False
and `quantize_int4` chooses among the other kernels; the start-up tuner times it against them
(`specdec.tuning.kernels`). The op has a fake (meta) implementation, so compiled graphs call it
as an extern kernel.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from specdec.model.int4_weight import Int4Weight
from specdec.model.loader import building, default_cache_dir

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
#: Compiled into one library: the matmul, and the decode step that calls it with its attention
#: (`specdec.model.native_steps`).
SOURCES = (CSRC / "int4_dot.cpp", CSRC / "decode_layers.cpp", CSRC / "decode_attention.cpp")
HEADERS = (CSRC / "int4_dot.h", CSRC / "decode_common.h", CSRC / "decode_attention.h")
#: Outputs per block of the packed layout: the op needs ``out % OUT_BLOCK == 0``.
OUT_BLOCK = 64
#: Per instruction set the kernel is built for, best first: the CPU flags (as /proc/cpuinfo
#: names them) it needs, and the compiler flags that select it in the source.
ISA_FLAGS: dict[str, tuple[frozenset[str], tuple[str, ...]]] = {
    "avx512_bf16": (frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_bf16"}),
                    ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16")),
    "avx2": (frozenset({"avx2", "fma"}), ("-mavx2", "-mfma")),
}
#: Names the build to use in place of the best one (e.g. "avx2" on an AVX-512 CPU, to test it).
ISA_ENV = "SPECDEC_INT4DOT_ISA"
COMPILE_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp")
#: The build of one small file against torch's headers takes seconds; more means something is wrong.
BUILD_TIMEOUT_S = 300.0


def cpu_flags() -> frozenset[str]:
    """This CPU's flags as /proc/cpuinfo lists them (empty off Linux on x86-64)."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return frozenset()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def instruction_set(flags: frozenset[str] | None = None) -> str | None:
    """The best instruction set of `ISA_FLAGS` this CPU (or one with `flags`) has, or None.
    For this CPU, `ISA_ENV` may name a lesser one it also has (to test that build)."""
    have = cpu_flags() if flags is None else flags
    usable = [isa for isa, (needs, _) in ISA_FLAGS.items() if needs <= have]
    forced = os.environ.get(ISA_ENV, "") if flags is None else ""
    if forced:
        if forced not in usable:
            raise RuntimeError(f"{ISA_ENV}={forced}: this CPU runs only {usable or 'none'} of {list(ISA_FLAGS)}")
        return forced
    return usable[0] if usable else None


def _build(library: Path, isa: str) -> None:
    """Compile `SOURCES` into ``library`` (written under a temporary name, then renamed, so
    processes building at once never load a half-written file)."""
    from torch.utils import cpp_extension  # imports setuptools: only when we build

    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++ or $CXX) on PATH")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
        partial = Path(scratch) / library.name
        command = [
            compiler, *COMPILE_FLAGS, *ISA_FLAGS[isa][1], f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            *(f"-I{path}" for path in cpp_extension.include_paths()),
            *(str(source) for source in SOURCES), "-o", str(partial),
            *(f"-L{path}" for path in cpp_extension.library_paths()), "-lc10", "-ltorch_cpu",
        ]
        result = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed ({result.returncode}): {result.stderr.strip()[-2000:]}")
        os.replace(partial, library)


def _library_path(isa: str) -> Path:
    key = hashlib.sha256()
    sources = b"".join(path.read_bytes() for path in (*SOURCES, *HEADERS))
    for part in (sources, torch.__version__.encode(), " ".join(COMPILE_FLAGS + ISA_FLAGS[isa][1]).encode()):
        key.update(part)
    return default_cache_dir() / "kernels" / f"int4_dot-{isa}-{key.hexdigest()[:16]}.so"


@functools.cache
def available() -> bool:
    """Build (once per machine) and load the kernel; False, with the reason logged, where it cannot run."""
    try:
        isa = instruction_set()
    except RuntimeError as exc:
        log.warning("int4dot kernel: not available (%s)", exc)
        return False
    if isa is None:
        log.info("int4dot kernel: not available (the CPU has neither AVX-512 BF16 nor AVX2 with FMA)")
        return False
    library = _library_path(isa)
    try:
        if not library.exists():
            with building(library):  # processes starting together build it once
                if not library.exists():
                    log.info("int4dot kernel: compiling %s for %s", ", ".join(s.name for s in SOURCES), isa)
                    _build(library, isa)
        torch.ops.load_library(str(library))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("int4dot kernel: not available (%s)", exc)
        return False

    @torch.library.register_fake("specdec::int4_dot_mm")
    def _fake(x: torch.Tensor, packed: torch.Tensor, sz: torch.Tensor, group_size: int) -> torch.Tensor:
        return x.new_empty(x.shape[0], packed.shape[0] * OUT_BLOCK)

    return True


def supported(weight: Int4Weight) -> bool:
    """Whether this layer's shape fits the kernel's layout."""
    return weight.out_features % OUT_BLOCK == 0 and weight.group_size % 4 == 0


def pack(weight: Int4Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's operands: codes [out / 64, in / 4, 128] uint8 and scales and offsets
    [out / 64, groups, 2, 64] bfloat16 (the layout is described in `csrc/int4_dot.cpp`).

    The offset is ``zero + 8 * scale`` in bfloat16, the value `_weight_int4pack_mm_for_cpu`
    takes, so the two kernels compute the same sum up to rounding order.
    """
    if not supported(weight):
        raise ValueError(f"int4dot cannot take out={weight.out_features}, group_size={weight.group_size}")
    out, in_features = weight.q.shape
    blocks, groups = out // OUT_BLOCK, in_features // weight.group_size
    q = weight.q.reshape(blocks, 4, 16, in_features // 4, 4).permute(0, 3, 1, 2, 4)  # [blocks, in / 4, 4, 16, 4]
    even = q[..., 0] | (q[..., 2] << 4)  # [blocks, in / 4, 4, 16]: codes of k (low) and k + 2 (high)
    odd = q[..., 1] | (q[..., 3] << 4)  # codes of k + 1 and k + 3
    codes = torch.stack([even, odd], dim=-1).reshape(blocks, in_features // 4, 128).contiguous()
    offsets = weight.zeros + 8 * weight.scales  # [out, groups]
    parts = [t.to(torch.bfloat16).reshape(blocks, OUT_BLOCK, groups).transpose(1, 2) for t in (weight.scales, offsets)]
    sz = torch.stack(parts, dim=2)  # [blocks, groups, 2, 64]
    return codes, sz.contiguous()


def int4_dot_mm(x: torch.Tensor, codes: torch.Tensor, sz: torch.Tensor, group_size: int) -> torch.Tensor:
    """[rows, in] bfloat16 -> [rows, out] bfloat16 (`available` must have returned True)."""
    return torch.ops.specdec.int4_dot_mm(x, codes, sz, group_size)
