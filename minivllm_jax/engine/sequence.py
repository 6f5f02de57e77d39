"""`Sequence`: one sample stream of one request, as the host sees it."""

from __future__ import annotations

import enum
import itertools
import time
from typing import TYPE_CHECKING

from minivllm_jax.ops.sampler import sampling_row
from minivllm_jax.outputs import TokenLogprobs
from minivllm_jax.sampling_params import SamplingParams

if TYPE_CHECKING:
    from minivllm_jax.config import KVCompressionConfig
    from minivllm_jax.engine.decoding.structured_output import Grammar
    from minivllm_jax.engine.kv.swap import SwappedKV

_seq_counter = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Token ids, pages and progress of one sample.

    `num_computed_tokens` tokens have their K/V in the cache (pages in `pages`, in order).
    A step feeds `token_ids[num_computed_tokens:]` (all of it, or a chunk of a long prefill)
    and samples the next token from the last fed position.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        index: int = 0,
        priority: int = 0,
        seed: int = 0,
        arrival_time: float | None = None,
        streaming: bool = True,
        cache_salt: str | None = None,
    ) -> None:
        self.seq_id = next(_seq_counter)
        self.request_id = request_id
        self.index = index
        self.prompt_token_ids = list(prompt_token_ids)
        # With async scheduling the last one or two may be placeholders (`num_pending`) for
        # tokens an in-flight step samples; the engine fills them in when it reads the step.
        self.output_token_ids: list[int] = []
        self.num_pending = 0
        self.params = params
        self.priority = priority
        self.seed = seed  # the request's PRNG seed: tokens depend only on (seed, index, step)
        # Its row of the step's sampling arrays, typed now: a value that does not fit raises
        # ValueError here, where the request is added, never inside a step.
        self.sampling_row = sampling_row(params, seed, index)
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.streaming = streaming  # a client reads tokens as they come: its TPOT matters
        self.cache_salt = (
            cache_salt  # prefix-cache pages are shared only with requests of the same salt
        )
        self.status = SequenceStatus.WAITING
        self.pages: list[int] = []
        self.page_hashes: list[bytes] = []  # prefix-cache digest of each full, computed page
        self.num_computed_tokens = 0
        self.num_cached_tokens = (
            0  # prompt tokens served by the prefix cache (memory or disk) on admission
        )
        self.swapped: SwappedKV | None = None  # its computed pages while swapped out (preemption)
        # KV compression (`minivllm_jax.engine.kv.compression`): tokens whose pages were dropped. Its
        # K/V slots are then `len(self) - num_dropped_tokens`; positions stay the true ones.
        self.kv_compression: KVCompressionConfig | None = None
        self.num_dropped_tokens = 0
        # Structured output: the matcher of its grammar, advanced by each token read (set when
        # the grammar is compiled, before the sequence is scheduled).
        self.grammar: Grammar | None = None
        self.logprobs: list[TokenLogprobs] = []
        self.cumulative_logprob = 0.0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.penalty_slot: int | None = None  # row of the device penalty state, while running
        self.penalty_loaded = False  # that row holds this sequence's history
        # Speculative decoding (`minivllm_jax.engine.decoding.speculative`): no proposal before this many
        # output tokens, after misses; the wait doubles with each miss in a row.
        self.spec_resume_at = 0
        self.spec_backoff = 0

    def __len__(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def __repr__(self) -> str:
        return f"Sequence({self.request_id}#{self.index}, {self.status.value}, len={len(self)}, pages={len(self.pages)})"

    @property
    def known_output_token_ids(self) -> list[int]:
        """The output tokens the host has read (pending placeholders left out)."""
        return self.output_token_ids[: len(self.output_token_ids) - self.num_pending]

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def tokens_between(self, start: int, end: int) -> list[int]:
        """`token_ids[start:end]` without building the whole list (a decode reads one token)."""
        n = len(self.prompt_token_ids)
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:end] + self.output_token_ids[: max(0, end - n)]

    @property
    def cache_len(self) -> int:
        """KV slots its tokens take: all of them, less those whose pages were dropped."""
        return len(self) - self.num_dropped_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self) - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """More than one token to feed: a fresh prompt, a chunk remainder or a recompute."""
        return self.num_uncomputed_tokens > 1

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def sort_key(self) -> tuple[int, float, int]:
        """Lower is served first: priority value (vLLM: smaller = more urgent), then arrival."""
        return (self.priority, self.arrival_time, self.seq_id)
