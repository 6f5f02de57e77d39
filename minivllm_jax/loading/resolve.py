"""Model names users type (a converted directory, an HF folder, a .gguf, or an alias of a
shipped model: `minivllm_jax.loading.aliases`), converted once into a cache and reused."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from minivllm_jax.loading.aliases import MODEL_ALIASES, alias_source
from minivllm_jax.loading.checkpoint import is_converted_dir
from minivllm_jax.loading.errors import CheckpointNotFoundError, OutputExistsError
from minivllm_jax.loading.reader import EXPECTED, check_dtype
from minivllm_jax.loading.writer import convert_checkpoint


def cache_root(cache_dir: str | Path | None = None) -> Path:
    return Path(
        cache_dir or os.environ.get("MINIVLLM_CACHE_DIR") or Path.home() / ".cache" / "minivllm_jax"
    )


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
