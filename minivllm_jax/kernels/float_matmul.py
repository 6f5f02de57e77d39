"""The native float32 matmul for few rows (`float_matmul.cc`): `x @ w` for a projection's
`[in, out]` kernel, read in place. It serves steps of 2 to `MAX_NATIVE_ROWS` rows (small decode
batches, speculative verify steps), where XLA's dot reads the weights at half the speed of its
1-row dot. One row stays with XLA (its dot streams whole weight rows; this kernel's strided panels
measured 27 against 24 ms a SmolLM2 decode step), as do longer steps, other dtypes and output
sizes that are not multiples of 64."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from minivllm_jax.kernels import require_native

MAX_NATIVE_ROWS = 8  # two passes over each panel, the second from cache
TARGET = "minivllm_matmul_f32"
TARGET_TRANSPOSED = "minivllm_matmul_f32_t"


def float_matmul_native(x: jax.Array, w: jax.Array) -> jax.Array:
    rows = x.size // x.shape[-1]
    if (
        x.dtype != jnp.float32
        or w.dtype != jnp.float32
        or w.ndim != 2
        or w.shape[1] % 64
        or not 1 < rows <= MAX_NATIVE_ROWS
    ):
        return x @ w
    require_native("matmul", "matmul='reference'")
    y = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((rows, w.shape[1]), jnp.float32))(
        x.reshape(rows, -1), w
    )
    return y.reshape(*x.shape[:-1], w.shape[1])


def float_matmul_transposed_native(x: jax.Array, w: jax.Array) -> jax.Array:
    """`x @ w.T` in float32 for `w` `[out, in]` read in place (a tied output head: the embedding),
    natively for 2 to `MAX_NATIVE_ROWS` rows; else XLA's dot, with float32 results."""
    rows = x.size // x.shape[-1]
    native = (
        x.dtype == jnp.float32 and w.dtype == jnp.float32 and w.ndim == 2 and w.shape[1] % 16 == 0
    )
    if not (native and w.shape[0] % 4 == 0 and 1 < rows <= MAX_NATIVE_ROWS):
        return jnp.einsum("...d,vd->...v", x, w, preferred_element_type=jnp.float32)
    require_native("matmul", "matmul='reference'")
    y = jax.ffi.ffi_call(TARGET_TRANSPOSED, jax.ShapeDtypeStruct((rows, w.shape[0]), jnp.float32))(
        x.reshape(rows, -1), w
    )
    return y.reshape(*x.shape[:-1], w.shape[0])
