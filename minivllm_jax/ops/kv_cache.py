"""The paged KV cache: one explicit pytree of pages, threaded through every step and donated.

Layout: K and V are stacked over layers and KV-head-major inside a page, so one (page, kv
head) is a contiguous block and attention gathers whole blocks. V blocks are `[page_size,
head_dim]`; K blocks are stored transposed, `[head_dim, page_size]`, so that scoring a page
is a plain `q @ K_page` matmul (the page-score dot of a 64-row decode step measured about twice
as fast on CPU as contracting the minor axis of `[page_size, head_dim]` blocks). Page 0 is a scratch page: padded slots of
a bucket write there, so padding never touches a live sequence's pages, and the page manager
never hands it out. A token's slot is `page * page_size + offset`.

bfloat16/float16 pages are stored as their bits (`uint16`; `as_bits`/`from_bits`), read as
the queries' dtype: moving pages is data movement only, and XLA:CPU runs a scatter or gather of
16-bit floats by converting the whole operand, the whole cache, to float32 and back every step
(measured here: bf16 batch-1 decode 7.8 tok/s, against 59 with int8 pages; a bitcast of the
cache in the step was no cheaper, it copied it).

int8 pages (`kv_cache_dtype="int8"`): K and V hold int8 in the same layout, and `k_scale` /
`v_scale` (`[num_layers, num_pages, num_kv_heads, page_size]`, float32) one symmetric scale per
token and KV head (max |x| / 127 of its head_dim values), so a token's K/V are quantized once,
when written, and never again as its page fills (a per-page scale would rescale the page). That
is 68 bytes per token and head at head_dim 64 against 256 in float32. Readers dequantize as they
read (`dequantize_k_blocks` / `dequantize_v_blocks` in the reference, block by block into an L1 buffer natively)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from minivllm_jax.config import ModelConfig, check_kv_cache_dtype

SCRATCH_PAGE = 0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    k: jax.Array  # [num_layers, num_pages, num_kv_heads, head_dim, page_size]  (transposed blocks)
    v: jax.Array  # [num_layers, num_pages, num_kv_heads, page_size, head_dim]
    k_scale: jax.Array | None = (
        None  # int8 pages only: f32 [num_layers, num_pages, num_kv_heads, page_size]
    )
    v_scale: jax.Array | None = None

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    @property
    def num_pages(self) -> int:
        return self.k.shape[1]

    @property
    def page_size(self) -> int:
        return self.v.shape[3]

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[2]


def kv_cache_shape(cfg: ModelConfig, num_pages: int, page_size: int) -> tuple[int, ...]:
    """The shape of V; K has its last two axes swapped (see the module docstring)."""
    return (cfg.num_layers, num_pages, cfg.num_kv_heads, page_size, cfg.head_dim)


def kv_bytes_per_token(cfg: ModelConfig, dtype: jnp.dtype, kv_cache_dtype: str = "auto") -> int:
    """Bytes one token's K and V cost across all layers (with the scales of int8 pages)."""
    check_kv_cache_dtype(kv_cache_dtype)
    if kv_cache_dtype == "int8":
        per_head = cfg.head_dim + 4  # int8 values and one float32 scale
    else:
        per_head = cfg.head_dim * jnp.dtype(dtype).itemsize
    return 2 * cfg.num_layers * cfg.num_kv_heads * per_head


def kv_bytes_per_page(
    cfg: ModelConfig, page_size: int, dtype: jnp.dtype, kv_cache_dtype: str = "auto"
) -> int:
    """Bytes one page costs across all layers, K and V together."""
    return page_size * kv_bytes_per_token(cfg, dtype, kv_cache_dtype)


def init_kv_cache(
    cfg: ModelConfig, num_pages: int, page_size: int, dtype: jnp.dtype, kv_cache_dtype: str = "auto"
) -> KVCache:
    """An empty cache: pages of the model's `dtype`, or int8 pages with scales."""
    check_kv_cache_dtype(kv_cache_dtype)
    if num_pages < 2:
        raise ValueError(f"num_pages must be >= 2 (page 0 is the scratch page), got {num_pages}")
    shape = kv_cache_shape(cfg, num_pages, page_size)
    if kv_cache_dtype == "int8":
        return _zeros_cache(shape[:3] + shape[:2:-1], shape, jnp.dtype(jnp.int8), shape[:4])
    if jnp.dtype(dtype).itemsize == 2:  # bfloat16/float16 pages as their bits (module docstring)
        dtype = jnp.uint16
    return _zeros_cache(shape[:3] + shape[:2:-1], shape, jnp.dtype(dtype), None)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _zeros_cache(
    k_shape: tuple[int, ...],
    v_shape: tuple[int, ...],
    dtype: jnp.dtype,
    scale_shape: tuple[int, ...] | None,
) -> KVCache:
    # Under jit: an eager jnp.zeros of a GB-sized cache took 2.4 s here, the jitted one 0.3 s.
    if scale_shape is None:
        return KVCache(k=jnp.zeros(k_shape, dtype), v=jnp.zeros(v_shape, dtype))
    scales = lambda: jnp.ones(scale_shape, jnp.float32)  # noqa: E731
    return KVCache(
        k=jnp.zeros(k_shape, dtype), v=jnp.zeros(v_shape, dtype), k_scale=scales(), v_scale=scales()
    )


def quantize_heads(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Symmetric int8 of each `[..., head_dim]` vector (round to nearest even) and its scale
    `max |x| / 127` (1 for an all-zero vector, whose values are 0 whatever the scale)."""
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1)
    scale = jnp.where(amax > 0, amax / 127.0, 1.0)
    return jnp.clip(jnp.round(x / scale[..., None]), -127, 127).astype(jnp.int8), scale


def as_stored(cache: KVCache, x: jax.Array) -> jax.Array:
    """New K or V (`[..., head_dim]`) as `cache` will hold them: int8 pages round them through
    `quantize_heads` (the very values `write_kv` stores), float pages keep them. Attention gives
    a step's own new tokens these, so every key is seen the same way, cached or new: a result
    does not depend on how a prompt was chunked, batched or found in the prefix cache."""
    if not cache.quantized:
        return x
    q, scale = quantize_heads(x)
    return (q.astype(jnp.float32) * scale[..., None]).astype(x.dtype)


def dequantize_k_blocks(blocks: jax.Array, scales: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """K blocks `[..., head_dim, page_size]` of int8 times their tokens' scales `[..., page_size]`."""
    return (blocks.astype(jnp.float32) * scales[..., None, :]).astype(dtype)


def dequantize_v_blocks(blocks: jax.Array, scales: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """V blocks `[..., page_size, head_dim]` of int8 times their tokens' scales `[..., page_size]`."""
    return (blocks.astype(jnp.float32) * scales[..., None]).astype(dtype)


def as_bits(x: jax.Array) -> jax.Array:
    """16-bit floats as their bits (`uint16`), as the cache stores them; anything else as it is."""
    return lax.bitcast_convert_type(x, jnp.uint16) if x.dtype in (jnp.bfloat16, jnp.float16) else x


def from_bits(x: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """Pages read from the cache (`uint16` bits of 16-bit floats, or values) as `dtype`'s values."""
    return lax.bitcast_convert_type(x, dtype) if x.dtype == jnp.uint16 else x


def write_kv(
    cache: KVCache, new_k: jax.Array, new_v: jax.Array, slot_mapping: jax.Array
) -> KVCache:
    """Scatter this step's K/V (`[L, B, T, kvh, hd]`) into flat slots `page * page_size + offset`.

    Padded tokens carry slots inside the scratch page, so they can never clobber live data.
    """
    L, num_pages, kvh, page_size, hd = cache.v.shape
    slots = slot_mapping.reshape(-1, 1)
    block = (slots // page_size) * kvh + jnp.arange(
        kvh, dtype=slots.dtype
    )  # [B*T, kvh]: (page, head)
    offset = jnp.broadcast_to(slots % page_size, block.shape)
    block, offset = block.reshape(-1), offset.reshape(-1)
    new_k = new_k.reshape(L, -1, hd)  # [L, B*T*kvh, hd]
    new_v = new_v.reshape(L, -1, hd)
    scales = {}
    if cache.quantized:
        (new_k, k_scale), (new_v, v_scale) = quantize_heads(new_k), quantize_heads(new_v)
        for name, new in (("k_scale", k_scale), ("v_scale", v_scale)):
            flat = getattr(cache, name).reshape(L, num_pages * kvh, page_size)
            flat = flat.at[:, block, offset].set(new, mode="promise_in_bounds")
            scales[name] = flat.reshape(getattr(cache, name).shape)
    # K blocks are [hd, page_size]: a token fills one column. Both indices are advanced, so the
    # indexed axis leads in the update: [B*T*kvh, L, hd].
    if cache.k.dtype == jnp.uint16:  # 16-bit float pages hold the bits of the model's K/V
        new_k, new_v = as_bits(new_k), as_bits(new_v)
    k = cache.k.reshape(L, num_pages * kvh, hd, page_size)
    k = k.at[:, block, :, offset].set(
        new_k.swapaxes(0, 1).astype(k.dtype), mode="promise_in_bounds"
    )
    v = cache.v.reshape(L, num_pages * kvh, page_size, hd)
    v = v.at[:, block, offset].set(new_v.astype(v.dtype), mode="promise_in_bounds")
    return KVCache(k=k.reshape(cache.k.shape), v=v.reshape(cache.v.shape), **scales)


def copy_pages(cache: KVCache, src: jax.Array, dst: jax.Array) -> KVCache:
    """Copy whole pages `src[i]` -> `dst[i]` in every layer: K, V and the int8 scales (pages are
    axis 1 of each). Copy-on-write for forked sequences (beam search): a child gets a private copy
    of the partial page it shares with its parent before either writes into it. `dst` must hold
    distinct pages, except for padding `SCRATCH_PAGE -> SCRATCH_PAGE`, so the index arrays can
    keep one length (one compiled program)."""
    return jax.tree.map(lambda x: x.at[:, dst].set(x[:, src]), cache)


def gather_pages(cache: KVCache, pages: jax.Array) -> KVCache:
    """Copies of whole pages `pages[i]` (every layer, scales too), stacked on axis 1 as the cache
    holds them: what a swapped-out sequence or a page bound for disk takes with it."""
    return jax.tree.map(lambda x: x[:, pages], cache)


def scatter_pages(cache: KVCache, data: KVCache, pages: jax.Array) -> KVCache:
    """Write `data` (from `gather_pages`, or read from disk) into pages `pages[i]`: a swap-in or a
    disk-tier hit. Padding entries name the scratch page."""
    return jax.tree.map(lambda x, d: x.at[:, pages].set(d.astype(x.dtype)), cache, data)
