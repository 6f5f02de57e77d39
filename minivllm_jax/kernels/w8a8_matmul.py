"""The native W8A8 matmul (`w8a8_matmul.cc`, AVX-512 VNNI) behind the contract of
`minivllm_jax.ops.quantization.w8a8_matmul_reference`: the same numbers exactly (integer sums are
exact, and the float steps are the reference's), for every row count: decode steps use it too.
It reads the weights in the serving layout (`quantization.to_panels`); float32 activations and
output sizes that are multiples of 16 only: anything else runs the reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from minivllm_jax.kernels import require_native
from minivllm_jax.ops.quantization import w8a8_matmul_reference

TARGET = "minivllm_matmul_w8a8_f32"


def w8a8_matmul_native(x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
    n_out = p["scales"].shape[-1]
    rows = x.size // x.shape[-1]
    if "qweight_a8_panels" not in p or x.dtype != jnp.float32 or n_out % 16 or rows == 0:
        return w8a8_matmul_reference(x, p)
    require_native("matmul", "matmul='reference'")
    out = jax.ShapeDtypeStruct((rows, n_out), jnp.float32)
    y = jax.ffi.ffi_call(TARGET, out)(
        x.reshape(rows, x.shape[-1]), p["qweight_a8_panels"], p["scales"]
    )
    return y.reshape(*x.shape[:-1], n_out)
