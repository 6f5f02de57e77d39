"""Native CPU kernels behind the pure signatures, as XLA FFI custom calls.

Each kernel is a C++ source here (`*.cc`, built by `build.py` into one library at install
time) with its JAX wrapper beside it (`ragged_paged_attention.py`); the pure-JAX reference it
must equal stays where the op's contract lives (`minivllm_jax.ops.attention`). To XLA a custom call
is a pure function of its operands, so the model stays pure.

`native_available()` says whether the library is built and loaded (its FFI targets registered
for platform "cpu"). `MINIVLLM_KERNELS=reference` in the environment forces the pure-JAX
reference everywhere (debugging, A/B benchmarks). A missing or stale library gives one warning
and the reference path.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from pathlib import Path

import jax

logger = logging.getLogger(__name__)

FORCE_REFERENCE_ENV = "MINIVLLM_KERNELS"
HERE = Path(__file__).resolve().parent
LIBRARY = HERE / "_build" / "libminivllm_kernels.so"  # what `build.py` writes
# FFI target name -> symbol in the library
TARGETS = {
    "minivllm_ragged_paged_attention_f32": "MinivllmRaggedPagedAttentionF32",
    "minivllm_ragged_paged_attention_int8kv": "MinivllmRaggedPagedAttentionInt8KV",
    "minivllm_matmul_int8_f32": "MinivllmMatmulInt8F32",
    "minivllm_matmul_int4_f32": "MinivllmMatmulInt4F32",
    "minivllm_matmul_w8a8_f32": "MinivllmMatmulW8A8F32",
    "minivllm_matmul_f32": "MinivllmMatmulF32",
    "minivllm_matmul_f32_t": "MinivllmMatmulF32Transposed",
}


def sources() -> list[Path]:
    """The C++ sources built into `LIBRARY`: every `*.cc` here."""
    return sorted(HERE.glob("*.cc"))


def headers() -> list[Path]:
    return sorted(HERE.glob("*.h"))


def is_stale() -> bool:
    """The library is missing or older than a source."""
    if not LIBRARY.is_file():
        return True
    built = LIBRARY.stat().st_mtime
    return any(src.stat().st_mtime > built for src in sources() + headers())


def reference_forced() -> bool:
    return os.environ.get(FORCE_REFERENCE_ENV, "").strip().lower() == "reference"


@functools.cache
def _load() -> bool:
    if is_stale():
        logger.warning(
            "native kernels are not built (or older than their sources): run "
            "`python -m minivllm_jax.kernels.build`; using the pure-JAX reference"
        )
        return False
    try:
        lib = ctypes.CDLL(str(LIBRARY))
        for target, symbol in TARGETS.items():
            jax.ffi.register_ffi_target(
                target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu"
            )
    except (OSError, AttributeError) as e:
        logger.warning("could not load the native kernels (%s); using the pure-JAX reference", e)
        return False
    return True


def native_available() -> bool:
    """The native library is loaded and not forced off (the CPU backend only)."""
    return unavailable_reason() is None


def unavailable_reason() -> str | None:
    """None where the native kernels serve this process, else why not (the one wording every
    dispatcher and wrapper uses)."""
    if reference_forced():
        return f"{FORCE_REFERENCE_ENV}=reference forces the pure-JAX reference"
    if jax.default_backend() != "cpu":
        return f"the native kernels are CPU-only, and this backend is {jax.default_backend()}"
    if not _load():
        return "the native kernels are not built here (python -m minivllm_jax.kernels.build)"
    return None


@functools.cache
def log_fallback_once(op: str, reason: str) -> None:
    """An "auto" choice that runs the reference says why, once per op and reason."""
    logger.info("%s='auto' runs the pure-JAX reference: %s", op, reason)


def require_native(kernel: str, fallback: str) -> None:
    """Raise, naming the setting that avoids it, when a wrapper must call the native `kernel`
    (e.g. "matmul") and the library is not available."""
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"the native {kernel} kernel cannot run: {reason}; use {fallback}")
