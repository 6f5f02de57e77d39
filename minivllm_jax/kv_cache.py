"""The paged KV cache: one explicit pytree of pages, threaded through every step and donated.

Layout: K and V are stacked over layers, `[num_layers, num_pages, num_kv_heads, page_size,
head_dim]` (KV-head-major inside a page, so one (page, kv head) is a contiguous
`[page_size, head_dim]` block: attention gathers whole blocks and multiplies them without
transposing). Page 0 is a scratch page: padded slots of a bucket write there, so padding never
touches a live sequence's pages, and the block manager never hands it out. A token's slot is
`page * page_size + offset`, as before; `slot_index` maps it to rows of the flattened cache.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from minivllm_jax.config import ModelConfig

SCRATCH_PAGE = 0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    k: jax.Array  # [num_layers, num_pages, num_kv_heads, page_size, head_dim]
    v: jax.Array  # [num_layers, num_pages, num_kv_heads, page_size, head_dim]

    @property
    def num_pages(self) -> int:
        return self.k.shape[1]

    @property
    def page_size(self) -> int:
        return self.k.shape[3]

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[2]


def kv_cache_shape(cfg: ModelConfig, num_pages: int, page_size: int) -> tuple[int, ...]:
    return (cfg.num_layers, num_pages, cfg.num_kv_heads, page_size, cfg.head_dim)


def kv_bytes_per_page(cfg: ModelConfig, page_size: int, dtype: jnp.dtype) -> int:
    """Bytes one page costs across all layers, K and V together."""
    return 2 * cfg.num_layers * page_size * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(dtype).itemsize


def init_kv_cache(cfg: ModelConfig, num_pages: int, page_size: int, dtype: jnp.dtype) -> KVCache:
    if num_pages < 2:
        raise ValueError(f"num_pages must be >= 2 (page 0 is the scratch page), got {num_pages}")
    shape = kv_cache_shape(cfg, num_pages, page_size)
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))


def slot_index(slots: jax.Array, num_kv_heads: int, page_size: int) -> jax.Array:
    """Rows of the cache flattened to `[L, num_pages * kvh * page_size, hd]` for each slot and head.

    `slots` int32[...] (page * page_size + offset) -> int32[..., kvh].
    """
    page, offset = slots // page_size, slots % page_size
    heads = jnp.arange(num_kv_heads, dtype=slots.dtype)
    return (page[..., None] * num_kv_heads + heads) * page_size + offset[..., None]


def write_kv(cache: KVCache, new_k: jax.Array, new_v: jax.Array, slot_mapping: jax.Array) -> KVCache:
    """Scatter this step's K/V (`[L, B, T, kvh, hd]`) into flat slots `page * page_size + offset`.

    Padded tokens carry slots inside the scratch page, so they can never clobber live data.
    """
    L, num_pages, kvh, page_size, hd = cache.k.shape
    rows = slot_index(slot_mapping.reshape(-1), kvh, page_size).reshape(-1)  # [B*T*kvh]

    def scatter(pages: jax.Array, new: jax.Array) -> jax.Array:
        flat = pages.reshape(L, num_pages * kvh * page_size, hd)
        flat = flat.at[:, rows].set(new.reshape(L, -1, hd).astype(pages.dtype), mode="promise_in_bounds")
        return flat.reshape(pages.shape)

    return KVCache(k=scatter(cache.k, new_k), v=scatter(cache.v, new_v))
