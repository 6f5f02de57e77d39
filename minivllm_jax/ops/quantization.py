"""Quantization: the schemes, their pure-JAX references (every quantized matmul must equal
them), and the policy of which weights are quantized.

A quantized projection replaces `{"kernel": [in, out]}` in the per-layer params
(`models.llama.unstack_layers`) by arrays only, so it stays an ordinary pytree:

- int8, per output channel, symmetric: `{"qweight": int8 [in, out], "scales": f32 [out]}`,
  `w = qweight * scales`.
- int4, group-wise along `in` (the reduction axis; group size 32 by default, 64 or 128),
  asymmetric: `{"qweight4": uint8 [in / 2, out], "scales": f32 [in / g, out], "mins": f32
  [in / g, out]}`, `w = q * scale + min` with `q` in 0..15; byte `i` holds input rows `2i`
  (low nibble) and `2i + 1` (high nibble). Scale-and-minimum groups along `in` are GGUF's Q4_1
  blocks, so those (and Q4_0's, `min = -8 * scale`) map onto this layout exactly: "gguf" serves
  a GGUF's own blocks (`minivllm_jax.loading.gguf_source.read_int4_projections`). Q8_0 blocks (a scale per 32
  inputs) have no exact place in per-channel int8, so that mode refuses them.
- w8a8 (vLLM's INT8 W8A8): int8's weights, with int8 activations quantized per row on the fly:
  `{"qweight_a8": int8 [ceil(in / 4), 4 * out], "scales": f32 [out]}`, the weights packed for
  AVX-512 VNNI: element `(k, 4 o + j)` is input row `4 k + j` of column `o` (rows past `in` are
  zero), so 64 bytes are 16 columns x 4 inputs, one operand of `vpdpbusd`, and projections
  merged along `out` (`unstack_layers`) stay packed. The matmul (`w8a8_matmul_reference`) sums
  int8 x int8 in int32, exactly, so the native kernel gives the same numbers bit for bit; it
  pays where fp32 is bound by the float peak (prefill, big batches).

The arrays keep any leading axes: stored (stacked `[L, ...]`) params quantize the same as the
serving layout, and `minivllm-convert --quantize` writes them so (`quantized_shapes`).

Served, the weights are laid out for the native kernels (`serving_layout`, applied by
`models.llama.unstack_layers` after it merges projections): `qweight` / `qweight4` become
`qweight_panels` / `qweight4_panels`, `[ceil(out / 64), rows, 64]`: panels of 64 output columns,
each contiguous (zero columns pad the last; w8a8's `qweight_a8_panels` are `[ceil(out / 64),
ceil(in / 4), 256]`, 64 columns x 4 inputs a row), so a batch-1 matmul streams memory in order
instead of reading 64 bytes every `out` bytes (measured here: 2-3x the bandwidth of the
`[rows, out]` layout). int4 panels also order the bytes of each row so that the kernel's
nibble-to-bf16 step reaches them (`INT4_PANEL_ORDER`), and int4's scales and minimums become
panels beside them (`scales_mins_panels`, when `out` is a multiple of 64); int8's and w8a8's
scales stay as they are (their length is the true `out`). Every reader takes either layout
(`from_panels`).

Policy: the seven projections of every layer (q/k/v/o, gate/up/down; merged as the serving
layout merges them) are quantized by the scheme, and the output head by int8 per vocabulary
entry whatever the scheme, w8a8 included (as llama.cpp's 4-bit files keep it at 8 bits; it sees
one row per sequence, few next to a prefill's tokens, so weight-only suits it): the head is read
whole for every decode step (SmolLM2's tied embedding is 21% of its parameters, and after the
layers shrink most of the bytes per token). A tied embedding is stored once, as that head
(`{"qweight": int8 [hidden, vocab], "scales": f32 [vocab]}`), and the token lookup reads its
columns; an untied model's input embedding is only gathered (a few rows a step) and keeps the
model dtype, as do the norms and biases.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

QUANTIZATIONS = ("int8", "int4", "w8a8")
# What `LLM(quantization=...)` takes: a scheme applied to float weights, or "gguf": a GGUF
# model's own Q4_0/Q4_1 blocks served as int4 as they are (`with_int4_projections`).
LLM_QUANTIZATIONS = (*QUANTIZATIONS, "gguf")
# A quantized checkpoint's config.json records its scheme under this key: {"scheme", "group_size"}.
CHECKPOINT_KEY = "minivllm_quantization"
INT4_GROUP_SIZES = (32, 64, 128)


def quantize_int8(kernel: Any) -> dict[str, jax.Array]:
    """Symmetric per-output-channel int8 of a `[..., in, out]` kernel (round to nearest); leading
    axes (stacked layers) are kept."""
    w = np.asarray(kernel, np.float32)
    amax = np.abs(w).max(axis=-2)
    scales = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / scales[..., None, :]), -127, 127).astype(np.int8)
    return {"qweight": jnp.asarray(q), "scales": jnp.asarray(scales)}


def pack_vnni(q: np.ndarray) -> np.ndarray:
    """`[..., in, out]` int8 -> `[..., ceil(in / 4), 4 * out]`, the w8a8 layout (`in` padded with
    zero rows)."""
    *lead, n_in, n_out = q.shape
    pad = -n_in % 4
    q = np.pad(q, [(0, 0)] * len(lead) + [(0, pad), (0, 0)])
    q = q.reshape(*lead, (n_in + pad) // 4, 4, n_out)
    return np.ascontiguousarray(np.swapaxes(q, -1, -2)).reshape(*lead, (n_in + pad) // 4, 4 * n_out)


def unpack_vnni(packed: jax.Array) -> jax.Array:
    """Inverse of `pack_vnni` (traceable): `[in4, 4 * out]` -> `[4 * in4, out]`, the padding rows kept."""
    in4, n4 = packed.shape
    return jnp.swapaxes(packed.reshape(in4, n4 // 4, 4), -1, -2).reshape(4 * in4, n4 // 4)


def quantize_w8a8(kernel: Any) -> dict[str, jax.Array]:
    """int8's weights of a `[..., in, out]` kernel, packed for the w8a8 matmul (`pack_vnni`)."""
    p = quantize_int8(kernel)
    return {"qweight_a8": jnp.asarray(pack_vnni(np.asarray(p["qweight"]))), "scales": p["scales"]}


def pack_int4(q: np.ndarray) -> np.ndarray:
    """`[..., in, out]` values in 0..15 -> `[..., in / 2, out]` bytes (row 2i low nibble, 2i + 1 high)."""
    q = np.asarray(q, np.uint8)
    return (q[..., 0::2, :] | (q[..., 1::2, :] << 4)).astype(np.uint8)


def unpack_int4(packed: jax.Array) -> jax.Array:
    """Inverse of `pack_int4`: `[in / 2, out]` bytes -> `[in, out]` uint8 values 0..15."""
    low, high = packed & 0xF, packed >> 4
    return jnp.stack([low, high], axis=1).reshape(-1, packed.shape[-1])


def quantize_int4(kernel: Any, group_size: int = 32) -> dict[str, jax.Array]:
    """Asymmetric group-wise int4 of a `[..., in, out]` kernel: per group of `group_size` input
    rows and per output column, `min` and `scale = (max - min) / 15` (GGUF Q4_1's rule)."""
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group_size must be one of {INT4_GROUP_SIZES}, got {group_size}")
    w = np.asarray(kernel, np.float32)
    *lead, n_in, n_out = w.shape
    if n_in % group_size:
        raise ValueError(
            f"int4 needs the input size ({n_in}) to be a multiple of group_size ({group_size})"
        )
    g = w.reshape(*lead, n_in // group_size, group_size, n_out)
    lo, hi = g.min(axis=-2), g.max(axis=-2)
    scales = np.where(hi > lo, (hi - lo) / 15.0, 1.0).astype(np.float32)
    q = np.clip(np.rint((g - lo[..., None, :]) / scales[..., None, :]), 0, 15).reshape(w.shape)
    return {
        "qweight4": jnp.asarray(pack_int4(q)),
        "scales": jnp.asarray(scales),
        "mins": jnp.asarray(lo.astype(np.float32)),
    }


PANEL = 64  # output columns of one panel of the serving layout (the native matmul's work block)
# What `serving_layout` lays out as panels, and the array columns of one output column (w8a8
# keeps each column's 4 inputs side by side, so its panel rows are 4 * PANEL bytes).
_PANEL_KEYS = {"qweight": 1, "qweight4": 1, "qweight_a8": 4}
# Within an int4 panel row, byte 8j + 2k + e holds column 16k + 2j + e (j < 8, k < 4, e < 2):
# each 8-byte word then holds two columns of each 16-column vector, which is what the native
# kernel's vpmultishiftqb can spread into that vector's lanes (quantized_matmul.cc).
INT4_PANEL_ORDER = np.array([16 * (p % 8 // 2) + 2 * (p // 8) + p % 2 for p in range(PANEL)])


def _panels(w: jax.Array, width: int) -> jax.Array:
    """`[..., rows, cols]` -> `[..., ceil(cols / width), rows, width]`, the last zero-padded."""
    *lead, rows, n_cols = w.shape
    blocks = -(-n_cols // width)
    w = jnp.pad(w, [(0, 0)] * (w.ndim - 1) + [(0, blocks * width - n_cols)])
    return jnp.swapaxes(w.reshape(*lead, rows, blocks, width), -3, -2)


def _unpanels(panels: jax.Array, n_cols: int) -> jax.Array:
    *lead, blocks, rows, width = panels.shape
    return jnp.swapaxes(panels, -3, -2).reshape(*lead, rows, blocks * width)[..., :n_cols]


def to_panels(p: dict[str, Any]) -> dict[str, Any]:
    """A quantized projection with its `[..., rows, out]` weights as `[..., ceil(out / PANEL),
    rows, PANEL]` panels (the module docstring); anything else as it is. Traceable.

    int4 goes further, when `out` is a multiple of PANEL (else it stays as it is: the native
    kernel takes only such): its bytes in `INT4_PANEL_ORDER`, and its scales and minimums beside
    each other in panels too, `scales_mins_panels` `[..., out / PANEL, in / g, 2, PANEL]`, so a
    panel's group parameters are one contiguous read (strided rows of `[in / g, out]` left the
    int4 kernel waiting on memory: 33 -> 42 G weights/s on one core here)."""
    if "qweight4" in p:
        if p["scales"].shape[-1] % PANEL:
            return p
        scales_mins = jnp.stack(
            [_panels(jnp.asarray(p["scales"]), PANEL), _panels(jnp.asarray(p["mins"]), PANEL)], -2
        )
        rest = {k: v for k, v in p.items() if k not in ("qweight4", "scales", "mins")}
        return {
            "qweight4_panels": _panels(jnp.asarray(p["qweight4"]), PANEL)[..., INT4_PANEL_ORDER],
            "scales_mins_panels": scales_mins,
            **rest,
        }
    for key, per_column in _PANEL_KEYS.items():
        if key in p:
            rest = {k: v for k, v in p.items() if k != key}
            return {f"{key}_panels": _panels(jnp.asarray(p[key]), PANEL * per_column), **rest}
    return p


def from_panels(p: dict[str, Any]) -> dict[str, Any]:
    """Inverse of `to_panels` (traceable): the `[..., rows, out]` weights, padding dropped."""
    if "qweight4_panels" in p:
        sm = p["scales_mins_panels"]
        n_out = sm.shape[-4] * PANEL
        rest = {k: v for k, v in p.items() if k not in ("qweight4_panels", "scales_mins_panels")}
        return {
            "qweight4": _unpanels(p["qweight4_panels"][..., np.argsort(INT4_PANEL_ORDER)], n_out),
            "scales": _unpanels(sm[..., 0, :], n_out),
            "mins": _unpanels(sm[..., 1, :], n_out),
            **rest,
        }
    for key, per_column in _PANEL_KEYS.items():
        panels = p.get(f"{key}_panels")
        if panels is not None:
            rest = {k: v for k, v in p.items() if k != f"{key}_panels"}
            return {key: _unpanels(panels, p["scales"].shape[-1] * per_column), **rest}
    return p


def output_size(p: dict[str, Any]) -> int:
    """The `out` of a quantized projection, in either layout."""
    if "scales_mins_panels" in p:
        return p["scales_mins_panels"].shape[-4] * PANEL
    return p["scales"].shape[-1]


def serving_layout(params: dict[str, Any]) -> dict[str, Any]:
    """Per-layer params (`unstack_layers`) with every quantized projection and a quantized head
    laid out as panels (`to_panels`)."""

    def layer(lp: dict[str, Any]) -> dict[str, Any]:
        return {name: to_panels(v) if is_quantized(v) else v for name, v in lp.items()}

    out = {**params, "layers": tuple(map(layer, params["layers"]))}
    for name in ("lm_head", "embed_tokens"):
        if is_quantized(out.get(name)):
            out[name] = to_panels(out[name])
    return out


def is_quantized(p: Any) -> bool:
    return isinstance(p, dict) and any(key.startswith("qweight") for key in p)


def dequantize(p: dict[str, jax.Array], dtype: Any = jnp.float32) -> jax.Array:
    """The `[in, out]` kernel a quantized projection stands for (pure JAX, traceable; w8a8's
    with `in` padded to a multiple of 4 by zero rows)."""
    p = from_panels(p)
    if "qweight_a8" in p:
        return (unpack_vnni(p["qweight_a8"]).astype(jnp.float32) * p["scales"]).astype(dtype)
    if "qweight" in p:
        return (p["qweight"].astype(jnp.float32) * p["scales"]).astype(dtype)
    q = unpack_int4(p["qweight4"]).astype(jnp.float32)
    groups, n_out = p["scales"].shape
    w = q.reshape(groups, -1, n_out) * p["scales"][:, None] + p["mins"][:, None]
    return w.reshape(-1, n_out).astype(dtype)


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """w8a8's activations: `[T, in]` float -> int8 `[T, in]` and f32 scales `[T, 1]`, symmetric per
    row: `s = max|x| * f32(1 / 127)` (1 for a zero row), `q = round_half_even(x * (1 / s))`.
    Multiplications by reciprocals, as XLA rewrites divisions by a constant or a broadcast (for
    some shapes and not others), so that the numbers are these whatever XLA does and a kernel
    can give them bit for bit."""
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    s = jnp.where(amax > 0, amax * np.float32(1 / 127), np.float32(1))
    return jnp.clip(jnp.round(x * (1 / s)), -127, 127).astype(jnp.int8), s


def w8a8_matmul_reference(x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
    """`x @ W` the w8a8 way: rows of `x` quantized (`quantize_rows`), an exact int8 x int8 -> int32
    dot against the packed weights, then `(float(acc) * s_row) * s_column`."""
    p = from_panels(p)
    in4, n4 = p["qweight_a8"].shape
    n_in, n_out = x.shape[-1], n4 // 4
    q, s = quantize_rows(x.reshape(-1, n_in))
    q = jnp.pad(q, ((0, 0), (0, 4 * in4 - n_in))).reshape(-1, in4, 4)
    acc = jax.lax.dot_general(
        q,
        p["qweight_a8"].reshape(in4, n_out, 4),
        (((1, 2), (0, 2)), ((), ())),
        preferred_element_type=jnp.int32,
    )
    y = acc.astype(jnp.float32) * s * p["scales"]
    return y.reshape(*x.shape[:-1], n_out).astype(x.dtype)


def quantized_matmul_reference(x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
    """`x @ W` for a quantized projection `p`: the contract every quantized matmul keeps (weight-only
    schemes: `x @ dequantize(p)`; w8a8: `w8a8_matmul_reference`). A float projection is `x @ kernel`."""
    if not is_quantized(p):
        return x @ p["kernel"]
    if "qweight_a8" in p or "qweight_a8_panels" in p:
        return w8a8_matmul_reference(x, p)
    return x @ dequantize(p, x.dtype)


def _native_matmul(x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
    # these load a shared library
    from minivllm_jax.kernels.float_matmul import float_matmul_native
    from minivllm_jax.kernels.quantized_matmul import quantized_matmul_native
    from minivllm_jax.kernels.w8a8_matmul import w8a8_matmul_native

    if not is_quantized(p):
        return float_matmul_native(x, p["kernel"])
    w8a8 = "qweight_a8" in p or "qweight_a8_panels" in p
    return w8a8_matmul_native(x, p) if w8a8 else quantized_matmul_native(x, p)


# Implementations by name: a static argument of the step (`models.llama.forward(matmul=...)`).
MATMUL = {"reference": quantized_matmul_reference, "native": _native_matmul}


def quantize_projection(p: dict[str, Any], scheme: str, group_size: int = 32) -> dict[str, Any]:
    """One projection (`{"kernel", "bias"?}`) with its kernel replaced by `scheme`'s arrays."""
    rest = {k: v for k, v in p.items() if k != "kernel"}
    if scheme == "int8":
        return {**quantize_int8(p["kernel"]), **rest}
    if scheme == "int4":
        return {**quantize_int4(p["kernel"], group_size), **rest}
    if scheme == "w8a8":
        return {**quantize_w8a8(p["kernel"]), **rest}
    raise ValueError(f"unknown quantization {scheme!r}; use one of {QUANTIZATIONS} or None")


def quantize_head(params: dict[str, Any]) -> dict[str, Any]:
    """The output head as int8 per vocabulary entry (the module's policy): `lm_head`, or for a
    tied model (no `lm_head`) the embedding, stored transposed as that head."""
    if "lm_head" in params:
        return {**params, "lm_head": quantize_int8(params["lm_head"])}
    return {
        **params,
        "embed_tokens": quantize_int8(np.asarray(params["embed_tokens"], np.float32).T),
    }


def lookup_embedding(table: Any, tokens: jax.Array, dtype: Any) -> jax.Array:
    """Rows of the embedding for `tokens`: a float `[vocab, hidden]` table, or a tied embedding
    quantized as the head (`quantize_head`), whose columns are the tokens' rows."""
    if not isinstance(table, dict):
        return table[tokens]
    if (
        "qweight_panels" in table
    ):  # the serving layout: token t is lane t % PANEL of panel t // PANEL
        q = table["qweight_panels"][tokens // PANEL, :, tokens % PANEL]
    else:
        q = table["qweight"][:, tokens].T
    return (q.astype(jnp.float32) * table["scales"][tokens][:, None]).astype(dtype)


def quantize_params(
    params: dict[str, Any], scheme: str | None, group_size: int = 32
) -> dict[str, Any]:
    """Params with every layer's projections quantized (the module's policy), stacked (as
    stored: `[L, in, out]` kernels) or in the serving layout (`unstack_layers`): the schemes
    work per output column and per group of input rows, so both give the same numbers.
    `scheme=None` returns them as they are. The full-precision kernels are not kept."""
    if scheme is None:
        return params
    if scheme not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {scheme!r}; use one of {QUANTIZATIONS} or None")

    def layer(lp: dict[str, Any]) -> dict[str, Any]:
        return {
            name: quantize_projection(v, scheme, group_size)
            if isinstance(v, dict) and "kernel" in v
            else v
            for name, v in lp.items()
        }

    layers = params["layers"]
    return quantize_head(
        {
            **params,
            "layers": layer(layers) if isinstance(layers, dict) else tuple(map(layer, layers)),
        }
    )


def quantized_shapes(
    params_shapes: dict[str, Any], scheme: str, group_size: int = 32
) -> dict[str, Any]:
    """The abstract tree (`ShapeDtypeStruct` leaves) of stacked params quantized by `scheme`
    ("gguf" has int4's layout, in groups of 32): what a quantized checkpoint restores against."""
    int4 = scheme in ("int4", "gguf")
    group = 32 if scheme == "gguf" else group_size

    def projection(p: dict[str, Any]) -> dict[str, Any]:
        *lead, n_in, n_out = p["kernel"].shape
        sds = lambda dtype, *shape: jax.ShapeDtypeStruct((*lead, *shape), dtype)  # noqa: E731
        rest = {k: v for k, v in p.items() if k != "kernel"}
        if scheme == "w8a8":
            return {
                "qweight_a8": sds(jnp.int8, -(-n_in // 4), 4 * n_out),
                "scales": sds(jnp.float32, n_out),
                **rest,
            }
        if not int4:
            return {
                "qweight": sds(jnp.int8, n_in, n_out),
                "scales": sds(jnp.float32, n_out),
                **rest,
            }
        return {
            "qweight4": sds(jnp.uint8, n_in // 2, n_out),
            "scales": sds(jnp.float32, n_in // group, n_out),
            "mins": sds(jnp.float32, n_in // group, n_out),
            **rest,
        }

    layers = {
        name: projection(v) if isinstance(v, dict) and "kernel" in v else v
        for name, v in params_shapes["layers"].items()
    }
    head_name = "lm_head" if "lm_head" in params_shapes else "embed_tokens"
    n_vocab = params_shapes[head_name].shape[-1 if head_name == "lm_head" else 0]
    n_hidden = params_shapes["norm"].shape[0]
    head = {
        "qweight": jax.ShapeDtypeStruct((n_hidden, n_vocab), jnp.int8),
        "scales": jax.ShapeDtypeStruct((n_vocab,), jnp.float32),
    }
    return {**params_shapes, "layers": layers, head_name: head}


def with_int4_projections(
    params: dict[str, Any], projections: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """Stacked params (before `unstack_layers`) with each named projection's float kernel
    replaced by given int4 arrays stacked over layers (`minivllm_jax.loading.gguf_source.read_int4_projections`:
    a GGUF's own 4-bit blocks, so nothing is quantized twice). Every projection must be given,
    with the shapes its kernel implies."""
    layers = params["layers"]
    if not isinstance(layers, dict):
        raise ValueError(
            "with_int4_projections takes stacked params (before models.llama.unstack_layers)"
        )
    new_layers = dict(layers)
    for name, proj in layers.items():
        if not (isinstance(proj, dict) and "kernel" in proj):
            continue
        if name not in projections:
            raise ValueError(f"no int4 weights given for {name}")
        n_layers, n_in, n_out = proj["kernel"].shape
        given = projections[name]
        if given["qweight4"].shape != (n_layers, n_in // 2, n_out) or given["scales"].shape[
            ::2
        ] != (n_layers, n_out):
            raise ValueError(
                f"int4 weights of {name} have shape {given['qweight4'].shape}, want "
                f"{(n_layers, n_in // 2, n_out)}"
            )
        new_layers[name] = {
            **{k: jnp.asarray(v) for k, v in given.items()},
            **{k: v for k, v in proj.items() if k != "kernel"},
        }
    return {**params, "layers": new_layers}


def param_bytes(params: Any) -> int:
    """Bytes held by a params tree (what quantization shrinks)."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
