"""The decoder every model family runs (`models/registry.py`), as pure functions over a params
pytree and a paged KV cache: Llama's math, plus what other families change in it as static
`ModelConfig` fields (q/k/v biases, q/k norms, Gemma's norms and embedding scale, GeGLU, sliding
windows, soft-capping, per-layer RoPE bases). Each is a Python-level branch: a Llama program
contains none of them. This module is also the Llama family itself (`FAMILY`).

params = {
  "embed_tokens": [vocab, hidden],
  "layers": {                               # stacked over layers (leading axis L)
    "input_layernorm": [L, hidden], "post_attention_layernorm": [L, hidden],
    "pre_feedforward_layernorm"? / "post_feedforward_layernorm"?: [L, hidden],   # sandwich_norms
    "q_norm"? / "k_norm"?: [L, hd],                                              # qk_norm
    "q_proj": {"kernel": [L, hidden, heads*hd], "bias"?: [L, heads*hd]},  # bias: attention_bias or qkv_bias
    "k_proj" / "v_proj": {"kernel": [L, hidden, kv_heads*hd], "bias"?: [L, kv_heads*hd]},
    "o_proj": {"kernel": [L, heads*hd, hidden], "bias"?: [L, hidden]},
    "gate_proj" / "up_proj": {"kernel": [L, hidden, inter], "bias"?: [L, inter]},
    "down_proj": {"kernel": [L, inter, hidden], "bias"?: [L, hidden]},
  },
  "norm": [hidden],
  "lm_head"?: [hidden, vocab],              # absent when embeddings are tied
}
(Quantized models replace projection kernels and the head by the arrays of
`minivllm_jax.ops.quantization`.)
Kernels are `[in, out]` (HF's `[out, in]` transposed). Numerics follow HF's modeling_llama:
RMSNorm in float32 then cast back before the weight, rotate-half RoPE, softmax in float32.

That stacked tree is how weights are stored and converted. `forward` reads them per layer:
`unstack_layers(params)` turns "layers" into a tuple of per-layer trees (q/k/v and gate/up
merged), once, at load. Inside the layer loop each layer's matmuls run in that layer's branch
of a `lax.switch`, which reads its weights in place; slicing layer `i` out of a stacked array
inside the loop makes XLA copy every weight once per step (measured here: about half of a
batch-1 decode step).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from minivllm_jax.config import ModelConfig, check_activation, decoder_fields
from minivllm_jax.kernels.float_matmul import float_matmul_transposed_native
from minivllm_jax.models.registry import ModelFamily, layer_weight_names
from minivllm_jax.ops.attention import ATTENTION_WITH_EXTRAS, AttentionFn, get_attention
from minivllm_jax.ops.batch import StepBatch
from minivllm_jax.ops.kv_cache import KVCache, write_kv
from minivllm_jax.ops.quantization import MATMUL, is_quantized, lookup_embedding, serving_layout

Params = dict[str, Any]

_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")

# HF activation names -> the function; gelu_pytorch_tanh is GELU's tanh approximation.
ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "silu": jax.nn.silu,
    "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True),
}


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """Llama's `ModelConfig` from its HF config dict."""
    check_activation(hf, ("silu",))
    return ModelConfig(
        **decoder_fields(hf),
        attention_bias=bool(hf.get("attention_bias", False)),
        mlp_bias=bool(hf.get("mlp_bias", False)),
    )


def _has_bias(cfg: ModelConfig, name: str) -> bool:
    if name in _MLP:
        return cfg.mlp_bias
    return cfg.attention_bias or (cfg.qkv_bias and name != "o_proj")


def _proj_dims(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    d, q, kv, f = (
        cfg.hidden_size,
        cfg.num_heads * cfg.head_dim,
        cfg.num_kv_heads * cfg.head_dim,
        cfg.intermediate_size,
    )
    return {
        "q_proj": (d, q),
        "k_proj": (d, kv),
        "v_proj": (d, kv),
        "o_proj": (q, d),
        "gate_proj": (d, f),
        "up_proj": (d, f),
        "down_proj": (f, d),
    }


def param_shapes(cfg: ModelConfig, dtype: Any = jnp.float32) -> Params:
    """The abstract params tree (`ShapeDtypeStruct` leaves): drives init, conversion checks and restore."""
    L, d = cfg.num_layers, cfg.hidden_size
    sds = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))  # noqa: E731
    layers: dict[str, Any] = {"input_layernorm": sds(L, d), "post_attention_layernorm": sds(L, d)}
    if cfg.sandwich_norms:
        layers["pre_feedforward_layernorm"] = layers["post_feedforward_layernorm"] = sds(L, d)
    if cfg.qk_norm:
        layers["q_norm"] = layers["k_norm"] = sds(L, cfg.head_dim)
    for name, (din, dout) in _proj_dims(cfg).items():
        layers[name] = {"kernel": sds(L, din, dout)}
        if _has_bias(cfg, name):
            layers[name]["bias"] = sds(L, dout)
    params: Params = {"embed_tokens": sds(cfg.vocab_size, d), "layers": layers, "norm": sds(d)}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = sds(d, cfg.vocab_size)
    return params


def hf_weight_map(cfg: ModelConfig) -> dict[str, tuple[tuple[str, ...], int | None, bool]]:
    """HF tensor name -> (path in our tree, layer index or None, transpose?). The strict conversion table."""
    table: dict[str, tuple[tuple[str, ...], int | None, bool]] = {
        "model.embed_tokens.weight": (("embed_tokens",), None, False),
        "model.norm.weight": (("norm",), None, False),
    }
    if not cfg.tie_word_embeddings:
        table["lm_head.weight"] = (("lm_head",), None, True)
    shapes = param_shapes(cfg)["layers"]
    modules = layer_weight_names(cfg)  # the norms' HF names, the family's own included
    norms = [key for key, leaf in shapes.items() if not isinstance(leaf, dict)]
    unnamed = [key for key in norms if key not in modules]
    if unnamed:
        raise ValueError(f"family {cfg.family!r} gives no HF name for the layer weights {unnamed}")
    for i in range(cfg.num_layers):
        pre = f"model.layers.{i}."
        for key in norms:
            table[f"{pre}{modules[key]}.weight"] = (("layers", key), i, False)
        for name in _ATTN + _MLP:
            module = ("self_attn." if name in _ATTN else "mlp.") + name
            table[f"{pre}{module}.weight"] = (("layers", name, "kernel"), i, True)
            if "bias" in shapes[name]:
                table[f"{pre}{module}.bias"] = (("layers", name, "bias"), i, False)
    return table


def init_params(
    cfg: ModelConfig, key: jax.Array, dtype: Any = jnp.float32, scale: float = 0.02
) -> Params:
    """Random params with the right tree (tests and benchmarks; real weights come from convert/)."""
    shapes = param_shapes(cfg, dtype)
    leaves, treedef = jax.tree.flatten(shapes)
    keys = jax.random.split(key, len(leaves))
    return jax.tree.unflatten(
        treedef,
        [
            (scale * jax.random.normal(k, s.shape, jnp.float32)).astype(s.dtype)
            for k, s in zip(keys, leaves)
        ],
    )


def model_dtype(params: Params) -> jnp.dtype:
    """The model's float dtype (activations, KV cache): the final norm's, which no
    quantization changes (the first leaf may be a quantized embedding)."""
    return params["norm"].dtype


_MERGED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def unstack_layers(params: Params) -> Params:
    """`params` in the layout `forward` reads: "layers" a tuple of per-layer trees (see the
    module docstring), with the projections that read the same input merged into one matmul
    ("qkv_proj", "gate_up_proj": one bigger batch-1 dot ran about 1.3x faster here than two or
    three small ones). Already unstacked params come back as they are. The weights are copied:
    drop the stacked params afterwards so they are held once."""
    layers = params["layers"]
    if not isinstance(layers, dict):
        return params

    def layer(i: int) -> Params:
        lp = dict(jax.tree.map(lambda a: a[i], layers))
        for name, parts in _MERGED.items():
            projections = [lp.pop(part) for part in parts]
            lp[name] = {
                key: jnp.concatenate([p[key] for p in projections], axis=-1)
                for key in projections[0]
            }
        return lp

    # Quantized weights are laid out for the native matmul once merged (`serving_layout`).
    return serving_layout(
        {**params, "layers": tuple(layer(i) for i in range(jax.tree.leaves(layers)[0].shape[0]))}
    )


# ----------------------------------------------------------------------------------------- math


def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> np.ndarray:
    """Inverse frequencies (float32), with HF's `linear` and `llama3` scaling rules; `local`:
    those of the sliding-window layers when they have their own base (`cfg.local_rope_theta`)."""
    if local:
        cfg = dataclasses.replace(cfg, rope_theta=cfg.local_rope_theta, rope_scaling=None)
    dim = cfg.head_dim
    inv_freq = 1.0 / (
        cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim)
    )
    if cfg.rope_scaling is None:
        return inv_freq.astype(np.float32)
    kind, p = cfg.rope_scaling[0], cfg.rope_scaling_dict
    if kind == "linear":
        return (inv_freq / p["factor"]).astype(np.float32)
    # llama3: keep high frequencies, divide low ones by `factor`, interpolate in between.
    factor, lo, hi = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_ctx = p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / lo, old_ctx / hi
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """HF's RMSNorm. With an `offset` (Gemma's `1 + w`), scaled in float32 before the cast
    back, as Gemma does; Llama casts first, then scales."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if offset:
        return (x32 * (offset + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * x32.astype(x.dtype)


def softcap(x: jax.Array, cap: float) -> jax.Array:
    """Gemma's soft-capping: `cap * tanh(x / cap)`."""
    return cap * jnp.tanh(x / cap)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x: [T, heads, hd]; cos/sin: [T, hd] (rotate-half convention, as HF)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return (x * cos[:, None, :] + rotated * sin[:, None, :]).astype(x.dtype)


QuantizedMatmul = Callable[[jax.Array, Params], jax.Array]


def _linear(
    matmul: QuantizedMatmul, x: jax.Array, p: dict[str, jax.Array], axis: str | None = None
) -> jax.Array:
    """`x @ kernel + bias` by `matmul` (`minivllm_jax.ops.quantization.MATMUL`: float and quantized
    projections, XLA's dot or the native kernels). With `axis` the kernel's input rows are split over that mesh axis (o_proj
    and down_proj under tensor parallelism, `minivllm_jax.parallel.sharding`): the partial products are
    summed over the devices (one all-reduce) before the bias is added, once."""
    y = matmul(x, p)
    if axis is not None:
        y = lax.psum(y, axis)
    return y + p["bias"] if "bias" in p else y


def _attention_inputs(
    cfg: ModelConfig, matmul: QuantizedMatmul, lp: Params, x: jax.Array
) -> tuple[jax.Array, ...]:
    T, q_dim, kv_dim = x.shape[0], cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    eps, offset = cfg.rms_norm_eps, cfg.norm_weight_offset
    qkv = _linear(matmul, rms_norm(x, lp["input_layernorm"], eps, offset), lp["qkv_proj"])
    q, k, v = jnp.split(qkv, [q_dim, q_dim + kv_dim], axis=-1)
    q, k = q.reshape(T, cfg.num_heads, cfg.head_dim), k.reshape(T, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:  # per head, before RoPE
        q, k = rms_norm(q, lp["q_norm"], eps, offset), rms_norm(k, lp["k_norm"], eps, offset)
    return q, k, v.reshape(T, cfg.num_kv_heads, cfg.head_dim)


def _attention_output_and_mlp(
    cfg: ModelConfig,
    matmul: QuantizedMatmul,
    axis: str | None,
    lp: Params,
    x: jax.Array,
    attn: jax.Array,
) -> jax.Array:
    eps, offset = cfg.rms_norm_eps, cfg.norm_weight_offset
    if (
        cfg.sandwich_norms
    ):  # Gemma: post_attention_layernorm norms the attention output, not the MLP input
        x = x + rms_norm(
            _linear(matmul, attn, lp["o_proj"], axis), lp["post_attention_layernorm"], eps, offset
        )
        h = rms_norm(x, lp["pre_feedforward_layernorm"], eps, offset)
    else:
        x = x + _linear(matmul, attn, lp["o_proj"], axis)
        h = rms_norm(x, lp["post_attention_layernorm"], eps, offset)
    gate, up = jnp.split(_linear(matmul, h, lp["gate_up_proj"]), 2, axis=-1)
    y = _linear(matmul, ACTIVATIONS[cfg.hidden_act](gate) * up, lp["down_proj"], axis)
    return x + (
        rms_norm(y, lp["post_feedforward_layernorm"], eps, offset) if cfg.sandwich_norms else y
    )


def _with_layer(layers: Sequence[Params], layer: jax.Array, fn, *args):
    """`fn(layers[layer], *args)`: one switch branch per layer, each reading its own weights in
    place (see the module docstring)."""
    return lax.switch(layer, [functools.partial(fn, lp) for lp in layers], *args)


def _layer(
    cfg: ModelConfig,
    attention: AttentionFn,
    matmul: QuantizedMatmul,
    axis: str | None,
    x: jax.Array,
    layers: Sequence[Params],
    cache: KVCache,
    layer: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    batch: StepBatch,
):
    T = x.shape[0]
    with jax.named_scope("qkv"):
        q, k, v = _with_layer(layers, layer, functools.partial(_attention_inputs, cfg, matmul), x)
    with jax.named_scope("rope"):
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    with jax.named_scope("attention"):
        attn = attention(q, k, v, cache, layer, batch).reshape(T, cfg.num_heads * cfg.head_dim)
    with jax.named_scope("mlp"):
        x = _with_layer(
            layers, layer, functools.partial(_attention_output_and_mlp, cfg, matmul, axis), x, attn
        )
    return x, q, k, v


def forward(
    params: Params,
    cache: KVCache,
    batch: StepBatch,
    cfg: ModelConfig,
    attention: str = "reference",
    all_logits: bool = False,
    matmul: str = "reference",
    axis: str | None = None,
    logit_rows: jax.Array | None = None,
    return_queries: bool = False,
) -> tuple[jax.Array, KVCache] | tuple[jax.Array, KVCache, jax.Array]:
    """One ragged step: embed the new tokens, run the layers over the paged cache, write their K/V.

    `params` is per layer (`unstack_layers`); stacked params are unstacked here, inside the
    program, which copies every weight on each call: fine for a test, slow for serving.

    Returns float32 logits at each sequence's last new token (`[S, V]`; a padded sequence
    gives a row of no meaning), or at every token (`[T, V]`) when `all_logits`, or at the
    tokens `logit_rows` (`int32[R]` token indices: `[R, V]`), and the updated cache. `attention` names the implementation (`minivllm_jax.ops.attention.ATTENTION`).

    `axis`: run as one shard of a tensor-parallel model (inside `shard_map` over that mesh
    axis, `minivllm_jax.parallel.sharding`): `cfg` counts this device's heads and `params`/`cache` are its
    slices; the row-split projections are all-reduced, and an embedding or head split by vocab
    is looked up locally and summed, or all-gathered into full logits.

    `return_queries` (static): also return every layer's post-RoPE queries at the new tokens,
    `[L, T, H, hd]`, as a third value (page scores, `minivllm_jax.engine.step.page_attention_scores`);
    the logits and cache are the same either way.
    """
    attend, qmatmul = _layer_attention(cfg, attention), MATMUL[matmul]
    x = _embed(params["embed_tokens"], batch.tokens, cfg, model_dtype(params), axis)  # [T, d]
    if cfg.embedding_scale is not None:  # a float32 scalar cast to the model dtype, as HF's
        x = x * jnp.asarray(cfg.embedding_scale, jnp.float32).astype(x.dtype)
    cos, sin = _rope(cfg, batch.positions, x.dtype)
    local_rope = cfg.local_rope_theta is not None and cfg.has_sliding_window
    if local_rope:  # Gemma 3: sliding-window layers rotate by their own base, picked per layer
        local_cos, local_sin = _rope(cfg, batch.positions, x.dtype, local=True)
        is_local = jnp.asarray([w > 0 for w in cfg.layer_windows])

    layers = unstack_layers(params)["layers"]

    def body(x, layer):
        c, s = cos, sin
        if local_rope:
            c, s = (
                jnp.where(is_local[layer], local_cos, cos),
                jnp.where(is_local[layer], local_sin, sin),
            )
        x, q, k, v = _layer(cfg, attend, qmatmul, axis, x, layers, cache, layer, c, s, batch)
        return x, (k, v, q) if return_queries else (k, v)  # the default program stacks no queries

    x, stacked = jax.lax.scan(body, x, jnp.arange(cfg.num_layers, dtype=jnp.int32))
    cache = write_kv(cache, stacked[0], stacked[1], batch.slot_mapping)
    logits = _logits(params, cfg, matmul, qmatmul, axis, x, batch, all_logits, logit_rows)
    if cfg.final_logit_softcap is not None:
        logits = softcap(logits, cfg.final_logit_softcap)
    return (logits, cache, stacked[2]) if return_queries else (logits, cache)


def _rope(
    cfg: ModelConfig, positions: jax.Array, dtype: Any, local: bool = False
) -> tuple[jax.Array, jax.Array]:
    """cos and sin `[T, hd]` of the tokens' positions (`local`: see `rope_inv_freq`)."""
    freqs = positions[:, None].astype(jnp.float32) * rope_inv_freq(cfg, local)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def _layer_attention(cfg: ModelConfig, name: str) -> AttentionFn:
    """The attention implementation `name`, given the model's sliding windows (per layer, by the
    traced layer index), soft-capping and scale when it has any (`cfg.attention_extras`). An
    implementation that lacks them is refused rather than run without them."""
    attend = get_attention(name)
    if not cfg.attention_extras:
        return attend
    if name not in ATTENTION_WITH_EXTRAS:
        raise ValueError(
            f"attention={name!r} does not implement {', '.join(cfg.attention_extras)}, which this "
            f"model uses; use {' or '.join(map(repr, ATTENTION_WITH_EXTRAS))} ('auto' picks it)"
        )
    options = dict(scale=cfg.attention_scale, softcap=cfg.attn_logit_softcap)
    windows = set(cfg.layer_windows)
    per_layer = len(windows) > 1  # else none, or every layer's the same (Mistral): a constant

    def attend_layer(q, k, v, cache, layer, batch):
        window = (
            jnp.asarray(cfg.layer_windows, jnp.int32)[layer]
            if per_layer
            else next(iter(windows), None)
        )
        return attend(q, k, v, cache, layer, batch, window=window, **options)

    return attend_layer


def _logits(
    params: Params,
    cfg: ModelConfig,
    matmul: str,
    qmatmul: QuantizedMatmul,
    axis: str | None,
    x: jax.Array,
    batch: StepBatch,
    all_logits: bool,
    logit_rows: jax.Array | None,
) -> jax.Array:
    """Float32 logits of the final hidden states `x` at the rows `forward` returns."""
    if logit_rows is not None:
        x = x[logit_rows]
    elif not all_logits:
        last = batch.query_start + jnp.maximum(batch.query_len, 1) - 1
        x = x[jnp.clip(last, 0, batch.num_tokens - 1)]
    x = rms_norm(x, params["norm"], cfg.rms_norm_eps, cfg.norm_weight_offset)
    head = params["embed_tokens"] if cfg.tie_word_embeddings else params["lm_head"]
    if is_quantized(head):  # int8 per vocabulary entry (`quantization.quantize_head`)
        return qmatmul(x, head).astype(jnp.float32)
    if (
        cfg.tie_word_embeddings and matmul == "native"
    ):  # the embedding read in place by the native kernel
        logits = float_matmul_transposed_native(x, head)
    else:
        head = head.T if cfg.tie_word_embeddings else head
        logits = jnp.einsum("...d,dv->...v", x, head, preferred_element_type=jnp.float32)
    if (
        axis is not None and logits.shape[-1] < cfg.vocab_size
    ):  # this device's slice of the vocabulary
        logits = lax.all_gather(logits, axis, axis=logits.ndim - 1, tiled=True)
    return logits


def _embed(
    table: Any, tokens: jax.Array, cfg: ModelConfig, dtype: Any, axis: str | None
) -> jax.Array:
    """The tokens' embeddings. A table split by vocabulary over `axis` (tensor parallelism)
    holds rows `[i * rows, (i + 1) * rows)` on device `i`: each device looks up the tokens it
    holds, zeros the others, and the sum over devices is every token's row."""
    rows = table.shape[0] if not isinstance(table, dict) else cfg.vocab_size
    if axis is None or rows == cfg.vocab_size:
        return lookup_embedding(table, tokens, dtype)
    local = tokens - lax.axis_index(axis) * rows
    mine = (local >= 0) & (local < rows)
    x = lookup_embedding(table, jnp.where(mine, local, 0), dtype)
    return lax.psum(jnp.where(mine[:, None], x, jnp.zeros_like(x)), axis)


FAMILY = ModelFamily("llama", ("LlamaForCausalLM",), ("llama",), config_from_hf)
