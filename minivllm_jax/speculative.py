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

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

MAX_BACKOFF = 64  # tokens a sequence goes without proposing after repeated misses, at most


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4  # draft tokens proposed per step, at most
    prompt_lookup_max: int = 4  # longest suffix n-gram looked up
    prompt_lookup_min: int = 2  # shortest
    # vLLM's: no drafts while more sequences than this run. A verify step feeds 1 + k rows a
    # sequence; past a few rows the step is compute-bound (on CPU, XLA's matmul of 2-8 rows
    # already costs about twice its 1-row one), so a large batch gains less than it pays.
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method != "ngram":
            raise ValueError(
                f"speculative method {self.method!r} is not supported; use 'ngram' (prompt lookup)"
            )
        if (
            not isinstance(self.num_speculative_tokens, int)
            or not 1 <= self.num_speculative_tokens <= 16
        ):
            raise ValueError(
                f"num_speculative_tokens must be an integer in [1, 16], got {self.num_speculative_tokens!r}"
            )
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
            raise ValueError(
                f"need integers 1 <= prompt_lookup_min <= prompt_lookup_max, got {lo!r} and {hi!r}"
            )
        limit = self.disable_by_batch_size
        if limit is not None and (not isinstance(limit, int) or limit < 1):
            raise ValueError(
                f"disable_by_batch_size must be a positive integer or None, got {limit!r}"
            )

    @classmethod
    def from_dict(
        cls, config: Mapping[str, Any] | SpeculativeConfig | None
    ) -> SpeculativeConfig | None:
        """vLLM's dict form. A missing `prompt_lookup_min` is 2, or `prompt_lookup_max` when
        that is smaller."""
        if config is None or isinstance(config, SpeculativeConfig):
            return config
        if not isinstance(config, Mapping):
            raise ValueError(f"speculative_config must be a dict, got {type(config).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(config) - names
        if unknown:
            raise ValueError(
                f"unknown speculative_config keys {sorted(unknown)}; accepted: {sorted(names)}"
            )
        if "method" not in config:
            raise ValueError("speculative_config needs a 'method' (only 'ngram' is supported)")
        config = dict(config)
        if "prompt_lookup_max" in config and "prompt_lookup_min" not in config:
            config["prompt_lookup_min"] = min(config["prompt_lookup_max"], cls.prompt_lookup_min)
        return cls(**config)


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
