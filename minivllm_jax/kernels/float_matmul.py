"""The native float32 matmul for few rows (`float_matmul.cc`): `x @ w` for a projection's
`[in, out]` kernel, and `x @ w.T` for a tied output head's `[vocab, hidden]` embedding, both
read in place. It pays for steps of 2 to `MAX_NATIVE_ROWS` rows (small decode batches,
speculative verify steps), where XLA's dot reads the weights at half the speed of its 1-row dot;
one row stays with XLA (its dot streams whole weight rows; this kernel's strided panels were
slower there), as do longer steps: that choice is the dispatcher's (`minivllm_jax.ops.matmul`).

`supports(...)` / `supports_transposed(...)` say what the kernel serves; the calls raise on
anything else."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from minivllm_jax.kernels import require_native

MAX_NATIVE_ROWS = 8  # two passes over each panel, the second from cache
TARGET = "minivllm_matmul_f32"
TARGET_TRANSPOSED = "minivllm_matmul_f32_t"


def supports(x_dtype: jnp.dtype, w_dtype: jnp.dtype, w_shape: tuple[int, ...]) -> str | None:
    """None when the kernel serves `x @ w` for these dtypes and `w`'s shape, else why not."""
    if x_dtype != jnp.float32 or w_dtype != jnp.float32:
        return f"the native float matmul takes float32, not {jnp.dtype(x_dtype)} x {jnp.dtype(w_dtype)}"
    if len(w_shape) != 2 or w_shape[1] % 64:
        return "the native float matmul takes an [in, out] kernel with out a multiple of 64"
    return None


def supports_transposed(
    x_dtype: jnp.dtype, w_dtype: jnp.dtype, w_shape: tuple[int, ...]
) -> str | None:
    """None when the kernel serves `x @ w.T` for these dtypes and `w`'s shape, else why not."""
    if x_dtype != jnp.float32 or w_dtype != jnp.float32:
        return f"the native float matmul takes float32, not {jnp.dtype(x_dtype)} x {jnp.dtype(w_dtype)}"
    if len(w_shape) != 2 or w_shape[1] % 16 or w_shape[0] % 4:
        return "the native transposed matmul takes [out, in] with in a multiple of 16, out of 4"
    return None


def _call(target: str, x: jax.Array, w: jax.Array, n_out: int, reason: str | None) -> jax.Array:
    if reason is not None:
        raise ValueError(reason)
    require_native("matmul", "matmul='reference'")
    rows = x.size // x.shape[-1]
    y = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((rows, n_out), jnp.float32))(
        x.reshape(rows, -1), w
    )
    return y.reshape(*x.shape[:-1], n_out)


def float_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """`x @ w` for a float32 `[in, out]` kernel (`supports`)."""
    return _call(TARGET, x, w, w.shape[-1], supports(x.dtype, w.dtype, w.shape))


def float_matmul_transposed(x: jax.Array, w: jax.Array) -> jax.Array:
    """`x @ w.T` in float32 for `w` `[out, in]` (`supports_transposed`)."""
    return _call(
        TARGET_TRANSPOSED, x, w, w.shape[0], supports_transposed(x.dtype, w.dtype, w.shape)
    )
