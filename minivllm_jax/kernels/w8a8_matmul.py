"""The native W8A8 matmul (`w8a8_matmul.cc`, AVX-512 VNNI) and the panel layout it reads.

It keeps the contract of `minivllm_jax.ops.quantization.w8a8_matmul_reference` exactly (integer
sums are exact, and the float steps are the reference's), for every row count: decode steps use
it too. It reads VNNI-packed weights (`[ceil(in / 4), 4 * out]`, each column's 4 inputs side by
side) as panels of `PANEL` columns, `[ceil(out / PANEL), ceil(in / 4), 4 * PANEL]` (`to_panels`).
`supports(...)` says what it serves; `w8a8_matmul` raises on anything else.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from minivllm_jax.kernels import require_native
from minivllm_jax.kernels.quantized_matmul import PANEL, panels, unpanels

TARGET = "minivllm_matmul_w8a8_f32"
COLUMN_WIDTH = 4  # array columns of one output column in the packed layout (4 inputs)


def to_panels(q: jax.Array) -> jax.Array:
    """Packed `[..., ceil(in / 4), 4 * out]` -> `[..., ceil(out / PANEL), ceil(in / 4), 4 * PANEL]`."""
    return panels(q, PANEL * COLUMN_WIDTH)


def from_panels(q_panels: jax.Array, n_out: int) -> jax.Array:
    """Inverse of `to_panels`."""
    return unpanels(q_panels, COLUMN_WIDTH * n_out)


def supports(x_dtype: jnp.dtype, n_out: int, rows: int) -> str | None:
    """None when the kernel serves `rows` float activations of `x_dtype` against `n_out` columns
    in the panel layout, else why not (a pure predicate on static facts)."""
    if x_dtype != jnp.float32:
        return f"the native w8a8 matmul takes float32 activations, not {jnp.dtype(x_dtype)}"
    if n_out % 16:
        return "the native w8a8 matmul takes output sizes that are multiples of 16"
    if rows == 0:
        return "the native w8a8 matmul takes at least one row"
    return None


def w8a8_matmul(x: jax.Array, q_panels: jax.Array, scales: jax.Array) -> jax.Array:
    """`x @ W` the w8a8 way (rows quantized on the fly) for `to_panels` weights and scales `[out]`."""
    n_out, rows = scales.shape[-1], x.size // x.shape[-1]
    reason = supports(x.dtype, n_out, rows)
    if reason is not None:
        raise ValueError(reason)
    require_native("matmul", "matmul='reference'")
    out = jax.ShapeDtypeStruct((rows, n_out), jnp.float32)
    y = jax.ffi.ffi_call(TARGET, out)(x.reshape(rows, x.shape[-1]), q_panels, scales)
    return y.reshape(*x.shape[:-1], n_out)
