"""Batched, jittable next-token sampling; per-row settings are arrays, so mixing requests never recompiles.

The CPU shapes the code (batch 64 x 49k vocab, 2 cores): a max pass costs ~0.4 ms and an exp
pass ~2 ms, but `jnp.argmax` ~8 ms, `lax.top_k` ~7 ms and a full sort ~800 ms. So argmax and
top-k look inside the best 64-wide chunks only, a draw is a two-level inverse CDF (one exp pass,
two uniforms a row), top-k/top-p take their cut from the best FILTER_K logits and bisect over the
vocab only when a row's cut lies deeper, and each optional stage sits behind a batch-level
`lax.cond`. A row's result depends only on its logits, settings, seed and step, never on its
batch mates, its position or the batch size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from minivllm_jax.sampling_params import MAX_LOGPROBS, SamplingParams

CHUNK = 64  # vocab chunk for two-level top-k and sampling
FILTER_K = 64  # top-k/top-p cuts within the best FILTER_K logits need no vocab-wide search


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingArrays:
    """Per-row sampling settings; padded rows are greedy and ignored."""

    temperature: jax.Array  # f32[B]  0 = greedy
    top_k: jax.Array  # i32[B]  <= 0 or >= vocab: off
    top_p: jax.Array  # f32[B]  1 = off
    min_p: jax.Array  # f32[B]  0 = off
    seeds: jax.Array  # u32[B, 2]  threefry key data of the request's seed
    sample_index: jax.Array  # i32[B]  which of the request's n samples the row is
    steps: jax.Array  # i32[B]  tokens the row generated so far
    presence_penalty: jax.Array  # f32[B]
    frequency_penalty: jax.Array  # f32[B]
    repetition_penalty: jax.Array  # f32[B]
    want_logprobs: jax.Array  # bool[B]  logprob outputs are skipped when no row wants them
    # Structured output: bit `t % 32` of word `t // 32` allows token `t` (all ones: no
    # constraint); the masking is skipped when `use_bitmask` is False (no constrained row).
    token_bitmask: jax.Array  # i32[B, ceil(V / 32)]
    use_bitmask: jax.Array  # bool[]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Penalties:
    """Token history for penalties; pass `None` to `sample` to skip that code entirely."""

    output_counts: jax.Array  # f32[B, V]  occurrences of each token in the row's output
    prompt_mask: jax.Array  # bool[B, V]  token seen in prompt or output (repetition penalty)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SampleResult:
    """Logprobs are the model's raw log-softmax (before penalties, temperature, top-k/p and
    min-p), as OpenAI and vLLM report them by default."""

    tokens: jax.Array  # i32[B]
    logprobs: jax.Array  # f32[B]  of `tokens`; 0 in batches where no row wants logprobs
    top_ids: jax.Array  # i32[B, MAX_LOGPROBS]  best first; -1 past the vocab
    top_logprobs: jax.Array  # f32[B, MAX_LOGPROBS]  descending; -inf past the vocab


SampleRow = tuple[SamplingParams, int, int, int]  # (params, request seed, sample index, step)

# One row's settings as the device arrays hold them, typed once when a request is added
# (`sampling_row`): building a step's arrays then only copies these records.
SAMPLING_ROW_DTYPE = np.dtype(
    [
        ("temperature", np.float32),
        ("top_k", np.int32),
        ("top_p", np.float32),
        ("min_p", np.float32),
        ("seed_hi", np.uint32),
        ("seed_lo", np.uint32),
        ("sample_index", np.int32),
        ("presence_penalty", np.float32),
        ("frequency_penalty", np.float32),
        ("repetition_penalty", np.float32),
        ("want_logprobs", np.bool_),
    ]
)


def sampling_row(params: SamplingParams, seed: int, sample_index: int) -> np.ndarray:
    """The device-typed record of one sample's settings (a 0-d `SAMPLING_ROW_DTYPE` array).
    Raises ValueError if a value does not fit its device type (SamplingParams' ranges make
    that impossible; this is the check that keeps a bad row out of every later step)."""
    if not 0 <= seed < 2**64:
        raise ValueError(f"seed must fit 64 bits unsigned, got {seed}")
    try:
        return np.array(
            (
                params.temperature,
                params.top_k,
                params.top_p,
                params.min_p,
                (seed >> 32) & 0xFFFFFFFF,
                seed & 0xFFFFFFFF,
                sample_index,
                params.presence_penalty,
                params.frequency_penalty,
                params.repetition_penalty,
                params.logprobs is not None,
            ),
            SAMPLING_ROW_DTYPE,
        )
    except (OverflowError, TypeError) as e:
        raise ValueError(f"sampling settings do not fit the device arrays: {e}") from e


GREEDY_ROW = sampling_row(SamplingParams(temperature=0.0), 0, 0)  # what padded rows hold


def make_sampling_arrays(rows: list[SampleRow], batch_size: int, vocab_size: int) -> SamplingArrays:
    """Host-side (numpy) arrays for `(params, seed, sample_index, step)` rows, padded to
    `batch_size` greedy rows; every token allowed (`token_bitmask` is filled by the caller for
    rows under a grammar, which then sets `use_bitmask`)."""
    prepared = [(sampling_row(params, seed, index), step) for params, seed, index, step in rows]
    return sampling_arrays(prepared, batch_size, vocab_size)


def sampling_arrays(
    rows: list[tuple[np.ndarray, int]], batch_size: int, vocab_size: int
) -> SamplingArrays:
    """`make_sampling_arrays` from prepared `(sampling_row(...), step)` pairs: only copies."""
    if len(rows) > batch_size:
        raise ValueError(f"{len(rows)} rows do not fit a batch of {batch_size}")
    table = np.full(batch_size, GREEDY_ROW, SAMPLING_ROW_DTYPE)
    steps = np.zeros(batch_size, np.int32)
    for i, (row, step) in enumerate(rows):
        table[i], steps[i] = row, step
    column = lambda name: np.ascontiguousarray(table[name])
    return SamplingArrays(
        temperature=column("temperature"),
        top_k=column("top_k"),
        top_p=column("top_p"),
        min_p=column("min_p"),
        seeds=np.stack([table["seed_hi"], table["seed_lo"]], axis=1),
        sample_index=column("sample_index"),
        steps=steps,
        presence_penalty=column("presence_penalty"),
        frequency_penalty=column("frequency_penalty"),
        repetition_penalty=column("repetition_penalty"),
        want_logprobs=column("want_logprobs"),
        token_bitmask=np.full((batch_size, -(-vocab_size // 32)), -1, np.int32),
        use_bitmask=np.bool_(False),
    )


def apply_token_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """Disallowed tokens (a 0 bit in the row's `int32[ceil(V / 32)]` words) get -inf."""
    bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    allowed = bits.reshape(bitmask.shape[0], -1)[:, : logits.shape[1]].astype(jnp.bool_)
    return jnp.where(allowed, logits, -jnp.inf)


def apply_penalties(logits: jax.Array, a: SamplingArrays, pen: Penalties) -> jax.Array:
    """HF repetition penalty on seen tokens, then OpenAI presence/frequency on output tokens."""
    r = a.repetition_penalty[:, None]
    x = jnp.where(pen.prompt_mask, jnp.where(logits > 0, logits / r, logits * r), logits)
    counts = pen.output_counts
    return x - a.frequency_penalty[:, None] * counts - a.presence_penalty[:, None] * (counts > 0)


def _chunks(x: jax.Array, fill: float) -> jax.Array:
    """[B, V] -> [B, V/CHUNK, CHUNK], padding the vocab with `fill`."""
    pad = -x.shape[1] % CHUNK
    return jnp.pad(x, ((0, 0), (0, pad)), constant_values=fill).reshape(x.shape[0], -1, CHUNK)


def _top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """Same as `lax.top_k` (ties: lower id first) but ~5x faster on CPU for a big vocab: the best
    k values lie in the k chunks with the largest maxima, so only those are ranked."""
    if x.shape[1] <= 4 * k * CHUNK:
        return lax.top_k(x, k)
    xc = _chunks(x, -jnp.inf)
    _, ci = lax.top_k(jnp.max(xc, -1), k)
    ci = jnp.sort(ci, -1)  # keep candidates in vocab order so ties still prefer lower ids
    vals, j = lax.top_k(jnp.take_along_axis(xc, ci[:, :, None], 1).reshape(x.shape[0], -1), k)
    return vals, jnp.take_along_axis(ci, j // CHUNK, 1) * CHUNK + j % CHUNK


def _first_argmax(x: jax.Array) -> jax.Array:
    """`jnp.argmax` (first index on ties) ~10x faster on CPU: the best chunk, then the best in it."""
    xc = _chunks(x, -jnp.inf)
    c = jnp.argmax(jnp.max(xc, -1), -1)
    return c * CHUNK + jnp.argmax(jnp.take_along_axis(xc, c[:, None, None], 1)[:, 0], -1)


def _bisect(pred: Callable[[jax.Array], jax.Array], batch: int) -> jax.Array:
    """Largest t in [0, 1] with `pred(t[:, None])` per row (pred(0) holds): 30 steps over float bits."""

    def step(_, lohi):
        lo, hi = lohi
        mid = lo + (hi - lo) // 2
        ok = pred(lax.bitcast_convert_type(mid, jnp.float32)[:, None])
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    lo, hi = (
        jnp.zeros((batch,), jnp.int32),
        jnp.full((batch,), 0x3F800001, jnp.int32),
    )  # bits(1.0) + 1
    lo, _ = lax.fori_loop(0, 30, step, (lo, hi))
    return lax.bitcast_convert_type(lo, jnp.float32)


def _weights(v: jax.Array, m: jax.Array, t: jax.Array, cut: jax.Array) -> jax.Array:
    """Unnormalized probabilities exp((v - max) / T) of the kept logits (v >= cut), rows first."""
    col = lambda r: r.reshape(r.shape + (1,) * (v.ndim - 1))
    return jnp.where(v >= col(cut), jnp.exp((v - col(m)) / col(t)), 0.0)


def _top_k_top_p_cut(x: jax.Array, m: jax.Array, t: jax.Array, a: SamplingArrays) -> jax.Array:
    """Logit cut for top-k then top-p (on the top-k mass, renormalized): keep `x >= cut`.

    The cut comes from the best FILTER_K logits; rows whose cut lies deeper get it by bisection
    over the whole vocab (~30 passes, so rarer is better: raise FILTER_K if it is common)."""
    B, V = x.shape
    k = jnp.where((a.top_k > 0) & (a.top_k < V), a.top_k, V)
    active = (a.temperature > 0) & ((k < V) | (a.top_p < 1))  # greedy rows ignore filters
    K = min(FILTER_K, V)
    topv, _ = _top_k(x, K)
    pk = jnp.where(
        jnp.arange(K) < k[:, None], _weights(topv, m, t, jnp.full_like(m, -jnp.inf)), 0.0
    )
    full_mass = lambda: jnp.sum(
        _weights(x, m, t, jnp.full_like(m, -jnp.inf)), -1
    )  # an exp pass: only for top-p alone
    mass_k = jnp.where(
        k <= K, jnp.sum(pk, -1), lax.cond(jnp.any(active & (k == V)), full_mass, lambda: m)
    )
    n_p = jnp.sum(jnp.cumsum(pk, -1) < (a.top_p * mass_k)[:, None], -1) + 1  # K+1: cut is deeper
    n = jnp.where(a.top_p < 1, jnp.minimum(n_p, k), k)
    fits = ~active | ((n <= K) & ((k <= K) | (k == V)))  # a top-k mass beyond K is unknown here
    cut = jnp.where(
        active & fits,
        jnp.take_along_axis(topv, jnp.clip(n - 1, 0, K - 1)[:, None], 1)[:, 0],
        -jnp.inf,
    )

    def deep() -> jax.Array:  # bisection on probabilities, then back to a logit cut
        p = _weights(x, m, t, jnp.full_like(m, -jnp.inf))
        zero = jnp.zeros((B,), jnp.float32)
        by_count = lambda: _bisect(lambda c: jnp.sum(p >= c, -1) >= k, B)
        k_cut = lax.cond(
            jnp.any(~fits & (k < V)), by_count, lambda: zero
        )  # k == V: keep all anyway
        target = a.top_p * jnp.sum(jnp.where(p >= k_cut[:, None], p, 0.0), -1)
        mass = lambda c: jnp.sum(jnp.where(p >= jnp.maximum(c, k_cut[:, None]), p, 0.0), -1)
        by_mass = lambda: _bisect(lambda c: mass(c) >= target, B)
        p_cut = lax.cond(jnp.any(~fits & (a.top_p < 1)), by_mass, lambda: zero)
        p_cut = jnp.where(a.top_p < 1, jnp.maximum(p_cut, k_cut), k_cut)
        return jnp.where(fits, cut, jnp.min(jnp.where(p >= p_cut[:, None], x, jnp.inf), -1))

    return lax.cond(jnp.all(fits), lambda: cut, deep)


def _categorical(
    x: jax.Array, m: jax.Array, t: jax.Array, cut: jax.Array, u: jax.Array
) -> jax.Array:
    """Draw a kept token by inverse CDF without materializing probabilities: a chunk by its mass
    with u[:, 0], then a token inside it with u[:, 1]. Zero-weight tokens are never returned."""
    xc = _chunks(x, -jnp.inf)
    mass = jnp.sum(_weights(xc, m, t, cut), -1)

    def pick(w: jax.Array, r: jax.Array) -> jax.Array:
        cum = jnp.cumsum(w, -1)
        last = jnp.max(jnp.where(w > 0, lax.broadcasted_iota(jnp.int32, w.shape, 1), 0), -1)
        return jnp.minimum(jnp.sum(cum <= r[:, None] * cum[:, -1:], -1), last)

    c = pick(mass, u[:, 0])
    inner = _weights(jnp.take_along_axis(xc, c[:, None, None], 1)[:, 0], m, t, cut)
    return c * CHUNK + pick(inner, u[:, 1])


def row_keys(a: SamplingArrays) -> jax.Array:
    """Each row's key: fold_in(fold_in(key(seed), sample_index), step). Sample i of a request
    has its own stream, unrelated to any other seed's (`seed + i` would equal seed+1's sample 0)."""

    def key(seed: jax.Array, index: jax.Array, step: jax.Array) -> jax.Array:
        base = jax.random.wrap_key_data(seed, impl="threefry2x32")
        return jax.random.fold_in(jax.random.fold_in(base, index), step)

    return jax.vmap(key)(a.seeds, a.sample_index, a.steps)


def _sample_random(x: jax.Array, m: jax.Array, a: SamplingArrays) -> jax.Array:
    """Temperature, top-k, top-p, min-p, then a draw keyed by (seed, step) only; greedy rows too."""
    t = jnp.where(a.temperature > 0, a.temperature, 1.0)
    needs_cut = jnp.any(
        (a.temperature > 0) & (((a.top_k > 0) & (a.top_k < x.shape[1])) | (a.top_p < 1))
    )
    cut = lax.cond(
        needs_cut, lambda: _top_k_top_p_cut(x, m, t, a), lambda: jnp.full_like(m, -jnp.inf)
    )
    cut = jnp.maximum(cut, m + t * jnp.log(a.min_p))  # min-p: p >= min_p * p_max; log(0) = -inf
    u = jax.vmap(lambda key: jax.random.uniform(key, (2,)))(row_keys(a))
    greedy = (a.temperature <= 0)[:, None]  # keep only the max and draw u = 0: its first index
    return _categorical(x, m, t, jnp.where(greedy[:, 0], m, cut), jnp.where(greedy, 0.0, u))


def sample(
    logits: jax.Array, arrays: SamplingArrays, penalties: Penalties | None = None
) -> SampleResult:
    """Next token per row; greedy rows (temperature 0) take the argmax of the penalized logits.
    Logprobs are reported under the raw logits (see `SampleResult`)."""
    raw = logits.astype(jnp.float32)
    x = raw if penalties is None else apply_penalties(raw, arrays, penalties)
    return sample_penalized(x, raw, arrays)


def sample_penalized(x: jax.Array, raw: jax.Array, arrays: SamplingArrays) -> SampleResult:
    """`sample` for logits `x` that already carry the penalties; `raw` (float32, the model's
    own logits) gives the logprobs. A structured-output row samples among its allowed tokens."""
    x = lax.cond(
        arrays.use_bitmask, lambda: apply_token_bitmask(x, arrays.token_bitmask), lambda: x
    )
    m = jnp.max(x, -1)
    greedy = lambda: _first_argmax(x)
    is_random = arrays.temperature > 0  # all-greedy batches take the cheaper argmax
    tokens = lax.cond(jnp.any(is_random), lambda: _sample_random(x, m, arrays), greedy)

    def with_logprobs() -> tuple[jax.Array, jax.Array, jax.Array]:
        m_raw = jnp.max(raw, -1)
        lse = m_raw + jnp.log(jnp.sum(jnp.exp(raw - m_raw[:, None]), -1))
        vals, ids = _top_k(raw, min(MAX_LOGPROBS, raw.shape[1]))
        pad = ((0, 0), (0, MAX_LOGPROBS - ids.shape[1]))  # a vocab smaller than MAX_LOGPROBS
        top_lp = jnp.pad(vals - lse[:, None], pad, constant_values=-jnp.inf)
        chosen = jnp.take_along_axis(raw, tokens[:, None], 1)[:, 0] - lse
        return chosen, jnp.pad(ids, pad, constant_values=-1), top_lp

    shape = (x.shape[0], MAX_LOGPROBS)
    without = lambda: (
        jnp.zeros(shape[:1]),
        jnp.full(shape, -1, jnp.int32),
        jnp.full(shape, -jnp.inf),
    )
    lp, top_ids, top_lp = lax.cond(jnp.any(arrays.want_logprobs), with_logprobs, without)
    return SampleResult(tokens.astype(jnp.int32), lp, top_ids.astype(jnp.int32), top_lp)
