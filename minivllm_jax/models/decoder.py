"""The decoder every model family runs (`models/registry.py`), as pure functions over the
serving params (`models.params.ServingParams`) and a paged KV cache: Llama's math, plus what
other families change in it as static `ModelConfig` fields (q/k/v biases, q/k norms, Gemma's
norms and embedding scale, GeGLU, sliding windows, soft-capping, per-layer RoPE bases), built
from `models.layers`. Attention goes through `minivllm_jax.ops.attention`, every matmul
through `minivllm_jax.ops.matmul`: the model names no kernel.

Inside the layer loop each layer's matmuls run in that layer's branch of a `lax.switch`, which
reads its weights in place (`models.params`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from minivllm_jax.config import ModelConfig
from minivllm_jax.models import layers
from minivllm_jax.models.params import Params, ServingParams, model_dtype
from minivllm_jax.ops.attention import AttentionFn, layer_attention
from minivllm_jax.ops.batch import StepBatch
from minivllm_jax.ops.kv_cache import KVCache, write_kv


def _with_layer(per_layer: Sequence[Params], layer: jax.Array, fn, *args):
    """`fn(per_layer[layer], *args)`: one switch branch per layer, each reading its own weights
    in place (see the module docstring)."""
    return lax.switch(layer, [functools.partial(fn, lp) for lp in per_layer], *args)


def _layer(
    cfg: ModelConfig,
    attention: AttentionFn,
    matmul: str,
    axis: str | None,
    x: jax.Array,
    per_layer: Sequence[Params],
    cache: KVCache,
    layer: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    batch: StepBatch,
):
    T = x.shape[0]
    with jax.named_scope("qkv"):
        q, k, v = _with_layer(
            per_layer, layer, functools.partial(layers.attention_inputs, cfg, matmul), x
        )
    with jax.named_scope("rope"):
        q, k = layers.apply_rope(q, cos, sin), layers.apply_rope(k, cos, sin)
    with jax.named_scope("attention"):
        attn = attention(q, k, v, cache, layer, batch).reshape(T, cfg.num_heads * cfg.head_dim)
    with jax.named_scope("mlp"):
        x = _with_layer(
            per_layer,
            layer,
            functools.partial(layers.attention_output_and_mlp, cfg, matmul, axis),
            x,
            attn,
        )
    return x, q, k, v


def forward(
    params: ServingParams,
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

    `params` are the serving params (`models.params.unstack_layers`).

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
    attend = layer_attention(cfg, attention)
    x = layers.embed(params.embed_tokens, batch.tokens, cfg, model_dtype(params), axis)  # [T, d]
    if cfg.embedding_scale is not None:  # a float32 scalar cast to the model dtype, as HF's
        x = x * jnp.asarray(cfg.embedding_scale, jnp.float32).astype(x.dtype)
    cos, sin = layers.rope(cfg, batch.positions, x.dtype)
    local_rope = cfg.local_rope_theta is not None and cfg.has_sliding_window
    if local_rope:  # Gemma 3: sliding-window layers rotate by their own base, picked per layer
        local_cos, local_sin = layers.rope(cfg, batch.positions, x.dtype, local=True)
        is_local = jnp.asarray([w > 0 for w in cfg.layer_windows])

    def body(x, layer):
        c, s = cos, sin
        if local_rope:
            c, s = (
                jnp.where(is_local[layer], local_cos, cos),
                jnp.where(is_local[layer], local_sin, sin),
            )
        x, q, k, v = _layer(cfg, attend, matmul, axis, x, params.layers, cache, layer, c, s, batch)
        return x, (k, v, q) if return_queries else (k, v)  # the default program stacks no queries

    x, stacked = jax.lax.scan(body, x, jnp.arange(cfg.num_layers, dtype=jnp.int32))
    cache = write_kv(cache, stacked[0], stacked[1], batch.slot_mapping)
    logits = layers.output_logits(params, cfg, matmul, axis, x, batch, all_logits, logit_rows)
    if cfg.final_logit_softcap is not None:
        logits = layers.softcap(logits, cfg.final_logit_softcap)
    return (logits, cache, stacked[2]) if return_queries else (logits, cache)
