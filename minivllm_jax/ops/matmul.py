"""The one matmul dispatcher: `matmul(x, w, impl)` for a projection's weight, whatever its type
(a float `[in, out]` array or a quantized weight of `minivllm_jax.ops.quantization`), and
`head_matmul` for the output head (float32 logits, a tied embedding read transposed).

`impl` is a static argument of the step (`models.decoder.forward(matmul=...)`):
- "reference": the pure-JAX contract (`quantization.quantized_matmul_reference`; XLA's dot).
- "native": the native kernels (`minivllm_jax.kernels`) at the row counts where they beat XLA
  (decode-sized steps; the thresholds are each kernel module's `MAX_NATIVE_ROWS`), XLA's dot at
  the others. A weight or activation the kernel cannot serve (not float32, not in the panel
  layout, an output size it does not take, the library not built) raises a ValueError naming
  why: nothing is silently served by the reference.
- "auto": "native" where the kernels serve it, else the reference, said once in the log.
`MINIVLLM_KERNELS=reference` turns both "auto" and "native" into the reference (debugging, A/B
benchmarks), as it does for attention (`ops.attention.resolve_attention`).
Everything is decided at trace time from static facts: the weight's type and layout, dtypes,
shapes and the step's row count.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from minivllm_jax import kernels
from minivllm_jax.kernels import float_matmul, quantized_matmul, w8a8_matmul
from minivllm_jax.ops.quantization import (
    Int4Weight,
    Int8Weight,
    W8A8Weight,
    is_quantized,
    quantized_matmul_reference,
)

MATMULS = ("auto", "native", "reference")
Call = Callable[[], jax.Array]


def check_matmul(impl: str) -> None:
    if impl not in MATMULS:
        raise ValueError(f"matmul must be one of {MATMULS}, got {impl!r}")


def _dispatch(impl: str, native: Call | str | None, reference: Call) -> jax.Array:
    """Run `native` (a native call, None where XLA is the faster choice, or why the kernels
    cannot serve it) or `reference`, by `impl` (the module docstring)."""
    check_matmul(impl)
    if impl == "reference" or native is None or kernels.reference_forced():
        return reference()
    if not isinstance(native, str):
        native = kernels.unavailable_reason() or native
    if isinstance(native, str):
        if impl == "native":
            raise ValueError(f"matmul='native': {native}; use matmul='auto' or 'reference'")
        kernels.log_fallback_once("matmul", native)
        return reference()
    return native()


def _rows(x: jax.Array) -> int:
    return x.size // x.shape[-1]


def _native_call(x: jax.Array, w: Any) -> Call | str | None:
    """The native call that serves `x @ w`, None where XLA's dot is the faster choice, or why
    the kernels cannot serve it."""
    rows = _rows(x)
    if rows == 0:
        return None  # nothing to multiply: no kernel needed
    if not is_quantized(w):
        if not 1 < rows <= float_matmul.MAX_NATIVE_ROWS:
            return None
        reason = float_matmul.supports(x.dtype, w.dtype, w.shape)
        return reason or (lambda: float_matmul.float_matmul(x, w))
    if not isinstance(w, W8A8Weight) and rows > quantized_matmul.MAX_NATIVE_ROWS:
        return None  # w8a8's kernel pays at every row count, the weight-only ones in decodes
    if w.layout != "panels":
        return f"{type(w).__name__} with {w.n_out} columns is not in the kernels' panel layout"
    if isinstance(w, W8A8Weight):
        reason = w8a8_matmul.supports(x.dtype, w.n_out, rows)
        return reason or (lambda: w8a8_matmul.w8a8_matmul(x, w.q, w.scales))
    reason = quantized_matmul.supports(x.dtype, w.n_out)
    if reason is not None:
        return reason
    if isinstance(w, Int4Weight):
        return lambda: quantized_matmul.int4_matmul(x, w.q, w.scales_mins)
    assert isinstance(w, Int8Weight)
    return lambda: quantized_matmul.int8_matmul(x, w.q, w.scales)


def matmul(x: jax.Array, w: Any, impl: str = "reference") -> jax.Array:
    """`x @ w` for a projection's weight `w` (a float `[in, out]` array or a quantized weight),
    by `impl` ("auto", "native" or "reference": the module docstring)."""
    return _dispatch(impl, _native_call(x, w), lambda: quantized_matmul_reference(x, w))


def head_matmul(x: jax.Array, head: Any, transposed: bool, impl: str = "reference") -> jax.Array:
    """Float32 logits `x @ head` of the output head: an `[hidden, vocab]` array or a quantized
    weight, or with `transposed` a tied `[vocab, hidden]` embedding (`x @ head.T`, read in place
    by the native kernel at 2 to `MAX_NATIVE_ROWS` rows)."""
    if is_quantized(head):  # int8 per vocabulary entry (`quantization.quantize_head`)
        return matmul(x, head, impl).astype(jnp.float32)
    if not transposed:
        return jnp.einsum("...d,dv->...v", x, head, preferred_element_type=jnp.float32)
    if impl == "reference":
        return jnp.einsum("...d,dv->...v", x, head.T, preferred_element_type=jnp.float32)
    native = None
    if 1 < _rows(x) <= float_matmul.MAX_NATIVE_ROWS:
        reason = float_matmul.supports_transposed(x.dtype, head.dtype, head.shape)
        native = reason or (lambda: float_matmul.float_matmul_transposed(x, head))
    return _dispatch(
        impl,
        native,
        lambda: jnp.einsum("...d,vd->...v", x, head, preferred_element_type=jnp.float32),
    )
