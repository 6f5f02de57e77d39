"""KV compression by selective drop: which of a long sequence's cached pages to keep.

Two policies, both host-side and pure (the engine asks them which pages to keep, then frees
the others):

- "sink_window" (StreamingLLM): keep the first pages (the attention sinks: the first tokens
  draw a large share of every query's attention whatever they say, and dropping them wrecks
  the softmax) and the most recent pages (the local window), drop the middle.
- "page_scores" (H2O / SnapKV): keep those too, plus the middle pages whose keys got the most
  attention from the sequence's latest token, up to `budget_tokens` in all.

Page granularity: a page is the unit the page manager allocates and the attention kernels
gather, so dropping whole full pages frees memory at once and keeps every kernel unchanged
(the sequence's page list just gets shorter); dropping single tokens would leave holes inside
pages that every reader would have to mask. The last, partial page is never dropped.

Original positions: keys are stored after RoPE, rotated by the position they were written
at. Kept pages keep those keys exactly, and new tokens keep their true positions
(`Chunk.position_offset` = tokens dropped before them) while their slots and attention use
the shorter cache index (`context_len` = tokens computed - tokens dropped). So the relative
distances between a query and every kept key are the true ones: attention over the kept keys
is exactly what full attention would compute with the dropped keys masked out. (Re-rotating
kept keys to close the gaps, as StreamingLLM does, would need the un-rotated keys.)

Constant memory: once a sequence is past its budget, each new full page makes one page go, so
between steps it holds at most `ceil(sink / page) + ceil(window / page)` full pages
("sink_window") or `budget_tokens // page_size` ("page_scores") and its partial page, however
long it runs (plus, within a step, the pages its new tokens fill before the next drop).

Scores (`minivllm_jax.engine.step.page_attention_scores`): for each cached page, the softmax
attention mass that the sequence's last computed token's query puts on the page's keys,
summed over all layers and query heads, normalized to total 1: a one-token observation window
(SnapKV) rather than H2O's running sum, so it needs no state kept between steps.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from minivllm_jax.config import KVCompressionConfig


def _pages(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def _fixed_pages(
    config: KVCompressionConfig, num_full_pages: int, page_size: int
) -> tuple[list[int], list[int]]:
    """The always-kept pages: sinks from the front, the window from the back (they may overlap)."""
    sinks = range(min(_pages(config.sink_tokens, page_size), num_full_pages))
    window = range(max(0, num_full_pages - _pages(config.window_tokens, page_size)), num_full_pages)
    return sorted(set(sinks) | set(window)), [
        i for i in range(num_full_pages) if i not in sinks and i not in window
    ]


def _kept_full_pages_max(config: KVCompressionConfig, page_size: int) -> int:
    """The most full pages the policy keeps."""
    if config.policy == "page_scores":
        return config.budget_tokens // page_size
    return _pages(config.sink_tokens, page_size) + _pages(config.window_tokens, page_size)


def wants_compression(config: KVCompressionConfig, num_full_pages: int, page_size: int) -> bool:
    """Would `kept_pages` drop one of these full pages? (Cheap: checked every step.)"""
    config.check_page_size(page_size)
    return num_full_pages > _kept_full_pages_max(config, page_size)


def needs_scores(config: KVCompressionConfig) -> bool:
    """Does `kept_pages` need page scores (`minivllm_jax.engine.step.page_attention_scores`)?"""
    return config.policy == "page_scores"


def kept_pages(
    config: KVCompressionConfig,
    num_full_pages: int,
    page_size: int,
    scores: Sequence[float] | None = None,
) -> list[int]:
    """Indices (ascending) of the sequence's full pages to keep, out of `0..num_full_pages-1`
    (the last, partial page is not counted: the caller always keeps it).

    "sink_window": the pages covering the first `sink_tokens` and those covering the last
    `window_tokens`. "page_scores": those, plus the highest-scored other pages (`scores[i]`
    for page `i`; required; entries past the full pages are ignored) while the kept full pages
    stay within `budget_tokens`; ties keep the earlier page."""
    config.check_page_size(page_size)
    if num_full_pages < 0:
        raise ValueError(f"num_full_pages must be >= 0, got {num_full_pages}")
    if not wants_compression(config, num_full_pages, page_size):
        return list(range(num_full_pages))
    fixed, middle = _fixed_pages(config, num_full_pages, page_size)
    if config.policy == "sink_window":
        return fixed
    if scores is None or len(scores) < num_full_pages:
        raise ValueError(
            f"policy 'page_scores' needs a score for each of the {num_full_pages} full pages, "
            f"got {None if scores is None else len(scores)}"
        )
    room = _kept_full_pages_max(config, page_size) - len(fixed)
    middle_scores = np.asarray(scores, np.float64)[middle]
    best = np.argsort(-middle_scores, kind="stable")[:room]  # stable: ties go to the earlier page
    return sorted(fixed + [middle[i] for i in best])
