"""The device-side batch: plain arrays whose shapes are the bucket, whose values are the requests."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepBatch:
    """One model step over `B` rows of `T` new tokens each (decode: `T == 1`).

    Row `b` already has `context_lens[b]` tokens in the cache and feeds `query_lens[b] <= T` new
    ones; the rest of the row is padding. Padded rows have `query_lens == 0` and scratch slots.

    The cached tokens are reached in one of two ways. A block table (`[B, P]`) pads every row
    to the widest one; prefill steps use it. Decode steps instead list the past pages of all
    rows flat (`page_ids`, `page_rows`, `page_lens`, length `N`, a bucket of the real total) and
    have a zero-width block table, so attention reads only pages that hold tokens: in a mixed
    batch most of a padded table is empty. Padding entries of the list point at the scratch
    page with `page_lens == 0`, owned by the last row (the list stays sorted by row).
    """

    tokens: jax.Array  # int32[B, T]
    positions: jax.Array  # int32[B, T]   absolute position of each new token
    slot_mapping: jax.Array  # int32[B, T]   flat cache slot (page * page_size + offset) per new token
    block_tables: jax.Array  # int32[B, P]   pages holding the row's earlier tokens
    context_lens: jax.Array  # int32[B]      tokens already cached before this step
    query_lens: jax.Array  # int32[B]      valid new tokens in this step
    page_ids: jax.Array = dataclasses.field(default_factory=lambda: np.zeros(0, np.int32))  # int32[N]
    page_rows: jax.Array = dataclasses.field(default_factory=lambda: np.zeros(0, np.int32))  # int32[N] sorted
    page_lens: jax.Array = dataclasses.field(default_factory=lambda: np.zeros(0, np.int32))  # int32[N] 0..page_size


def single_sequence_batch(
    tokens: np.ndarray, context_len: int, pages: list[int], page_size: int, width: int | None = None
) -> StepBatch:
    """A batch of one row feeding `tokens` after `context_len` cached ones (tests, simple decode).

    The row's pages come as a block table of `width` (default: all of `pages`), or, for a
    decode step (one token), as a flat page list of that length, like the engine's decode."""
    tokens = np.asarray(tokens, np.int32).reshape(1, -1)
    T = tokens.shape[1]
    positions = context_len + np.arange(T, dtype=np.int32)
    pages_arr = np.asarray(pages, np.int32)
    slots = pages_arr[positions // page_size] * page_size + positions % page_size
    table = np.zeros((1, width or max(1, len(pages))), np.int32)
    table[0, : len(pages)] = pages_arr
    batch = StepBatch(
        tokens=tokens,
        positions=positions[None],
        slot_mapping=slots[None].astype(np.int32),
        block_tables=table,
        context_lens=np.array([context_len], np.int32),
        query_lens=np.array([T], np.int32),
    )
    if T > 1:
        return batch
    starts = np.arange(table.shape[1], dtype=np.int32) * page_size  # entries past the context: length 0
    return dataclasses.replace(
        batch,
        block_tables=np.zeros((1, 0), np.int32),
        page_ids=table[0],
        page_rows=np.zeros(table.shape[1], np.int32),
        page_lens=np.clip(context_len - starts, 0, page_size).astype(np.int32),
    )
