"""The native ragged paged attention (`ragged_paged_attention.cc`): an XLA FFI call over raw
arrays. It computes the contract of `minivllm_jax.ops.attention` (whose dispatcher picks it by
`supports`) to float32 rounding, for what the C++ was written for:

- float32 queries and new K/V (`[T, H, hd]`, `[T, KVH, hd]`, `H` a multiple of `KVH`; any
  head_dim: the shapes that serve, 64 and 128, take a fixed-size path);
- pages of float32, or of int8 with a float32 scale per token and KV head;
- the plain causal softmax at scale `hd ** -0.5`: no soft-capping, no sliding window, no other
  scale.

Anything else is refused (`supports` is False, and a call raises), never run some other way.

The layout it reads is the paged cache's (`minivllm_jax.ops.kv_cache`): K pages
`[L, P, KVH, hd, page_size]` (keys along the fast axis), V pages `[L, P, KVH, page_size, hd]`,
int8 scales `[L, P, KVH, page_size]`; the new tokens' K/V are given as the pages will hold them
(int8 pages: already rounded through their quantization).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from minivllm_jax.kernels import require_native

# The values the pages hold -> the FFI target that reads them.
TARGETS = {
    jnp.dtype(jnp.float32): "minivllm_ragged_paged_attention_f32",
    jnp.dtype(jnp.int8): "minivllm_ragged_paged_attention_int8kv",
}


def unsupported(
    dtype: DTypeLike,
    page_dtype: DTypeLike,
    *,
    default_scale: bool = True,
    softcap: float | None = None,
    sliding_window: bool = False,
) -> str | None:
    """Why the kernel cannot serve attention with these static facts (None: it can). `dtype`:
    of the queries and new K/V; `page_dtype`: of the values the pages hold (int8 pages carry
    scales); `default_scale`: the scale is `head_dim ** -0.5`."""
    why = []
    if jnp.dtype(dtype) != jnp.float32:
        why.append(f"{jnp.dtype(dtype).name} activations (it computes in float32 only)")
    if jnp.dtype(page_dtype) not in TARGETS:
        why.append(f"{jnp.dtype(page_dtype).name} KV pages (it reads float32 or int8 pages)")
    if not default_scale:
        why.append("a non-default attention scale")
    if softcap is not None:
        why.append("attention logit soft-capping")
    if sliding_window:
        why.append("a sliding window")
    return "; ".join(why) or None


def supports(
    dtype: DTypeLike,
    page_dtype: DTypeLike,
    *,
    default_scale: bool = True,
    softcap: float | None = None,
    sliding_window: bool = False,
) -> bool:
    """The kernel serves these static facts (see `unsupported`)."""
    return (
        unsupported(
            dtype,
            page_dtype,
            default_scale=default_scale,
            softcap=softcap,
            sliding_window=sliding_window,
        )
        is None
    )


def ragged_paged_attention(
    q: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    k_scale: jax.Array | None,
    v_scale: jax.Array | None,
    layer: jax.Array,
    query_start: jax.Array,
    query_len: jax.Array,
    context_len: jax.Array,
    page_start: jax.Array,
    page_ids: jax.Array,
) -> jax.Array:
    """`[T, H, hd]` float32: the attention of the contract over the cache's layer `layer` (the
    layout in the module docstring; `k_scale`/`v_scale` given exactly for int8 pages), for the
    step's sequences as `StepBatch` lays them out (`query_start`, `query_len`, `context_len`,
    `page_start` per sequence; `page_ids` flat)."""
    why = unsupported(q.dtype, k_pages.dtype)
    if why is None and not all(x.dtype == q.dtype for x in (k_new, v_new)):
        why = "new K/V in another dtype than the queries"
    if why is None and v_pages.dtype != k_pages.dtype:
        why = "K and V pages of different dtypes"
    if why is None and (k_scale is None) != (k_pages.dtype != jnp.int8):
        why = "int8 pages need their scales (and float pages take none)"
    if why is not None:
        raise ValueError(f"the native attention kernel cannot serve {why}")
    require_native("attention", "attention='auto' or 'reference'")
    call = jax.ffi.ffi_call(TARGETS[k_pages.dtype], jax.ShapeDtypeStruct(q.shape, q.dtype))
    pages = (k_pages, v_pages) if k_scale is None else (k_pages, v_pages, k_scale, v_scale)
    i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    return call(
        q,
        k_new,
        v_new,
        *pages,
        i32(layer),
        i32(query_start),
        i32(query_len),
        i32(context_len),
        i32(page_start),
        i32(page_ids),
    )
