"""Quantization: the schemes as weight types, their pure-JAX references (every quantized matmul
must equal them), and the policy of which weights are quantized.

A quantized projection keeps its place in the params tree, `{"kernel": W, "bias"?: b}`, with
`W` one of the weight types below instead of a float `[in, out]` array. They are registered
pytree dataclasses: the arrays are leaves, the `layout` a static field, so a matmul
(`minivllm_jax.ops.matmul.matmul`) dispatches on the weight's type and layout at trace time.

- `Int8Weight`, per output channel, symmetric: `q` int8 `[in, out]`, `scales` f32 `[out]`,
  `w = q * scales`.
- `Int4Weight`, group-wise along `in` (the reduction axis; group size 32 by default, 64 or 128),
  asymmetric: `q` uint8 `[in / 2, out]`, `scales_mins` f32 `[in / g, 2, out]` (per group and
  column the scale, then the minimum), `w = q * scale + min` with `q` in 0..15; byte `i` holds
  input rows `2i` (low nibble) and `2i + 1` (high nibble). Scale-and-minimum groups along `in`
  are GGUF's Q4_1 blocks, so those (and Q4_0's, `min = -8 * scale`) map onto this layout
  exactly: "gguf" serves a GGUF's own blocks (`minivllm_jax.loading.gguf_source`). Q8_0 blocks
  (a scale per 32 inputs) have no exact place in per-channel int8, so that mode refuses them.
- `W8A8Weight` (vLLM's INT8 W8A8): int8's weights, with int8 activations quantized per row on
  the fly: `q` int8 `[ceil(in / 4), 4 * out]`, `scales` f32 `[out]`, the weights packed for
  AVX-512 VNNI: element `(k, 4 o + j)` is input row `4 k + j` of column `o` (rows past `in` are
  zero), so 64 bytes are 16 columns x 4 inputs, one operand of `vpdpbusd`, and projections
  merged along `out` stay packed. The matmul (`w8a8_matmul_reference`) sums int8 x int8 in
  int32, exactly, so the native kernel gives the same numbers bit for bit; it pays where fp32 is
  bound by the float peak (prefill, big batches).

Every array keeps any leading axes: stored (stacked `[L, ...]`) params quantize the same as the
serving layout, and `minivllm-convert --quantize` writes them so (`quantized_shapes`; the names
on disk are `minivllm_jax.loading.checkpoint`'s).

Served, the weights are laid out for the native kernels (`to_panels`, applied by
`serving_layout` once projections are merged): `layout="panels"`, the layout each kernel module
owns (`minivllm_jax.kernels.quantized_matmul.panels`, `w8a8_matmul.to_panels`), so a batch-1
matmul streams memory in order. int4 weights whose `out` is not a multiple of the panel width
stay `"plain"` (the kernel takes only whole panels). Every reader takes either layout
(`from_panels`).

Policy: the seven projections of every layer (q/k/v/o, gate/up/down; merged as the serving
layout merges them) are quantized by the scheme, and the output head by int8 per vocabulary
entry whatever the scheme, w8a8 included (as llama.cpp's 4-bit files keep it at 8 bits; it sees
one row per sequence, few next to a prefill's tokens, so weight-only suits it): the head is read
whole for every decode step (SmolLM2's tied embedding is 21% of its parameters, and after the
layers shrink most of the bytes per token). A tied embedding is stored once, as that head
(an `Int8Weight` `[hidden, vocab]`), and the token lookup reads its columns; an untied model's
input embedding is only gathered (a few rows a step) and keeps the model dtype, as do the norms
and biases.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from minivllm_jax.kernels import quantized_matmul, w8a8_matmul
from minivllm_jax.kernels.quantized_matmul import PANEL

QUANTIZATIONS = ("int8", "int4", "w8a8")
# What `LLM(quantization=...)` takes: a scheme applied to float weights, or "gguf": a GGUF
# model's own Q4_0/Q4_1 blocks served as int4 as they are (`with_int4_projections`).
LLM_QUANTIZATIONS = (*QUANTIZATIONS, "gguf")
# A quantized checkpoint's config.json records its scheme under this key: {"scheme", "group_size"}.
CHECKPOINT_KEY = "minivllm_quantization"
INT4_GROUP_SIZES = (32, 64, 128)
LAYOUTS = ("plain", "panels")  # `[..., rows, out]` as quantized, or the native kernels' panels


def _layout_field() -> Any:
    return dataclasses.field(default="plain", metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int8Weight:
    """Per-output-channel int8: `q` `[..., in, out]` ("plain") or its panels, `scales` `[..., out]`."""

    q: Any
    scales: Any
    layout: str = _layout_field()

    @property
    def n_out(self) -> int:
        return self.scales.shape[-1]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int4Weight:
    """Group-wise int4: `q` `[..., in / 2, out]` bytes and `scales_mins` `[..., in / g, 2, out]`
    ("plain"), or both as the int4 kernel's panels (`kernels.quantized_matmul.int4_panels`)."""

    q: Any
    scales_mins: Any
    layout: str = _layout_field()

    @property
    def n_out(self) -> int:
        if self.layout == "panels":
            return self.scales_mins.shape[-4] * PANEL
        return self.scales_mins.shape[-1]

    @property
    def group_size(self) -> int:
        return 2 * self.q.shape[-2] // self.scales_mins.shape[-3]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class W8A8Weight:
    """int8 weights for int8 activations: `q` VNNI-packed `[..., ceil(in / 4), 4 * out]` ("plain")
    or its panels (`kernels.w8a8_matmul.to_panels`), `scales` `[..., out]`."""

    q: Any
    scales: Any
    layout: str = _layout_field()

    @property
    def n_out(self) -> int:
        return self.scales.shape[-1]


QuantizedWeight = Int8Weight | Int4Weight | W8A8Weight
# The scheme each weight type implements (what a checkpoint's config.json records).
SCHEMES = {Int8Weight: "int8", Int4Weight: "int4", W8A8Weight: "w8a8"}


def is_quantized(w: Any) -> bool:
    """`w` is a quantized weight (not a float array)."""
    return isinstance(w, (Int8Weight, Int4Weight, W8A8Weight))


def quantize_int8(kernel: Any) -> Int8Weight:
    """Symmetric per-output-channel int8 of a `[..., in, out]` kernel (round to nearest); leading
    axes (stacked layers) are kept."""
    w = np.asarray(kernel, np.float32)
    amax = np.abs(w).max(axis=-2)
    scales = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / scales[..., None, :]), -127, 127).astype(np.int8)
    return Int8Weight(jnp.asarray(q), jnp.asarray(scales))


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


def quantize_w8a8(kernel: Any) -> W8A8Weight:
    """int8's weights of a `[..., in, out]` kernel, packed for the w8a8 matmul (`pack_vnni`)."""
    w = quantize_int8(kernel)
    return W8A8Weight(jnp.asarray(pack_vnni(np.asarray(w.q))), w.scales)


def pack_int4(q: np.ndarray) -> np.ndarray:
    """`[..., in, out]` values in 0..15 -> `[..., in / 2, out]` bytes (row 2i low nibble, 2i + 1 high)."""
    q = np.asarray(q, np.uint8)
    return (q[..., 0::2, :] | (q[..., 1::2, :] << 4)).astype(np.uint8)


def unpack_int4(packed: jax.Array) -> jax.Array:
    """Inverse of `pack_int4`: `[in / 2, out]` bytes -> `[in, out]` uint8 values 0..15."""
    low, high = packed & 0xF, packed >> 4
    return jnp.stack([low, high], axis=1).reshape(-1, packed.shape[-1])


def int4_weight(q: Any, scales: Any, mins: Any) -> Int4Weight:
    """An `Int4Weight` from packed bytes and separate scales and minimums `[..., in / g, out]`."""
    return Int4Weight(jnp.asarray(q), jnp.stack([jnp.asarray(scales), jnp.asarray(mins)], -2))


def quantize_int4(kernel: Any, group_size: int = 32) -> Int4Weight:
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
    return int4_weight(pack_int4(q), scales, lo.astype(np.float32))


def to_panels(w: QuantizedWeight) -> QuantizedWeight:
    """`w` in the native kernels' panel layout (the module docstring); int4 whose `out` is not a
    multiple of the panel width stays plain. Traceable."""
    if w.layout == "panels":
        return w
    if isinstance(w, Int4Weight):
        if not quantized_matmul.int4_panels_apply(w.n_out):
            return w
        return Int4Weight(*quantized_matmul.int4_panels(w.q, w.scales_mins), layout="panels")
    if isinstance(w, W8A8Weight):
        return W8A8Weight(w8a8_matmul.to_panels(w.q), w.scales, layout="panels")
    return Int8Weight(quantized_matmul.panels(w.q), w.scales, layout="panels")


def from_panels(w: QuantizedWeight) -> QuantizedWeight:
    """Inverse of `to_panels` (traceable): `w` in the plain layout, padding dropped."""
    if w.layout == "plain":
        return w
    if isinstance(w, Int4Weight):
        return Int4Weight(*quantized_matmul.int4_unpanels(w.q, w.scales_mins))
    if isinstance(w, W8A8Weight):
        return W8A8Weight(w8a8_matmul.from_panels(w.q, w.n_out), w.scales)
    return Int8Weight(quantized_matmul.unpanels(w.q, w.n_out), w.scales)


def serving_layout(params: dict[str, Any]) -> dict[str, Any]:
    """Per-layer params (`unstack_layers`) with every quantized projection and a quantized head
    laid out as panels (`to_panels`)."""

    def projection(p: Any) -> Any:
        if isinstance(p, dict) and is_quantized(p.get("kernel")):
            return {**p, "kernel": to_panels(p["kernel"])}
        return p

    layers = tuple({name: projection(v) for name, v in lp.items()} for lp in params["layers"])
    out = {**params, "layers": layers}
    for name in ("lm_head", "embed_tokens"):
        if is_quantized(out.get(name)):
            out[name] = to_panels(out[name])
    return out


def dequantize(w: QuantizedWeight, dtype: Any = jnp.float32) -> jax.Array:
    """The `[in, out]` kernel a quantized weight stands for (pure JAX, traceable; w8a8's with
    `in` padded to a multiple of 4 by zero rows)."""
    w = from_panels(w)
    if isinstance(w, W8A8Weight):
        return (unpack_vnni(w.q).astype(jnp.float32) * w.scales).astype(dtype)
    if isinstance(w, Int8Weight):
        return (w.q.astype(jnp.float32) * w.scales).astype(dtype)
    q = unpack_int4(w.q).astype(jnp.float32)
    groups, _, n_out = w.scales_mins.shape
    scales, mins = w.scales_mins[:, 0], w.scales_mins[:, 1]
    return (
        (q.reshape(groups, -1, n_out) * scales[:, None] + mins[:, None])
        .reshape(-1, n_out)
        .astype(dtype)
    )


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


def w8a8_matmul_reference(x: jax.Array, w: W8A8Weight) -> jax.Array:
    """`x @ W` the w8a8 way: rows of `x` quantized (`quantize_rows`), an exact int8 x int8 -> int32
    dot against the packed weights, then `(float(acc) * s_row) * s_column`."""
    w = from_panels(w)
    in4, n4 = w.q.shape
    n_in, n_out = x.shape[-1], n4 // 4
    q, s = quantize_rows(x.reshape(-1, n_in))
    q = jnp.pad(q, ((0, 0), (0, 4 * in4 - n_in))).reshape(-1, in4, 4)
    acc = jax.lax.dot_general(
        q,
        w.q.reshape(in4, n_out, 4),
        (((1, 2), (0, 2)), ((), ())),
        preferred_element_type=jnp.int32,
    )
    y = acc.astype(jnp.float32) * s * w.scales
    return y.reshape(*x.shape[:-1], n_out).astype(x.dtype)


def quantized_matmul_reference(x: jax.Array, w: Any) -> jax.Array:
    """`x @ W` for a weight `w`: the contract every matmul keeps (a float `[in, out]` array:
    `x @ w`; weight-only schemes: `x @ dequantize(w)`; w8a8: `w8a8_matmul_reference`)."""
    if isinstance(w, W8A8Weight):
        return w8a8_matmul_reference(x, w)
    if is_quantized(w):
        return x @ dequantize(w, x.dtype)
    return x @ w


def quantize_weight(kernel: Any, scheme: str, group_size: int = 32) -> QuantizedWeight:
    """A float `[..., in, out]` kernel as `scheme`'s weight."""
    if scheme == "int8":
        return quantize_int8(kernel)
    if scheme == "int4":
        return quantize_int4(kernel, group_size)
    if scheme == "w8a8":
        return quantize_w8a8(kernel)
    raise ValueError(f"unknown quantization {scheme!r}; use one of {QUANTIZATIONS} or None")


def quantize_projection(p: dict[str, Any], scheme: str, group_size: int = 32) -> dict[str, Any]:
    """One projection (`{"kernel", "bias"?}`) with its kernel replaced by `scheme`'s weight."""
    return {**p, "kernel": quantize_weight(p["kernel"], scheme, group_size)}


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
    if not isinstance(table, Int8Weight):
        return table[tokens]
    if table.layout == "panels":  # token t is lane t % PANEL of panel t // PANEL
        q = table.q[tokens // PANEL, :, tokens % PANEL]
    else:
        q = table.q[:, tokens].T
    return (q.astype(jnp.float32) * table.scales[tokens][:, None]).astype(dtype)


def quantize_params(
    params: dict[str, Any], scheme: str | None, group_size: int = 32
) -> dict[str, Any]:
    """Params with every layer's projections quantized (the module's policy), stacked (as
    stored: `[L, in, out]` kernels) or per layer: the schemes work per output column and per
    group of input rows, so both give the same numbers. `scheme=None` returns them as they are.
    The full-precision kernels are not kept."""
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

    def weight(kernel: jax.ShapeDtypeStruct) -> QuantizedWeight:
        *lead, n_in, n_out = kernel.shape
        sds = lambda dtype, *shape: jax.ShapeDtypeStruct((*lead, *shape), dtype)  # noqa: E731
        if scheme == "w8a8":
            return W8A8Weight(sds(jnp.int8, -(-n_in // 4), 4 * n_out), sds(jnp.float32, n_out))
        if not int4:
            return Int8Weight(sds(jnp.int8, n_in, n_out), sds(jnp.float32, n_out))
        return Int4Weight(
            sds(jnp.uint8, n_in // 2, n_out), sds(jnp.float32, n_in // group, 2, n_out)
        )

    layers = {
        name: {**v, "kernel": weight(v["kernel"])} if isinstance(v, dict) and "kernel" in v else v
        for name, v in params_shapes["layers"].items()
    }
    head_name = "lm_head" if "lm_head" in params_shapes else "embed_tokens"
    n_vocab = params_shapes[head_name].shape[-1 if head_name == "lm_head" else 0]
    n_hidden = params_shapes["norm"].shape[0]
    head = Int8Weight(
        jax.ShapeDtypeStruct((n_hidden, n_vocab), jnp.int8),
        jax.ShapeDtypeStruct((n_vocab,), jnp.float32),
    )
    return {**params_shapes, "layers": layers, head_name: head}


def with_int4_projections(
    params: dict[str, Any], projections: dict[str, Int4Weight]
) -> dict[str, Any]:
    """Stacked params with each named projection's float kernel replaced by the given int4
    weight stacked over layers (`minivllm_jax.loading.gguf_source.read_int4_projections`: a
    GGUF's own 4-bit blocks, so nothing is quantized twice). Every projection must be given,
    with the shapes its kernel implies."""
    layers = params["layers"]
    if not isinstance(layers, dict):
        raise ValueError(
            "with_int4_projections takes stacked params (as stored, one array a weight)"
        )
    new_layers = dict(layers)
    for name, proj in layers.items():
        if not (isinstance(proj, dict) and "kernel" in proj):
            continue
        if name not in projections:
            raise ValueError(f"no int4 weights given for {name}")
        n_layers, n_in, n_out = proj["kernel"].shape
        given = projections[name]
        if given.q.shape != (n_layers, n_in // 2, n_out) or given.scales_mins.shape[::3] != (
            n_layers,
            n_out,
        ):
            raise ValueError(
                f"int4 weights of {name} have shape {given.q.shape}, want "
                f"{(n_layers, n_in // 2, n_out)}"
            )
        new_layers[name] = {**proj, "kernel": jax.tree.map(jnp.asarray, given)}
    return {**params, "layers": new_layers}


def param_bytes(params: Any) -> int:
    """Bytes held by a params tree (what quantization shrinks)."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
