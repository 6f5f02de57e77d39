"""Ragged paged attention: one contract, its pure-JAX reference, and the one dispatcher that
picks an implementation (`ATTENTION`: the reference or the native kernel,
`minivllm_jax.kernels.ragged_paged_attention`) from static facts (`resolve_attention`) and
gives a model what it calls (`layer_attention`).

The contract every implementation keeps (a native kernel goes behind the same signature):

    attention(q, k_new, v_new, cache, layer, batch) -> out
    attention(q, k_new, v_new, cache, layer, batch, scale=..., softcap=..., window=...) -> out

- `q`: `[T, H, hd]`, `k_new`/`v_new`: `[T, KVH, hd]`: the step's new tokens, flat (`H` a
  multiple of `KVH`: grouped-query attention). Queries are not pre-scaled.
- `cache`: the stacked paged cache (`KVCache`: K `[L, pages, KVH, hd, page_size]`, V `[L,
  pages, KVH, page_size, hd]`; int8 pages are read as `value * scale` of their token and head)
  and `layer`, an int32 scalar picking the layer. Read only: the new tokens' K/V are not in it
  yet (the caller writes them after the layers); they are attended to as the cache will hold
  them (`kv_cache.as_stored`: int8 pages round them), so no result depends on which keys
  were cached.
- `batch`: the `StepBatch` metadata: per sequence `query_start`, `query_len`, `context_len`,
  `page_start`, and the flat `page_ids` (see `StepBatch`).
- `out`: `[T, H, hd]` in `q`'s dtype. A token of sequence `s` attends to `s`'s first
  `context_len[s]` cached tokens and to `s`'s new tokens up to and including itself, with
  softmax in float32 and scale `hd ** -0.5`. Padding tokens give zeros.
- The keywords, for the families that need them (`ModelConfig.attention_extras`; only the
  reference takes them): `scale` replaces `hd ** -0.5`;
  `softcap` (static) maps scores to `softcap * tanh(score / softcap)` before the softmax;
  `window` (an int or a traced int32 scalar, the layer's; 0 = none) keeps only the keys at
  cache indices `> i - window` for a query at cache index `i` (a token's cache index is its
  position: KV compression, which would shift them, is refused with a window).

Nothing in it depends on how an implementation schedules its work: only these arrays.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import DTypeLike

from minivllm_jax import kernels
from minivllm_jax.config import ModelConfig
from minivllm_jax.kernels import ragged_paged_attention as native
from minivllm_jax.ops.batch import StepBatch, token_sequences
from minivllm_jax.ops.kv_cache import (
    KVCache,
    as_stored,
    dequantize_k_blocks,
    dequantize_v_blocks,
    from_bits,
)

logger = logging.getLogger(__name__)

AttentionFn = Callable[[jax.Array, jax.Array, jax.Array, KVCache, jax.Array, StepBatch], jax.Array]

QUERY_TILE = 64  # query tokens per tile of a prompt chunk that has cached context
TILE_PAGES = 32  # cached pages scored per inner step of such a tile


def _block_index(pages: jax.Array, layer: jax.Array, page_ids: jax.Array) -> jax.Array:
    """Index of each page's per-head block in the stacked cache `[L, num_pages, kvh, *block]`
    flattened over (layer, page, head): `[..., kvh]`.

    Folding layer, page and head into one index makes each read one simple gather of contiguous
    blocks: no copy of the layer, no transpose afterwards."""
    _, num_pages, kvh = pages.shape[:3]
    return (layer * num_pages + page_ids)[..., None] * kvh + jnp.arange(kvh, dtype=page_ids.dtype)


def _gather_blocks(pages: jax.Array, index: jax.Array) -> jax.Array:
    """The blocks (`[hd, ps]` of K, `[ps, hd]` of V, `[ps]` of scales) named by `index` (from
    `_block_index`)."""
    return pages.reshape(-1, *pages.shape[3:]).at[index].get(mode="promise_in_bounds")


def _gather_kv(cache: KVCache, index: jax.Array, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    """The K and V blocks named by `index`, in `dtype` (int8 pages dequantized by their scales)."""
    k, v = _gather_blocks(cache.k, index), _gather_blocks(cache.v, index)
    if not cache.quantized:
        return from_bits(k, dtype), from_bits(v, dtype)  # 16-bit float pages are stored as bits
    k_scale, v_scale = _gather_blocks(cache.k_scale, index), _gather_blocks(cache.v_scale, index)
    return dequantize_k_blocks(k, k_scale, dtype), dequantize_v_blocks(v, v_scale, dtype)


# A partial softmax per (token, kv head, group member): running max `m`, sum `l` and the
# weighted sum of values `acc`, so parts computed separately merge exactly (flash attention).
Partial = tuple[jax.Array, jax.Array, jax.Array]  # f32 [T, KVH, G], [T, KVH, G], [T, KVH, G, hd]


def _empty(T: int, KVH: int, G: int, hd: int) -> Partial:
    return jnp.full((T, KVH, G), -jnp.inf), jnp.zeros((T, KVH, G)), jnp.zeros((T, KVH, G, hd))


def _safe(m: jax.Array) -> jax.Array:
    return jnp.where(jnp.isfinite(m), m, 0.0)


def _capped(scores: jax.Array, softcap: float | None) -> jax.Array:
    return scores if softcap is None else softcap * jnp.tanh(scores / softcap)


def _new_tokens(
    qf: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    seq: jax.Array,
    valid: jax.Array,
    index: jax.Array,
    softcap: float | None,
    floor: jax.Array | None,
) -> Partial:
    """Every token against the step's new keys: dense `[T, T]`, masked to its own sequence and
    causally (a sequence's tokens are contiguous and in position order), and to its window."""
    T, KVH, G, hd = qf.shape
    dtype = qf.dtype
    q = qf.transpose(1, 0, 2, 3).reshape(KVH, T * G, hd)
    k = k_new.transpose(1, 0, 2).astype(dtype)  # [KVH, T, hd]
    v = v_new.transpose(1, 0, 2).astype(dtype)
    scores = _capped(
        lax.dot_general(q, k, (((2,), (2,)), ((0,), (0,))), preferred_element_type=jnp.float32),
        softcap,
    )
    t = jnp.arange(T)
    ok = (seq[:, None] == seq[None, :]) & (t[None, :] <= t[:, None]) & valid[None, :]  # [T, T]
    if floor is not None:
        ok &= index[None, :] > floor[:, None]
    scores = jnp.where(jnp.repeat(ok, G, axis=0)[None], scores, -jnp.inf)  # rows r = t * G + g
    m = scores.max(-1)
    p = jnp.exp(scores - _safe(m)[..., None])
    acc = lax.dot_general(
        p.astype(dtype), v, (((2,), (1,)), ((0,), (0,))), preferred_element_type=jnp.float32
    )
    to_tokens = lambda x: x.reshape(KVH, T, G, *x.shape[2:]).swapaxes(0, 1)  # noqa: E731
    return to_tokens(m), to_tokens(p.sum(-1)), to_tokens(acc)


def _decode_pages(
    qf: jax.Array,
    cache: KVCache,
    layer: jax.Array,
    batch: StepBatch,
    softcap: float | None,
    floor: jax.Array | None,
) -> Partial:
    """Single-token sequences (decodes) against their cached pages, all sequences' pages in one
    flat list walked in chunks: each entry is scored against its owner's one query and the
    softmax parts are summed per token with segment reductions. Work follows the real number of
    pages (the loop stops after the last decode's page), never rows x the longest row."""
    T, KVH, G, hd = qf.shape
    S, ps = batch.num_seqs, cache.page_size
    N = batch.page_ids.shape[0]
    chunk = min(N, max(32, min(256, 8 * S)))
    padded = -(-N // chunk) * chunk
    page_ids = jnp.pad(batch.page_ids, (0, padded - N))
    entry = jnp.arange(padded)
    owner = jnp.clip(
        jnp.searchsorted(batch.page_start, entry, side="right", method="compare_all") - 1, 0, S - 1
    )
    npages = -(-batch.context_len // ps)
    is_decode = batch.query_len == 1
    live = is_decode[owner] & (entry - batch.page_start[owner] < npages[owner])
    page_len = jnp.where(
        live, jnp.clip(batch.context_len[owner] - (entry - batch.page_start[owner]) * ps, 0, ps), 0
    )
    token = jnp.clip(batch.query_start[owner], 0, T - 1)
    end = jnp.max(jnp.where(is_decode, batch.page_start + npages, 0))
    dims = ((0, 1), (0, 1))

    def body(c: jax.Array, part: Partial) -> Partial:
        m, l, acc = part
        take = lambda x: lax.dynamic_slice_in_dim(x, c * chunk, chunk)  # noqa: E731
        tok, plen = take(token), take(page_len)
        blocks = _block_index(cache.k, layer, take(page_ids))  # [C, KVH]
        k_pages, v_pages = _gather_kv(cache, blocks, qf.dtype)  # [C, KVH, hd, ps], [C, KVH, ps, hd]
        scores = lax.dot_general(
            qf[tok], k_pages, (((3,), (2,)), dims), preferred_element_type=jnp.float32
        )
        scores = _capped(scores, softcap)
        ok = jnp.arange(ps) < plen[:, None]  # [C, ps]
        if floor is not None:  # the keys' cache indices against the decode's window
            ok &= (
                take(entry - batch.page_start[owner])[:, None] * ps + jnp.arange(ps)
                > floor[tok][:, None]
            )
        scores = jnp.where(ok[:, None, None, :], scores, -jnp.inf)  # [C, KVH, G, ps]
        m_new = jnp.maximum(m, jax.ops.segment_max(scores.max(-1), tok, T, indices_are_sorted=True))
        p = jnp.exp(scores - _safe(m_new)[tok][..., None])
        scale = jnp.exp(m - _safe(m_new))
        pv = lax.dot_general(
            p.astype(qf.dtype), v_pages, (((3,), (2,)), dims), preferred_element_type=jnp.float32
        )
        l = l * scale + jax.ops.segment_sum(p.sum(-1), tok, T, indices_are_sorted=True)
        acc = acc * scale[..., None] + jax.ops.segment_sum(pv, tok, T, indices_are_sorted=True)
        return m_new, l, acc

    return lax.fori_loop(0, -(-end // chunk), body, _empty(T, KVH, G, hd))


def _chunk_pages(
    qf: jax.Array,
    cache: KVCache,
    layer: jax.Array,
    batch: StepBatch,
    softcap: float | None,
    floor: jax.Array | None,
) -> Partial:
    """Prompt chunks that have cached context (a chunk continuation, a prefix-cache hit) against
    those pages: tiles of `QUERY_TILE` queries of one sequence, each scored against the
    sequence's pages `TILE_PAGES` at a time with an online softmax. The loops run over real
    tiles and pages only. Every cached token precedes every new one: no causal mask here."""
    T, KVH, G, hd = qf.shape
    S, ps = batch.num_seqs, cache.page_size
    tile = min(T, QUERY_TILE)
    span = min(batch.page_ids.shape[0], TILE_PAGES)
    page_ids = jnp.pad(batch.page_ids, (0, span))
    q_padded = jnp.pad(qf, ((0, tile), (0, 0), (0, 0), (0, 0)))
    floor_padded = None if floor is None else jnp.pad(floor, (0, tile))
    npages = -(-batch.context_len // ps)
    tiles = jnp.where(
        (batch.query_len > 1) & (batch.context_len > 0), -(-batch.query_len // tile), 0
    )
    first_tile = jnp.cumsum(tiles) - tiles
    dims = ((0,), (1,))

    def tile_body(i: jax.Array, part: Partial) -> Partial:
        s = jnp.clip(
            jnp.searchsorted(first_tile + tiles, i, side="right", method="compare_all"), 0, S - 1
        )
        start = batch.query_start[s] + (i - first_tile[s]) * tile
        q = (
            lax.dynamic_slice_in_dim(q_padded, start, tile)
            .transpose(1, 0, 2, 3)
            .reshape(KVH, tile * G, hd)
        )
        if floor is not None:  # per row r = t * G + g
            row_floor = jnp.repeat(lax.dynamic_slice_in_dim(floor_padded, start, tile), G)[
                :, None, None
            ]

        def page_body(c: jax.Array, run: Partial) -> Partial:
            m, l, acc = run
            blocks = _block_index(
                cache.k,
                layer,
                lax.dynamic_slice_in_dim(page_ids, batch.page_start[s] + c * span, span),
            )
            k_pages, v_pages = _gather_kv(
                cache, blocks, qf.dtype
            )  # [span, KVH, hd, ps], [span, KVH, ps, hd]
            scores = lax.dot_general(
                q, k_pages, (((2,), (2,)), dims), preferred_element_type=jnp.float32
            )
            scores = _capped(scores, softcap)
            key_pos = (c * span + jnp.arange(span))[:, None] * ps + jnp.arange(ps)  # [span, ps]
            ok = key_pos < batch.context_len[s]
            if floor is not None:
                ok = ok & (key_pos > row_floor)  # [tile*G, span, ps]
            scores = jnp.where(ok, scores, -jnp.inf)  # [KVH, tile*G, span, ps]
            m_new = jnp.maximum(m, scores.max((2, 3)))
            p = jnp.exp(scores - _safe(m_new)[..., None, None])
            scale = jnp.exp(m - _safe(m_new))
            pv = lax.dot_general(
                p.astype(qf.dtype),
                v_pages,
                (((2, 3), (0, 2)), dims),
                preferred_element_type=jnp.float32,
            )
            return m_new, l * scale + p.sum((2, 3)), acc * scale[..., None] + pv

        init = (
            jnp.full((KVH, tile * G), -jnp.inf),
            jnp.zeros((KVH, tile * G)),
            jnp.zeros((KVH, tile * G, hd)),
        )
        run = lax.fori_loop(0, -(-npages[s] // span), page_body, init)
        rows = (
            start + jnp.arange(tile) < batch.query_start[s] + batch.query_len[s]
        )  # tokens of sequence s
        out = []
        for total, new in zip(part, run):
            new = new.reshape(KVH, tile, G, *new.shape[2:]).swapaxes(0, 1)
            old = lax.dynamic_slice_in_dim(total, start, tile)
            keep = rows.reshape(tile, *([1] * (new.ndim - 1)))
            out.append(lax.dynamic_update_slice_in_dim(total, jnp.where(keep, new, old), start, 0))
        return tuple(out)

    part = lax.fori_loop(0, jnp.sum(tiles), tile_body, _empty(T + tile, KVH, G, hd))
    return tuple(x[:T] for x in part)


def _merge(parts: list[Partial], valid: jax.Array) -> jax.Array:
    m = _safe(jnp.max(jnp.stack([p[0] for p in parts]), axis=0))
    weights = [jnp.exp(p[0] - m) for p in parts]
    l = sum(w * p[1] for w, p in zip(weights, parts))
    acc = sum(w[..., None] * p[2] for w, p in zip(weights, parts))
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    return jnp.where(valid[:, None, None, None], out, 0.0)


def ragged_paged_attention(
    q: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    cache: KVCache,
    layer: jax.Array,
    batch: StepBatch,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    window: jax.Array | int | None = None,
) -> jax.Array:
    """The pure-JAX reference of the contract in the module docstring: three softmax parts
    merged exactly, each doing only real work under static shapes (loop trip counts are
    values): the new tokens among themselves, decodes against their pages, and prompt chunks
    against their cached pages."""
    T, H, hd = q.shape
    KVH = k_new.shape[1]
    G = H // KVH
    float_pages = jnp.issubdtype(
        cache.k.dtype, jnp.floating
    )  # else int8 values or 16-bit float bits
    scale = hd**-0.5 if scale is None else scale
    qf = (q.reshape(T, KVH, G, hd) * scale).astype(cache.k.dtype if float_pages else q.dtype)
    seq, valid = token_sequences(batch)
    index = floor = None
    if window is not None:
        index = (
            batch.context_len[seq] + jnp.arange(T) - batch.query_start[seq]
        )  # each token's cache index
        floor = jnp.where(
            window > 0, index - window, -1
        )  # the highest cache index out of its window
    k_new, v_new = as_stored(cache, k_new), as_stored(cache, v_new)
    parts = [
        _new_tokens(qf, k_new, v_new, seq, valid, index, softcap, floor),
        _decode_pages(qf, cache, layer, batch, softcap, floor),
    ]
    if T > 1:  # a one-token step has no prompt chunk
        parts.append(_chunk_pages(qf, cache, layer, batch, softcap, floor))
    return _merge(parts, valid).astype(q.dtype).reshape(T, H, hd)


def _native(
    q: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    cache: KVCache,
    layer: jax.Array,
    batch: StepBatch,
) -> jax.Array:
    """The native kernel behind the contract (no keywords: it has none of the extras)."""
    return native.ragged_paged_attention(
        q,
        as_stored(cache, k_new),
        as_stored(cache, v_new),
        cache.k,
        cache.v,
        cache.k_scale,
        cache.v_scale,
        layer,
        batch.query_start,
        batch.query_len,
        batch.context_len,
        batch.page_start,
        batch.page_ids,
    )


ATTENTION: dict[str, AttentionFn] = {"reference": ragged_paged_attention, "native": _native}
CHOICES = ("auto", *ATTENTION)  # what `EngineConfig.attention` may name


def get_attention(name: str) -> AttentionFn:
    """The implementation `name` as it is (`layer_attention` is what a model calls)."""
    if name not in ATTENTION:
        raise ValueError(
            f"unknown attention implementation {name!r}; available: {', '.join(sorted(ATTENTION))}"
        )
    return ATTENTION[name]


def page_dtype(dtype: DTypeLike, kv_cache_dtype: str = "auto") -> jnp.dtype:
    """The dtype of the values KV pages hold: int8, or the model's `dtype` ("auto")."""
    return jnp.dtype(jnp.int8 if kv_cache_dtype == "int8" else dtype)


def native_unsupported(
    cfg: ModelConfig | None, dtype: DTypeLike, kv_cache_dtype: str = "auto"
) -> str | None:
    """Why the native kernel cannot serve this model's attention (None: it can), from static
    facts: the model's extras (`cfg.attention_extras`), its `dtype` and its KV pages."""
    extras = (
        {}
        if cfg is None
        else dict(
            default_scale=cfg.attention_scale == cfg.head_dim**-0.5,
            softcap=cfg.attn_logit_softcap,
            sliding_window=cfg.has_sliding_window,
        )
    )
    return native.unsupported(dtype, page_dtype(dtype, kv_cache_dtype), **extras)


def resolve_attention(
    name: str,
    cfg: ModelConfig | None = None,
    dtype: DTypeLike = jnp.float32,
    kv_cache_dtype: str = "auto",
) -> str:
    """The one choice of attention implementation, from static facts: the requested `name`
    (`CHOICES`), the model (`cfg`: its sliding windows, soft-capping, scale), its `dtype` and
    its KV pages (`kv_cache_dtype`).

    "reference" is always served. "native" is served where the kernels are loaded for this
    backend and the kernel `supports` these facts, else it is a ValueError saying why and what
    to use. "auto" is "native" where it would be served, else the reference, logged once with
    the reason. `MINIVLLM_KERNELS=reference` turns "auto" and a servable "native" into the
    reference (debugging, A/B benchmarks).

    A "native" answer means the kernels are loaded (their FFI targets registered): a program
    loaded whole from the program cache is never traced, so nothing else would load them."""
    if name not in CHOICES:
        raise ValueError(
            f"unknown attention implementation {name!r}; choose one of {', '.join(CHOICES)}"
        )
    if name == "reference":
        return name
    why = native_unsupported(cfg, dtype, kv_cache_dtype)
    if why is None and kernels.reference_forced():
        return "reference"
    if why is None:
        why = kernels.unavailable_reason()
    if why is None:
        return "native"
    if name == "native":
        raise ValueError(
            f"attention='native' cannot serve this model: {why}; use attention='auto' (the "
            "native kernel where it serves, else the reference) or 'reference'"
        )
    kernels.log_fallback_once("attention", why)
    return "reference"


def layer_attention(cfg: ModelConfig, name: str) -> AttentionFn:
    """What a model calls for attention: the implementation `name` (as `resolve_attention`
    chose it) with the model's sliding windows (per layer, by the traced layer index),
    soft-capping and scale bound in when it has any (`cfg.attention_extras`). Only the
    reference takes them: another implementation is refused rather than run without them."""
    attend = get_attention(name)
    if not cfg.attention_extras:
        return attend
    if name != "reference":
        raise ValueError(
            f"attention={name!r} does not implement {', '.join(cfg.attention_extras)}, which "
            "this model uses; use 'reference' ('auto' picks it)"
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
