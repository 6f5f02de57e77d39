"""The device-side batch of one ragged step: flat arrays whose shapes are the bucket, whose
values are the requests."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from minivllm_jax.ops.kv_cache import SCRATCH_PAGE


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepBatch:
    """One model step over `S` sequences feeding `T` new tokens in all, flat and ragged.

    Sequence `s` feeds `query_len[s]` tokens at `tokens[query_start[s]:][:query_len[s]]` (a
    decode is a chunk of 1) after `context_len[s]` tokens already in the cache. Sequences are
    contiguous and in order (`query_start` ascending). Its cached tokens live in the pages
    `page_ids[page_start[s]:][:ceil(context_len[s] / page_size)]`: all sequences' pages listed
    flat. Padding: tokens past the last sequence write the scratch page; padded sequences have
    `query_len == 0`, `context_len == 0` and start at the end of the real tokens and pages.
    """

    tokens: jax.Array  # int32[T]
    positions: jax.Array  # int32[T]  absolute position of each new token
    slot_mapping: jax.Array  # int32[T]  flat cache slot (page * page_size + offset) per new token
    query_start: jax.Array  # int32[S]
    query_len: jax.Array  # int32[S]
    context_len: jax.Array  # int32[S]  tokens cached before this step
    page_start: jax.Array  # int32[S]  where the sequence's pages begin in `page_ids`
    page_ids: jax.Array  # int32[N]

    @property
    def num_tokens(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.query_len.shape[0]


def token_sequences(batch: StepBatch) -> tuple[jax.Array, jax.Array]:
    """(traced) The sequence each token belongs to, `int32[T]`, and whether it is a real token."""
    t = jnp.arange(batch.num_tokens)
    seq = jnp.clip(
        jnp.searchsorted(batch.query_start, t, side="right", method="compare_all") - 1,
        0,
        batch.num_seqs - 1,
    )
    return seq, t < (batch.query_start + batch.query_len)[seq]


@dataclasses.dataclass(frozen=True)
class Chunk:
    """What one sequence feeds in a step: `token_ids` at cache indices `context_len...`; `pages`
    are all its pages (at least those the new tokens land in). `position_offset`: tokens dropped
    from the cache before this chunk (`minivllm_jax.engine.kv.compression`): the tokens' RoPE positions
    are `context_len + position_offset...`, while their slots and attention use `context_len`."""

    token_ids: Sequence[int]
    context_len: int
    pages: Sequence[int]
    position_offset: int = 0


def build_step_batch(
    chunks: Sequence[Chunk],
    page_size: int,
    num_tokens: int,
    num_seqs: int,
    num_listed: int,
    lookahead: int = 0,
) -> StepBatch:
    """Host (numpy) arrays of a ragged step, padded to the bucket `(num_tokens, num_seqs,
    num_listed)`. Raises ValueError if the chunks do not fit it. `lookahead`: list each
    sequence's pages for that many tokens more than its context (a multi-step decode's later
    steps read them)."""
    lens = np.array([len(c.token_ids) for c in chunks], np.int64)
    context = np.array([c.context_len for c in chunks], np.int64)
    cached_pages = -(-(context + lookahead) // page_size)
    total, listed = int(lens.sum()), int(cached_pages.sum())
    if len(chunks) > num_seqs or total > num_tokens or listed > num_listed:
        raise ValueError(
            f"{len(chunks)} sequences, {total} tokens, {listed} pages do not fit the bucket "
            f"({num_seqs}, {num_tokens}, {num_listed})"
        )
    tokens = np.zeros(num_tokens, np.int32)
    positions = np.zeros(num_tokens, np.int32)
    slots = np.full(
        num_tokens, SCRATCH_PAGE * page_size, np.int32
    )  # padding writes the scratch page
    page_ids = np.full(num_listed, SCRATCH_PAGE, np.int32)
    query_start = np.full(num_seqs, total, np.int32)
    page_start = np.full(num_seqs, listed, np.int32)
    query_len = np.zeros(num_seqs, np.int32)
    context_len = np.zeros(num_seqs, np.int32)
    t = p = 0
    for s, chunk in enumerate(chunks):
        q, c, k = int(lens[s]), int(context[s]), int(cached_pages[s])
        pages = np.asarray(chunk.pages, np.int32)
        pos = np.arange(c, c + q, dtype=np.int32)
        tokens[t : t + q] = chunk.token_ids
        positions[t : t + q] = pos + chunk.position_offset
        slots[t : t + q] = pages[pos // page_size] * page_size + pos % page_size
        page_ids[p : p + k] = pages[:k]
        query_start[s], query_len[s], context_len[s], page_start[s] = t, q, c, p
        t, p = t + q, p + k
    return StepBatch(
        tokens, positions, slots, query_start, query_len, context_len, page_start, page_ids
    )


def single_sequence_batch(
    tokens: Sequence[int], context_len: int, pages: Sequence[int], page_size: int
) -> StepBatch:
    """A step of one sequence feeding `tokens` after `context_len` cached ones (tests and the
    simple greedy loop). The page list has room for all of `pages`, so that every decode step
    of a sequence has one shape."""
    tokens = np.asarray(tokens, np.int32).reshape(-1)
    return build_step_batch(
        [Chunk(tokens, context_len, pages)], page_size, len(tokens), 1, max(1, len(pages))
    )
