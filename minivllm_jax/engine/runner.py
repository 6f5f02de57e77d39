"""`ModelRunner`: pads a `ScheduledBatch` into its bucket and runs the precompiled programs.

Every program is compiled ahead of time (`jit(...).lower(...).compile()`) for one bucket
shape and kept in a dict keyed by that shape, so a shape outside the warm-up set is visible
(`num_compiles` grows) rather than a silent recompile. The KV cache is donated to each step.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from minivllm_jax.batch import StepBatch
from minivllm_jax.config import EngineConfig, ModelConfig, bucket_for
from minivllm_jax.engine.scheduler import ScheduledBatch
from minivllm_jax.kv_cache import SCRATCH_PAGE, init_kv_cache
from minivllm_jax.models.llama import Params, forward_jit
from minivllm_jax.sampler import Penalties, SampleResult, SamplingArrays, make_sampling_arrays, sample

logger = logging.getLogger(__name__)

_sample = jax.jit(sample)


@dataclasses.dataclass(frozen=True)
class StepResult:
    """Host copies of one step's sampled tokens (rows beyond the real batch are dropped)."""

    tokens: np.ndarray  # int32[n]
    logprobs: np.ndarray  # float32[n]
    top_ids: np.ndarray  # int32[n, MAX_LOGPROBS]
    top_logprobs: np.ndarray  # float32[n, MAX_LOGPROBS]


class ModelRunner:
    def __init__(self, model_config: ModelConfig, config: EngineConfig, params: Params) -> None:
        self.model_config = model_config
        self.config = config
        self.params = params
        self.dtype = jax.tree.leaves(params)[0].dtype
        self.cache = init_kv_cache(model_config, config.num_pages, config.page_size, self.dtype)
        self._programs: dict[tuple, Any] = {}
        self.num_compiles = 0
        self.compile_seconds = 0.0
        self._warm = False

    # ------------------------------------------------------------------ compilation

    def _program(self, key: tuple, fn: Any, *args: Any, **static: Any) -> Any:
        program = self._programs.get(key)
        if program is None:
            start = time.perf_counter()
            program = fn.lower(*args, **static).compile()
            self.compile_seconds += time.perf_counter() - start
            self.num_compiles += 1
            self._programs[key] = program
            if self._warm:
                logger.warning("compiled %s after warm-up; a bucket is missing from the warm-up set", key)
        return program

    def _step_program(self, rows: int, tokens: int, pages: int, listed: int) -> Any:
        batch = _abstract_batch(rows, tokens, pages, listed)
        key = ("step", rows, tokens, pages, listed)
        return self._program(key, forward_jit, self.params, self.cache, batch, cfg=self.model_config)

    def _sample_program(self, rows: int, penalties: bool) -> Any:
        logits = jax.ShapeDtypeStruct((rows, self.model_config.vocab_size), jnp.float32)
        arrays = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), make_sampling_arrays([], rows))
        pen = _abstract_penalties(rows, self.model_config.vocab_size) if penalties else None
        return self._program(("sample", rows, penalties), _sample, logits, arrays, pen)

    def warmup(self, progress: bool = True) -> float:
        """Compile every bucket shape now; any failure propagates (never swallowed)."""
        start = time.perf_counter()
        cfg = self.config
        steps = cfg.prefill_shapes() + cfg.decode_shapes()
        sample_rows = sorted({shape[0] for shape in steps})
        jobs = [("step", s) for s in steps] + [("sample", (r, p)) for r in sample_rows for p in (False, True)]
        for kind, shape in tqdm(jobs, desc="warm-up: compiling buckets", disable=not progress):
            if kind == "step":
                self._step_program(*shape)
            else:
                self._sample_program(*shape)
        self._warm = True
        return time.perf_counter() - start

    # ------------------------------------------------------------------ running

    def reset_cache_if_lost(self) -> bool:
        """Rebuild an empty KV cache if a failed step took the donated buffers with it (a
        donated input is deleted even when the program fails); True if it was rebuilt, in
        which case every page's contents are gone."""
        if not any(leaf.is_deleted() for leaf in jax.tree.leaves(self.cache)):
            return False
        logger.warning("the KV cache buffers were lost with a failed step; rebuilding the cache")
        self.cache = init_kv_cache(self.model_config, self.config.num_pages, self.config.page_size, self.dtype)
        return True

    def run(self, batch: ScheduledBatch) -> StepResult:
        step_batch, rows = self._prepare(batch)
        program = self._step_program(
            *step_batch.tokens.shape, step_batch.block_tables.shape[1], step_batch.page_ids.shape[0]
        )
        logits, self.cache = program(self.params, self.cache, step_batch)

        seqs = batch.seqs
        rows_params = [(s.params, s.seed, s.index, len(s.output_token_ids)) for s in seqs]
        arrays = make_sampling_arrays(rows_params, rows)
        penalties = _penalties(seqs, rows, self.model_config.vocab_size) if any(s.params.uses_penalties for s in seqs) else None
        result: SampleResult = self._sample_program(rows, penalties is not None)(logits, arrays, penalties)
        tokens, logprobs, top_ids, top_logprobs = jax.device_get(
            (result.tokens, result.logprobs, result.top_ids, result.top_logprobs)
        )
        n = len(seqs)
        return StepResult(tokens[:n], logprobs[:n], top_ids[:n], top_logprobs[:n])

    def _prepare(self, batch: ScheduledBatch) -> tuple[StepBatch, int]:
        cfg, ps = self.config, self.config.page_size
        n = len(batch.seqs)
        context = [s.num_computed_tokens for s in batch.seqs]
        past_pages = [-(-c // ps) for c in context]
        if batch.is_prefill:
            width = bucket_for(max(batch.num_new_tokens), cfg.prefill_token_buckets)
            rows = bucket_for(n, cfg.prefill_row_buckets(width))
            table_width = bucket_for(max(max(past_pages), 1), cfg.prefill_page_buckets)
        else:  # decode lists its pages flat instead of a table (see StepBatch)
            width = 1
            rows = bucket_for(n, cfg.decode_batch_buckets)
            table_width = 0

        tokens = np.zeros((rows, width), np.int32)
        positions = np.zeros((rows, width), np.int32)
        slots = np.full((rows, width), SCRATCH_PAGE * ps, np.int32)  # padding writes the scratch page
        tables = np.full((rows, table_width), SCRATCH_PAGE, np.int32)
        for i, (seq, c, q) in enumerate(zip(batch.seqs, context, batch.num_new_tokens)):
            pos = np.arange(c, c + q, dtype=np.int32)
            pages = np.asarray(seq.pages, np.int32)
            tokens[i, :q] = seq.token_ids[c : c + q]
            positions[i, :q] = pos
            slots[i, :q] = pages[pos // ps] * ps + pos % ps
            k = min(table_width, past_pages[i])
            tables[i, :k] = pages[:k]
        context_lens = np.zeros(rows, np.int32)
        query_lens = np.zeros(rows, np.int32)
        context_lens[:n] = context
        query_lens[:n] = batch.num_new_tokens
        step = StepBatch(tokens, positions, slots, tables, context_lens, query_lens)
        if not batch.is_prefill:
            step = dataclasses.replace(step, **_page_list(batch.seqs, context, past_pages, rows, cfg))
        return step, rows


def _page_list(seqs, context: list[int], past_pages: list[int], rows: int, cfg: EngineConfig) -> dict[str, np.ndarray]:
    """The decode step's flat page list: every row's cached pages in row order, padded to a bucket
    with scratch-page entries of length 0 owned by the last row (keeps `page_rows` sorted)."""
    ps, total = cfg.page_size, sum(past_pages)
    length = bucket_for(max(total, 1), cfg.page_list_buckets(rows))
    ids = np.full(length, SCRATCH_PAGE, np.int32)
    owners = np.full(length, rows - 1, np.int32)
    lens = np.zeros(length, np.int32)
    counts = np.asarray(past_pages)
    ids[:total] = np.concatenate([np.asarray(s.pages[:k], np.int32) for s, k in zip(seqs, past_pages)])
    owners[:total] = np.repeat(np.arange(len(seqs), dtype=np.int32), counts)
    first = np.repeat(np.cumsum(counts) - counts, counts)  # list index of each row's first page
    lens[:total] = np.minimum(ps, np.repeat(np.asarray(context), counts) - (np.arange(total) - first) * ps)
    return {"page_ids": ids, "page_rows": owners, "page_lens": lens}


def _abstract_batch(rows: int, tokens: int, pages: int, listed: int) -> StepBatch:
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    return StepBatch(i32(rows, tokens), i32(rows, tokens), i32(rows, tokens), i32(rows, pages), i32(rows), i32(rows),
                     i32(listed), i32(listed), i32(listed))  # fmt: skip


def _abstract_penalties(rows: int, vocab: int) -> Penalties:
    return Penalties(
        output_counts=jax.ShapeDtypeStruct((rows, vocab), jnp.float32),
        prompt_mask=jax.ShapeDtypeStruct((rows, vocab), jnp.bool_),
    )


def _penalties(seqs: tuple, rows: int, vocab: int) -> Penalties:
    counts = np.zeros((rows, vocab), np.float32)
    seen = np.zeros((rows, vocab), np.bool_)
    for i, seq in enumerate(seqs):
        if seq.output_token_ids:
            counts[i] = np.bincount(seq.output_token_ids, minlength=vocab)[:vocab]
        seen[i, seq.token_ids] = True
    return Penalties(output_counts=counts, prompt_mask=seen)
