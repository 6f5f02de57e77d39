"""The native ragged paged attention (`ragged_paged_attention.cc`) behind the contract of
`minivllm_jax.ops.attention` (same signature, same result as its pure-JAX reference to fp32
rounding). float32 queries and K/V, with float32 or int8 pages (`KVCache.quantized`); other
dtypes run the reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from minivllm_jax.kernels import require_native
from minivllm_jax.ops.attention import ragged_paged_attention
from minivllm_jax.ops.batch import StepBatch
from minivllm_jax.ops.kv_cache import KVCache, as_stored

TARGETS = {
    False: "minivllm_ragged_paged_attention_f32",
    True: "minivllm_ragged_paged_attention_int8kv",
}


def ragged_paged_attention_native(
    q: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    cache: KVCache,
    layer: jax.Array,
    batch: StepBatch,
) -> jax.Array:
    page_dtype = jnp.int8 if cache.quantized else jnp.float32
    if not (
        all(x.dtype == jnp.float32 for x in (q, k_new, v_new))
        and cache.k.dtype == cache.v.dtype == page_dtype
    ):
        return ragged_paged_attention(q, k_new, v_new, cache, layer, batch)
    require_native("attention", "attention='auto' or 'reference'")
    call = jax.ffi.ffi_call(TARGETS[cache.quantized], jax.ShapeDtypeStruct(q.shape, q.dtype))
    i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    pages = (
        (cache.k, cache.v, cache.k_scale, cache.v_scale) if cache.quantized else (cache.k, cache.v)
    )
    return call(
        q,
        as_stored(cache, k_new),
        as_stored(cache, v_new),
        *pages,
        i32(layer),
        i32(batch.query_start),
        i32(batch.query_len),
        i32(batch.context_len),
        i32(batch.page_start),
        i32(batch.page_ids),
    )
