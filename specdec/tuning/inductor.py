"""Where compiled graphs are kept between starts: inductor's own on-disk cache.

Inductor keeps its compiled kernels and graphs under `TORCHINDUCTOR_CACHE_DIR`, by default a
directory in /tmp that a reboot may empty. A service puts it beside its other caches instead
(`<specdec cache dir>/inductor`), so a restart reloads its graphs rather than compiling them,
unless the operator chose a directory.
"""

from __future__ import annotations

import os

from specdec.model.loader import default_cache_dir

CACHE_DIR_ENV = "TORCHINDUCTOR_CACHE_DIR"


def use_compile_cache() -> tuple[str, str]:
    """Point inductor's cache at the specdec cache dir unless `TORCHINDUCTOR_CACHE_DIR` is set;
    returns the directory and why ("flag": the environment's, "fixed": ours). Call it before
    anything compiles."""
    if chosen := os.environ.get(CACHE_DIR_ENV):
        return chosen, "flag"
    path = str(default_cache_dir() / "inductor")
    os.environ[CACHE_DIR_ENV] = path
    return path, "fixed"
