"""The native weight-only quantized matmul (`quantized_matmul.cc`) behind the contract of
`minivllm_jax.ops.quantization.quantized_matmul_reference` (same result to fp32 rounding). It serves
steps of few rows (decodes), where reading the weights is the cost; weights in the serving
layout (`quantization.to_panels`), float32 activations, output sizes that are multiples of 64:
anything else runs the reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from minivllm_jax.kernels import require_native
from minivllm_jax.ops.quantization import PANEL, output_size, quantized_matmul_reference

MAX_NATIVE_ROWS = (
    64  # measured here at 64 rows: 1.6-4x faster than XLA dequantizing then multiplying
)
TARGETS = {"int8": "minivllm_matmul_int8_f32", "int4": "minivllm_matmul_int4_f32"}


def quantized_matmul_native(x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
    n_out = output_size(p)
    rows = x.size // x.shape[-1]
    served = (
        "qweight_panels" in p or "qweight4_panels" in p
    )  # the layout the kernel reads (`to_panels`)
    if not served or x.dtype != jnp.float32 or n_out % PANEL or rows > MAX_NATIVE_ROWS:
        return quantized_matmul_reference(x, p)
    require_native("matmul", "matmul='reference'")
    x2 = x.reshape(rows, x.shape[-1])
    out = jax.ShapeDtypeStruct((rows, n_out), jnp.float32)
    if "qweight_panels" in p:
        y = jax.ffi.ffi_call(TARGETS["int8"], out)(x2, p["qweight_panels"], p["scales"])
    else:
        y = jax.ffi.ffi_call(TARGETS["int4"], out)(
            x2, p["qweight4_panels"], p["scales_mins_panels"]
        )
    return y.reshape(*x.shape[:-1], n_out)
