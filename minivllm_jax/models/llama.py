"""The Llama family as pure functions over a params pytree and a paged KV cache.

params = {
  "embed_tokens": [vocab, hidden],
  "layers": {                               # stacked over layers (leading axis L)
    "input_layernorm": [L, hidden], "post_attention_layernorm": [L, hidden],
    "q_proj": {"kernel": [L, hidden, heads*hd], "bias"?: [L, heads*hd]},
    "k_proj" / "v_proj": {"kernel": [L, hidden, kv_heads*hd], "bias"?: [L, kv_heads*hd]},
    "o_proj": {"kernel": [L, heads*hd, hidden], "bias"?: [L, hidden]},
    "gate_proj" / "up_proj": {"kernel": [L, hidden, inter], "bias"?: [L, inter]},
    "down_proj": {"kernel": [L, inter, hidden], "bias"?: [L, hidden]},
  },
  "norm": [hidden],
  "lm_head"?: [hidden, vocab],              # absent when embeddings are tied
}
Kernels are `[in, out]` (HF's `[out, in]` transposed). Numerics follow HF's modeling_llama:
RMSNorm in float32 then cast back before the weight, rotate-half RoPE, softmax in float32.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from minivllm_jax.batch import StepBatch
from minivllm_jax.config import ModelConfig
from minivllm_jax.kv_cache import KVCache, write_kv

Params = dict[str, Any]

_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def _proj_dims(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    d, q, kv, f = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    return {
        "q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d),
        "gate_proj": (d, f), "up_proj": (d, f), "down_proj": (f, d),
    }  # fmt: skip


def param_shapes(cfg: ModelConfig, dtype: Any = jnp.float32) -> Params:
    """The abstract params tree (`ShapeDtypeStruct` leaves): drives init, conversion checks and restore."""
    L, d = cfg.num_layers, cfg.hidden_size
    sds = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))  # noqa: E731
    layers: dict[str, Any] = {"input_layernorm": sds(L, d), "post_attention_layernorm": sds(L, d)}
    for name, (din, dout) in _proj_dims(cfg).items():
        layers[name] = {"kernel": sds(L, din, dout)}
        if (name in _ATTN and cfg.attention_bias) or (name in _MLP and cfg.mlp_bias):
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
    for i in range(cfg.num_layers):
        pre = f"model.layers.{i}."
        table[pre + "input_layernorm.weight"] = (("layers", "input_layernorm"), i, False)
        table[pre + "post_attention_layernorm.weight"] = (("layers", "post_attention_layernorm"), i, False)
        for name in _ATTN + _MLP:
            module = ("self_attn." if name in _ATTN else "mlp.") + name
            table[f"{pre}{module}.weight"] = (("layers", name, "kernel"), i, True)
            if "bias" in shapes[name]:
                table[f"{pre}{module}.bias"] = (("layers", name, "bias"), i, False)
    return table


def init_params(cfg: ModelConfig, key: jax.Array, dtype: Any = jnp.float32, scale: float = 0.02) -> Params:
    """Random params with the right tree (tests and benchmarks; real weights come from convert/)."""
    shapes = param_shapes(cfg, dtype)
    leaves, treedef = jax.tree.flatten(shapes)
    keys = jax.random.split(key, len(leaves))
    return jax.tree.unflatten(
        treedef, [(scale * jax.random.normal(k, s.shape, jnp.float32)).astype(s.dtype) for k, s in zip(keys, leaves)]
    )


# ----------------------------------------------------------------------------------------- math


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies (float32), with HF's `linear` and `llama3` scaling rules."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim))
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


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x: [B, T, heads, hd]; cos/sin: [B, T, hd] (rotate-half convention, as HF)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return (x * cos[:, :, None, :] + rotated * sin[:, :, None, :]).astype(x.dtype)


def _linear(x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
    y = x @ p["kernel"]
    return y + p["bias"] if "bias" in p else y


def _block_index(pages: jax.Array, layer: jax.Array, page_ids: jax.Array) -> jax.Array:
    """Index of each page's per-head block in the stacked cache `[L, num_pages, kvh, *block]`
    flattened over (layer, page, head): `[..., kvh]`.

    Folding layer, page and head into one index makes each read one simple gather of contiguous
    blocks: no copy of the layer, no transpose afterwards."""
    _, num_pages, kvh = pages.shape[:3]
    return (layer * num_pages + page_ids)[..., None] * kvh + jnp.arange(kvh, dtype=page_ids.dtype)


def _gather_blocks(pages: jax.Array, index: jax.Array) -> jax.Array:
    """The blocks (`[hd, ps]` of K, `[ps, hd]` of V) named by `index` (from `_block_index`)."""
    return pages.reshape(-1, *pages.shape[3:]).at[index].get(mode="promise_in_bounds")


def _gather_pages(pages: jax.Array, layer: jax.Array, block_tables: jax.Array) -> jax.Array:
    """This layer's blocks of each row's pages, kv-head-major: `[B, kvh, P, *block]`."""
    return _gather_blocks(pages, _block_index(pages, layer, block_tables).swapaxes(1, 2))


def paged_attention(
    q: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    cache: KVCache,
    layer: jax.Array,
    batch: StepBatch,
) -> jax.Array:
    """Attention of each row's new queries over its cached pages plus its new keys (causal).

    Decode steps that list their pages flat (`batch.page_ids`) take `ragged_decode_attention`.

    q: [B, T, H, hd]; k_new/v_new: [B, T, KVH, hd]; `layer` indexes the stacked cache. Returns
    [B, T, H*hd]. Only the row's pages (`block_tables`, the first `context_lens` tokens) and its
    own new tokens (causally) are attended to. Plain JAX; a kernel can replace this function.

    Shaped for XLA on CPU: the query heads of one KV group are folded into the rows (`g*T` rows
    per kv head) so each product is one bigger matmul (`q @ K^T` against the transposed K
    pages, then `p @ V`); past and new keys are scored separately and joined only in the small
    score tensor, so the gathered pages are never concatenated with the new keys.
    """
    if batch.page_ids.shape[0]:
        return ragged_decode_attention(q, k_new, v_new, cache, layer, batch)
    B, T, H, hd = q.shape
    KVH = k_new.shape[2]
    G = H // KVH
    P = batch.block_tables.shape[1]
    S = P * cache.page_size
    dtype = cache.k.dtype

    past_k = _gather_pages(cache.k, layer, batch.block_tables)  # [B, KVH, P, hd, ps]
    past_v = _gather_pages(cache.v, layer, batch.block_tables).reshape(B, KVH, S, hd)
    # Rows r = t * G + g of kv head k, pre-scaled.
    qf = q.reshape(B, T, KVH, G, hd).transpose(0, 2, 1, 3, 4).reshape(B, KVH, T * G, hd)
    qf = (qf * hd**-0.5).astype(dtype)
    kn = k_new.transpose(0, 2, 1, 3).astype(dtype)  # [B, KVH, T, hd]
    vn = v_new.transpose(0, 2, 1, 3).astype(dtype)

    batch_dims = ((0, 1), (0, 1))
    s_past = jax.lax.dot_general(qf, past_k, (((3,), (3,)), batch_dims), preferred_element_type=jnp.float32)
    s_new = jax.lax.dot_general(qf, kn, (((3,), (3,)), batch_dims), preferred_element_type=jnp.float32)
    scores = jnp.concatenate([s_past.reshape(B, KVH, T * G, S), s_new], axis=3)  # [B, KVH, TG, S+T]

    row_t = jnp.arange(T * G) // G  # the new token of each row
    past_ok = jnp.arange(S)[None, None, :] < batch.context_lens[:, None, None]  # [B, 1, S]
    new_ok = jnp.arange(T)[None, :] <= row_t[:, None]  # [TG, T]
    mask = jnp.concatenate(
        [jnp.broadcast_to(past_ok, (B, T * G, S)), jnp.broadcast_to(new_ok[None], (B, T * G, T))], axis=2
    )
    scores = jnp.where(mask[:, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=3).astype(dtype)

    pv = (((3,), (2,)), batch_dims)
    out = jax.lax.dot_general(probs[..., :S], past_v, pv, preferred_element_type=jnp.float32)
    out = out + jax.lax.dot_general(probs[..., S:], vn, pv, preferred_element_type=jnp.float32)
    out = out.astype(q.dtype).reshape(B, KVH, T, G, hd).transpose(0, 2, 1, 3, 4)
    return out.reshape(B, T, H * hd)


def ragged_decode_attention(
    q: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    cache: KVCache,
    layer: jax.Array,
    batch: StepBatch,
) -> jax.Array:
    """Decode attention (`T == 1`) over a flat list of pages shared by all rows.

    Work and memory traffic follow the real number of cached pages, not rows x the longest
    row. Each listed page is scored against its row's queries; a row's softmax is put together
    from per-page maxima and sums with segment reductions over `page_rows` (sorted), and the new
    token's own key/value join at the end. Same contract as `paged_attention`.
    """
    B, T, H, hd = q.shape
    assert T == 1, "a flat page list is for decode steps"
    KVH = k_new.shape[2]
    G = H // KVH
    page_size = cache.page_size
    dtype = cache.k.dtype
    rows = batch.page_rows

    blocks = _block_index(cache.k, layer, batch.page_ids)  # [N, KVH]
    k_pages = _gather_blocks(cache.k, blocks)  # [N, KVH, hd, ps]
    v_pages = _gather_blocks(cache.v, blocks)  # [N, KVH, ps, hd]
    qf = (q.reshape(B, KVH, G, hd) * hd**-0.5).astype(dtype)
    batch_dims = ((0, 1), (0, 1))
    scores = jax.lax.dot_general(qf[rows], k_pages, (((3,), (2,)), batch_dims), preferred_element_type=jnp.float32)
    valid = jnp.arange(page_size)[None, :] < batch.page_lens[:, None]  # [N, ps]
    scores = jnp.where(valid[:, None, None, :], scores, -jnp.inf)  # [N, KVH, G, ps]
    s_new = jnp.sum(qf * k_new.reshape(B, KVH, 1, hd).astype(dtype), axis=-1, dtype=jnp.float32)  # [B, KVH, G]

    page_max = jax.ops.segment_max(scores.max(-1), rows, B, indices_are_sorted=True)
    row_max = jnp.maximum(page_max, s_new)  # finite: every row has its new token
    probs = jnp.exp(scores - row_max[rows][..., None])
    p_new = jnp.exp(s_new - row_max)
    denom = jax.ops.segment_sum(probs.sum(-1), rows, B, indices_are_sorted=True) + p_new
    page_out = jax.lax.dot_general(probs.astype(dtype), v_pages, (((3,), (2,)), batch_dims),
                                   preferred_element_type=jnp.float32)  # fmt: skip
    out = jax.ops.segment_sum(page_out, rows, B, indices_are_sorted=True)  # [B, KVH, G, hd]
    out = out + p_new[..., None] * v_new.reshape(B, KVH, 1, hd).astype(jnp.float32)
    out = out / denom[..., None]
    return out.astype(q.dtype).reshape(B, 1, H * hd)


def _layer(cfg: ModelConfig, x: jax.Array, lp: Params, cache: KVCache, layer, cos, sin, batch: StepBatch):
    B, T, _ = x.shape
    with jax.named_scope("qkv"):
        h = rms_norm(x, lp["input_layernorm"], cfg.rms_norm_eps)
        q = _linear(h, lp["q_proj"]).reshape(B, T, cfg.num_heads, cfg.head_dim)
        k = _linear(h, lp["k_proj"]).reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
        v = _linear(h, lp["v_proj"]).reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
    with jax.named_scope("rope"):
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    with jax.named_scope("attention"):
        attn = paged_attention(q, k, v, cache, layer, batch)
        x = x + _linear(attn, lp["o_proj"])
    with jax.named_scope("mlp"):
        h = rms_norm(x, lp["post_attention_layernorm"], cfg.rms_norm_eps)
        x = x + _linear(jax.nn.silu(_linear(h, lp["gate_proj"])) * _linear(h, lp["up_proj"]), lp["down_proj"])
    return x, k, v


def forward(
    params: Params, cache: KVCache, batch: StepBatch, cfg: ModelConfig, all_logits: bool = False
) -> tuple[jax.Array, KVCache]:
    """One step: embed new tokens, run the layers over the paged cache, write their K/V.

    Returns float32 logits at each row's last valid token (`[B, V]`), or at every position
    (`[B, T, V]`) when `all_logits`, and the updated cache.
    """
    x = params["embed_tokens"][batch.tokens]
    freqs = batch.positions[..., None].astype(jnp.float32) * rope_inv_freq(cfg)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    cos, sin = jnp.cos(emb).astype(x.dtype), jnp.sin(emb).astype(x.dtype)

    def body(x, layer):
        lp, idx = layer
        x, k, v = _layer(cfg, x, lp, cache, idx, cos, sin, batch)
        return x, (k, v)

    x, (new_k, new_v) = jax.lax.scan(body, x, (params["layers"], jnp.arange(cfg.num_layers)))
    cache = write_kv(cache, new_k, new_v, batch.slot_mapping)

    if not all_logits:
        last = jnp.maximum(batch.query_lens - 1, 0)
        x = jnp.take_along_axis(x, last[:, None, None], axis=1)[:, 0]
    x = rms_norm(x, params["norm"], cfg.rms_norm_eps)
    head = params["embed_tokens"].T if cfg.tie_word_embeddings else params["lm_head"]
    logits = jnp.einsum("...d,dv->...v", x, head, preferred_element_type=jnp.float32)
    return logits, cache


forward_jit = jax.jit(forward, static_argnames=("cfg", "all_logits"), donate_argnames=("cache",))
