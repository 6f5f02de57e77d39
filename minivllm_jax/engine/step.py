"""Every jit boundary of the engine: the step (model forward and sampling in one program), the
model-only forward (greedy loop, parity tests) and the penalty-row loader.

`engine_step(params, cache, penalty_state, fed_back, batch, sampling, penalty_rows)` runs the
model over the paged cache, keeps each penalty-using sequence's token history up to date on the
device, and samples every row's next token, returning only the small `SampleResult` arrays
(the `[rows, vocab]` logits never leave the program). The cache and the penalty state are
donated: the caller threads the returned ones into the next step.

Tokens fed back on the device: a step may be dispatched before the host has read the tokens
of the step before it (async scheduling). Such a token is a placeholder `-(r + 1)` in
`batch.tokens`: "the token row `r` of the previous step sampled", taken from `fed_back`
(`int32[max_num_seqs]`, the previous step's tokens as this step returns them). One compiled program per bucket
(token count, sequence count); every per-request value is an array, so nothing recompiles
when requests change. The one static argument is a `StepSpec`: what the program is compiled
for besides its argument shapes (the model config, the attention and matmul implementations,
the mesh).

Penalty state: row `s` of `PenaltyState` belongs to the sequence the scheduler gave slot `s`
(the last row is scratch: rows without penalties and padding write there). A step marks the
tokens it feeds; tokens at positions past the prompt also count as output. Tokens a sequence
did not feed itself (a prefix-cache hit, a forked prompt, a resumed sequence) are loaded once
by `load_penalty_row` when it gets its slot.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh

from minivllm_jax.config import ModelConfig
from minivllm_jax.models.decoder import forward
from minivllm_jax.models.params import ServingParams
from minivllm_jax.ops.batch import StepBatch, token_sequences
from minivllm_jax.ops.kv_cache import (
    KVCache,
    copy_pages,
    dequantize_k_blocks,
    from_bits,
    gather_pages,
    scatter_pages,
)
from minivllm_jax.ops.sampler import (
    Penalties,
    SampleResult,
    SamplingArrays,
    apply_penalties,
    sample_penalized,
)
from minivllm_jax.parallel import sharding


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """The static part of every program here: hashable, so jit takes it as one static argument
    (and the program cache keys on its repr, `minivllm_jax.engine.compilation`).

    `cfg`: the model config as the program sees the params (on a mesh, `sharding.stored_config`);
    `attention`, `matmul`: the implementations, already chosen (`ops.attention.resolve_attention`
    for attention; the matmul's is the runner's); `mesh`: tensor-parallel devices, or None for
    one device (`minivllm_jax.parallel.sharding`)."""

    cfg: ModelConfig
    attention: str = "reference"
    matmul: str = "reference"
    mesh: Mesh | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PenaltyState:
    """Per-slot token history for repetition/presence/frequency penalties (device resident)."""

    output_counts: jax.Array  # f32[slots + 1, V]  occurrences of each token in the output
    seen: jax.Array  # bool[slots + 1, V]  token in the prompt or the output

    @property
    def scratch_slot(self) -> int:
        return self.seen.shape[0] - 1


def init_penalty_state(slots: int, vocab: int) -> PenaltyState:
    return PenaltyState(
        jnp.zeros((slots + 1, vocab), jnp.float32), jnp.zeros((slots + 1, vocab), jnp.bool_)
    )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PenaltyRows:
    """Which penalty slot each sequence of the step uses (the scratch slot when it has none)."""

    slots: jax.Array  # i32[S]
    prompt_lens: jax.Array  # i32[S]  positions from here on are output tokens
    any_penalties: jax.Array  # bool[]  some row uses penalties: gather its history for the sampler


def _mark_fed_tokens(state: PenaltyState, batch: StepBatch, rows: PenaltyRows) -> PenaltyState:
    """Add this step's new tokens to their sequences' history (padding goes to the scratch row)."""
    seq, valid = token_sequences(batch)
    slot = jnp.where(valid, rows.slots[seq], state.scratch_slot)
    is_output = valid & (batch.positions >= rows.prompt_lens[seq])
    seen = state.seen.at[slot, batch.tokens].set(True, mode="drop")
    counts = state.output_counts.at[slot, batch.tokens].add(
        is_output.astype(jnp.float32), mode="drop"
    )
    return PenaltyState(counts, seen)


def engine_step(
    params: ServingParams,
    cache: KVCache,
    penalty_state: PenaltyState,
    fed_back: jax.Array,
    batch: StepBatch,
    sampling: SamplingArrays,
    penalty_rows: PenaltyRows,
    *,
    spec: StepSpec,
) -> tuple[SampleResult, KVCache, PenaltyState, jax.Array]:
    """Returns the sampled rows, the cache, the penalty state, and the tokens again padded to
    `fed_back`'s length (what the next step takes as its `fed_back`).

    With a `spec.mesh` the model runs tensor-parallel over it (`minivllm_jax.parallel.sharding`:
    `params` and `cache` sharded as `shard_params`/`cache_shardings` place them, `spec.cfg` their
    `stored_config`); the sampler runs on the gathered logits, the same on every device."""
    pending = batch.tokens < 0
    tokens = jnp.where(pending, fed_back[jnp.where(pending, -batch.tokens - 1, 0)], batch.tokens)
    batch = dataclasses.replace(batch, tokens=tokens)
    logits, cache = model_forward(params, cache, batch, spec)
    penalty_state = _mark_fed_tokens(penalty_state, batch, penalty_rows)
    slots = penalty_rows.slots

    def penalized() -> jax.Array:  # gathers [B, V] of history: only when some row needs it
        history = Penalties(penalty_state.output_counts[slots], penalty_state.seen[slots])
        return apply_penalties(logits, sampling, history)

    x = lax.cond(penalty_rows.any_penalties, penalized, lambda: logits)
    result = sample_penalized(x, logits, sampling)
    return result, cache, penalty_state, fed_back.at[: result.tokens.shape[0]].set(result.tokens)


def engine_multi_step(
    params: ServingParams,
    cache: KVCache,
    penalty_state: PenaltyState,
    fed_back: jax.Array,
    batch: StepBatch,
    sampling: SamplingArrays,
    penalty_rows: PenaltyRows,
    *,
    spec: StepSpec,
    num_steps: int = 1,
) -> tuple[SampleResult, KVCache, PenaltyState, jax.Array]:
    """`num_steps` decode steps of a decode-only `batch` (token `i` is sequence `i`'s) in one
    program: step `j` feeds what step `j - 1` sampled, at the next position, as `engine_step`
    would if the host fed it back. The batch lists each sequence's pages for the positions of
    every step (`build_step_batch(..., lookahead=num_steps)`). Returns the `SampleResult`s
    stacked on a leading `[num_steps]` axis; rows that stop early are cut by the host."""
    seq, valid = token_sequences(batch)
    page_size = cache.page_size
    live = (batch.query_len > 0).astype(jnp.int32)

    def decode(carry: tuple, j: jax.Array) -> tuple[tuple, SampleResult]:
        cache, penalty_state, fed_back = carry
        positions = batch.positions + j
        # Slots follow the cache index, not the position: they differ by the tokens a sequence
        # dropped from its cache (`Chunk.position_offset`, `minivllm_jax.engine.kv.compression`).
        index = batch.context_len[seq] + j
        page = batch.page_ids[
            jnp.clip(batch.page_start[seq] + index // page_size, 0, batch.page_ids.shape[0] - 1)
        ]
        step = dataclasses.replace(
            batch,
            tokens=jnp.where(
                (j > 0) & valid, -(seq + 1), batch.tokens
            ),  # row s's token of step j - 1
            positions=positions,
            slot_mapping=jnp.where(valid, page * page_size + index % page_size, batch.slot_mapping),
            context_len=batch.context_len + j * live,
        )
        rows = dataclasses.replace(sampling, steps=sampling.steps + j)
        result, cache, penalty_state, fed_back = engine_step(
            params,
            cache,
            penalty_state,
            fed_back,
            step,
            rows,
            penalty_rows,
            spec=spec,
        )
        return (cache, penalty_state, fed_back), result

    (cache, penalty_state, fed_back), results = lax.scan(
        decode, (cache, penalty_state, fed_back), jnp.arange(num_steps)
    )
    return results, cache, penalty_state, fed_back


def engine_verify_step(
    params: ServingParams,
    cache: KVCache,
    penalty_state: PenaltyState,
    fed_back: jax.Array,
    batch: StepBatch,
    sampling: SamplingArrays,
    penalty_rows: PenaltyRows,
    logit_rows: jax.Array,
    *,
    spec: StepSpec,
) -> tuple[SampleResult, KVCache, PenaltyState, jax.Array]:
    """`engine_step` for a speculative step: samples at the tokens `logit_rows` (`int32[R]`,
    `sampling` has a row for each): each sequence's last token and, for one with a draft, every
    draft token's position too, so that the host can check each draft token against the sample
    drawn where it was proposed (`minivllm_jax.engine.decoding.speculative`). The host reads such a step before
    scheduling the next, so it feeds no placeholders and `fed_back` passes through."""
    logits, cache = model_forward(params, cache, batch, spec, logit_rows=logit_rows)
    penalty_state = _mark_fed_tokens(penalty_state, batch, penalty_rows)
    slots = penalty_rows.slots[
        token_sequences(batch)[0][logit_rows]
    ]  # each row's sequence's history

    def penalized() -> (
        jax.Array
    ):  # a sequence with penalties proposes no draft: its one row is its last token
        history = Penalties(penalty_state.output_counts[slots], penalty_state.seen[slots])
        return apply_penalties(logits, sampling, history)

    x = lax.cond(penalty_rows.any_penalties, penalized, lambda: logits)
    return sample_penalized(x, logits, sampling), cache, penalty_state, fed_back


def model_forward(
    params: ServingParams,
    cache: KVCache,
    batch: StepBatch,
    spec: StepSpec,
    all_logits: bool = False,
    logit_rows: jax.Array | None = None,
) -> tuple[jax.Array, KVCache]:
    """`forward` (`minivllm_jax.models.decoder`: logits and the updated cache) on one device, or
    tensor-parallel over `spec.mesh` (each device runs its shard)."""
    cfg, attention, matmul, mesh = spec.cfg, spec.attention, spec.matmul, spec.mesh
    if mesh is None:
        return forward(
            params, cache, batch, cfg, attention, all_logits, matmul, logit_rows=logit_rows
        )
    local = sharding.local_config(cfg, mesh.shape[sharding.TP_AXIS])
    every = all_logits or logit_rows is not None
    shard = lambda p, c, b, axis: forward(p, c, b, local, attention, every, matmul, axis)  # noqa: E731
    logits, cache = sharding.sharded(mesh, shard)(params, cache, batch)
    return (logits if logit_rows is None else logits[logit_rows]), cache


engine_step_jit = jax.jit(
    engine_step, static_argnames=("spec",), donate_argnames=("cache", "penalty_state")
)
engine_multi_step_jit = jax.jit(
    engine_multi_step,
    static_argnames=("spec", "num_steps"),
    donate_argnames=("cache", "penalty_state"),
)
engine_verify_step_jit = jax.jit(
    engine_verify_step, static_argnames=("spec",), donate_argnames=("cache", "penalty_state")
)
# The model alone (greedy reference, parity tests): `model_forward(params, cache, batch, spec,
# all_logits=False)`.
forward_jit = jax.jit(
    model_forward, static_argnames=("spec", "all_logits"), donate_argnames=("cache",)
)


def load_penalty_row(
    state: PenaltyState,
    slot: jax.Array,
    token_ids: jax.Array,
    num_tokens: jax.Array,
    prompt_len: jax.Array,
) -> PenaltyState:
    """Reset `slot` to the history of `token_ids[:num_tokens]` (a sequence's tokens that are
    already in the cache when it gets the slot); `token_ids` is padded to a fixed length."""
    pos = jnp.arange(token_ids.shape[0])
    valid = pos < num_tokens
    vocab = state.seen.shape[1]
    ids = jnp.where(valid, token_ids, 0)
    seen = jnp.zeros((vocab,), jnp.bool_).at[ids].max(valid)
    counts = (
        jnp.zeros((vocab,), jnp.float32)
        .at[ids]
        .add((valid & (pos >= prompt_len)).astype(jnp.float32))
    )
    return PenaltyState(state.output_counts.at[slot].set(counts), state.seen.at[slot].set(seen))


load_penalty_row_jit = jax.jit(load_penalty_row, donate_argnames=("state",))


def page_attention_scores(
    params: ServingParams,
    cache: KVCache,
    batch: StepBatch,
    spec: StepSpec,
) -> jax.Array:
    """f32[N]: the attention mass the last new token of sequence 0 of `batch` puts on each page
    listed in `batch.page_ids`, summed over all layers and query heads and normalized to total 1
    (the page-score policy of `minivllm_jax.engine.kv.compression`).

    Each layer and head contributes its softmax over the sequence's `context_len` cached tokens
    only (scale `hd ** -0.5`); entries that are not the sequence's cached pages (padding, the
    pages of its new tokens) get 0. The scoring batch re-feeds a sequence's last computed token
    at its own cache index (`context_len` = cached tokens - 1), so its own key is not scored.
    The cache is read, not written: the forward's write of the re-fed token is discarded.
    `spec.mesh` is not used: on a mesh XLA partitions this program over the sharded arguments."""
    cfg = spec.cfg
    _, _, queries = forward(
        params, cache, batch, cfg, spec.attention, False, spec.matmul, return_queries=True
    )
    token = batch.query_start[0] + jnp.maximum(batch.query_len[0], 1) - 1
    q = queries[:, token].astype(jnp.float32)  # [L, H, hd]
    KVH, ps = cache.num_kv_heads, cache.page_size
    entry = (
        jnp.arange(batch.page_ids.shape[0]) - batch.page_start[0]
    )  # the entry's page index in the sequence
    key_index = entry[:, None] * ps + jnp.arange(ps)  # [N, ps]: cache index of each key
    listed = (entry >= 0)[:, None] & (key_index < batch.context_len[0])

    def layer_mass(layer: jax.Array) -> jax.Array:
        k = cache.k[layer, batch.page_ids]  # [N, KVH, hd, ps] (only the listed pages: N is small)
        if cache.quantized:
            k = dequantize_k_blocks(k, cache.k_scale[layer, batch.page_ids], jnp.float32)
        k = from_bits(k, queries.dtype).astype(jnp.float32)
        qg = (
            q[layer].reshape(KVH, -1, q.shape[-1]) * q.shape[-1] ** -0.5
        )  # [KVH, G, hd]: grouped-query heads
        scores = jnp.einsum("kgd,nkdp->kgnp", qg, k)
        scores = jnp.where(listed[None, None], scores, -jnp.inf)
        m = jnp.max(scores, axis=(2, 3), keepdims=True)
        p = jnp.exp(
            scores - jnp.where(jnp.isfinite(m), m, 0.0)
        )  # no cached key at all: zeros, not NaN
        p = p / jnp.maximum(p.sum(axis=(2, 3), keepdims=True), jnp.finfo(jnp.float32).tiny)
        return p.sum(axis=(0, 1, 3))  # [N]

    # One layer at a time: the gathered keys of every layer at once would be L times bigger.
    mass = lax.map(layer_mass, jnp.arange(cfg.num_layers, dtype=jnp.int32)).sum(0)
    return mass / jnp.maximum(mass.sum(), jnp.finfo(jnp.float32).tiny)


# Not donating the cache: scoring reads a sequence's pages between steps and changes nothing.
page_attention_scores_jit = jax.jit(page_attention_scores, static_argnames=("spec",))

# Copy-on-write of forked sequences' pages (beam search); see `kv_cache.copy_pages`.
copy_pages_jit = jax.jit(copy_pages, donate_argnames=("cache",))

# Page moves between the cache and the host (swap) or disk tier; see `kv_cache.gather_pages`.
gather_pages_jit = jax.jit(gather_pages)
scatter_pages_jit = jax.jit(scatter_pages, donate_argnames=("cache",))
