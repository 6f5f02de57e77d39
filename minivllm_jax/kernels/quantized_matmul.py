"""The native weight-only quantized matmul (`quantized_matmul.cc`) and the panel layout it reads.

The contract it keeps is `minivllm_jax.ops.quantization`'s reference (same result to fp32
rounding); this module imports nothing of it. The dispatcher (`minivllm_jax.ops.matmul`) asks
`supports(...)` and calls `int8_matmul` / `int4_matmul` over raw arrays, which raise on anything
else: nothing here falls back.

The panel layout (`panels`): `[..., rows, cols]` weights become `[..., ceil(cols / PANEL), rows,
PANEL]`, panels of 64 output columns, each contiguous (zero columns pad the last), so a batch-1
matmul streams memory in order instead of reading 64 bytes every `out` bytes. int4 panels also
order the bytes of each row so that the kernel's nibble-to-bf16 step reaches them
(`INT4_PANEL_ORDER`), and its scales and minimums are panels beside them (`int4_panels`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from minivllm_jax.kernels import require_native

PANEL = 64  # output columns of one panel (the kernel's work block)
# Up to this many rows the kernel beats XLA dequantizing then multiplying (a decode step is
# bound by reading the weights); past it XLA's dot is the faster choice (`ops.matmul`).
MAX_NATIVE_ROWS = 64
TARGETS = {"int8": "minivllm_matmul_int8_f32", "int4": "minivllm_matmul_int4_f32"}
# Within an int4 panel row, byte 8j + 2k + e holds column 16k + 2j + e (j < 8, k < 4, e < 2):
# each 8-byte word then holds two columns of each 16-column vector, which is what the native
# kernel's vpmultishiftqb can spread into that vector's lanes (quantized_matmul.cc).
INT4_PANEL_ORDER = np.array([16 * (p % 8 // 2) + 2 * (p // 8) + p % 2 for p in range(PANEL)])


def panels(w: jax.Array, width: int = PANEL) -> jax.Array:
    """`[..., rows, cols]` -> `[..., ceil(cols / width), rows, width]`, the last zero-padded."""
    *lead, rows, n_cols = w.shape
    blocks = -(-n_cols // width)
    w = jnp.pad(jnp.asarray(w), [(0, 0)] * (w.ndim - 1) + [(0, blocks * width - n_cols)])
    return jnp.swapaxes(w.reshape(*lead, rows, blocks, width), -3, -2)


def unpanels(p: jax.Array, n_cols: int) -> jax.Array:
    """Inverse of `panels`: `[..., rows, n_cols]`, the padding dropped."""
    *lead, blocks, rows, width = p.shape
    return jnp.swapaxes(p, -3, -2).reshape(*lead, rows, blocks * width)[..., :n_cols]


def int4_panels(q: jax.Array, scales_mins: jax.Array) -> tuple[jax.Array, jax.Array]:
    """int4 bytes `[..., in / 2, out]` and scales-and-minimums `[..., in / g, 2, out]` as the int4
    kernel reads them: `[..., out / PANEL, in / 2, PANEL]` in `INT4_PANEL_ORDER`, and
    `[..., out / PANEL, in / g, 2, PANEL]` (a panel's group parameters one contiguous read).
    `out` must be a multiple of PANEL (`int4_panels_apply`)."""
    *lead, groups, two, n_out = scales_mins.shape
    sm = panels(scales_mins.reshape(*lead, groups * two, n_out))
    return panels(q)[..., INT4_PANEL_ORDER], sm.reshape(*sm.shape[:-2], groups, two, PANEL)


def int4_unpanels(q: jax.Array, scales_mins: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Inverse of `int4_panels`."""
    *lead, blocks, groups, two, width = scales_mins.shape
    n_out = blocks * width
    sm = unpanels(scales_mins.reshape(*lead, blocks, groups * two, width), n_out)
    q = unpanels(q[..., np.argsort(INT4_PANEL_ORDER)], n_out)
    return q, sm.reshape(*lead, groups, two, n_out)


def int4_panels_apply(n_out: int) -> bool:
    """Whether int4 weights of `n_out` columns have a panel layout (the kernel takes whole panels)."""
    return n_out % PANEL == 0


def supports(x_dtype: jnp.dtype, n_out: int) -> str | None:
    """None when the kernels serve float activations of `x_dtype` against panel-layout weights of
    `n_out` columns, else why not (a pure predicate on static facts)."""
    if x_dtype != jnp.float32:
        return f"the native quantized matmul takes float32 activations, not {jnp.dtype(x_dtype)}"
    if n_out % PANEL:
        return f"the native quantized matmul takes output sizes that are multiples of {PANEL}"
    return None


def _call(target: str, x: jax.Array, n_out: int, *weights: jax.Array) -> jax.Array:
    reason = supports(x.dtype, n_out)
    if reason is not None:
        raise ValueError(reason)
    require_native("matmul", "matmul='reference'")
    rows = x.size // x.shape[-1]
    y = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((rows, n_out), jnp.float32))(
        x.reshape(rows, x.shape[-1]), *weights
    )
    return y.reshape(*x.shape[:-1], n_out)


def int8_matmul(x: jax.Array, q_panels: jax.Array, scales: jax.Array) -> jax.Array:
    """`x @ (q * scales)` for int8 panels `[out / PANEL, in, PANEL]` and scales `[out]`."""
    return _call(TARGETS["int8"], x, scales.shape[-1], q_panels, scales)


def int4_matmul(x: jax.Array, q_panels: jax.Array, scales_mins_panels: jax.Array) -> jax.Array:
    """`x @ W` for int4 panels and their scales and minimums (`int4_panels`)."""
    n_out = scales_mins_panels.shape[-4] * PANEL
    return _call(TARGETS["int4"], x, n_out, q_panels, scales_mins_panels)
