"""Speculative decoding by n-gram prompt lookup (vLLM's `ngram` method), configured as in vLLM:
`speculative_config={"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": n,
"prompt_lookup_min": m}`.

A sequence whose last `m..n` tokens occurred earlier in its own prompt + output proposes the up
to `k` tokens that followed that occurrence (the longest such suffix, its latest occurrence).
One step feeds the last token and the draft and samples a token at every position, each with
the key of the output index it would have without speculation (`sampler.row_keys`); the draft
is accepted while it equals those samples, and the first sample that differs (or the one after
the whole draft) is the step's last token. Against a draft that is one fixed token, drawing
`x ~ p` and accepting when `x == d` is rejection sampling exactly: `d` is kept with
probability `p(d)`, and a rejected position emits `x`, distributed as `p` without `d`,
renormalized. So outputs are distributed as without speculation, and for a seeded request they
are the same tokens. Greedy rows take the argmax, which is the greedy rule.

Lookups that find nothing or drafts of which nothing is accepted back a sequence off for a
number of tokens that doubles each time (up to `MAX_BACKOFF`), so speculation switches itself
off where the text does not repeat.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from minivllm_jax.config import SpeculativeConfig

MAX_BACKOFF = 64  # tokens a sequence goes without proposing after repeated misses, at most


def propose_ngram(tokens: Sequence[int], config: SpeculativeConfig, max_tokens: int) -> list[int]:
    """Up to `max_tokens` tokens that followed the latest earlier occurrence of the longest
    suffix of `tokens` (between `prompt_lookup_min` and `prompt_lookup_max` tokens long)."""
    if max_tokens <= 0:
        return []
    ids = np.asarray(tokens, np.int64)
    for n in range(min(config.prompt_lookup_max, len(ids) - 1), config.prompt_lookup_min - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(
            ids[:-1], n
        )  # windows that have a next token
        hits = np.flatnonzero((windows == ids[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return ids[start : start + max_tokens].tolist()
    return []


def accepted_length(draft: Sequence[int], sampled: Sequence[int]) -> int:
    """How many draft tokens equal the tokens sampled at their positions, from the first on
    (`sampled[j]` was drawn where `draft[j]` was proposed)."""
    n = 0
    while n < len(draft) and draft[n] == sampled[n]:
        n += 1
    return n
