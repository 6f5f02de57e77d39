"""`ModelRunner`: lays a `ScheduledBatch` out as a flat ragged `StepBatch` in its bucket and
runs the precompiled step programs.

Every program is compiled ahead of time (`jit(...).lower(...).compile()`, or loaded whole from
the program cache, `minivllm_jax.program_cache`) for one bucket shape and kept in a dict keyed
by that shape, so a shape outside the warm-up set is visible (`num_compiles` grows) rather than
a silent recompile. A step program is the model and the
sampler together (`minivllm_jax.step`); the KV cache and the penalty state are donated to it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from minivllm_jax import kernels
from minivllm_jax.attention import resolve_attention
from minivllm_jax.batch import Chunk, StepBatch, build_step_batch
from minivllm_jax.config import EngineConfig, ModelConfig, bucket_for
from minivllm_jax.engine.scheduler import ScheduledBatch
from minivllm_jax.engine.sequence import Sequence
from minivllm_jax.kv_cache import SCRATCH_PAGE, init_kv_cache
from minivllm_jax.models.llama import Params, model_dtype, unstack_layers
from minivllm_jax.program_cache import ProgramCache
from minivllm_jax.runtime import program_cache_dir
from minivllm_jax.sampler import SampleResult, make_sampling_arrays
from minivllm_jax.step import PenaltyRows, engine_step_jit, init_penalty_state, load_penalty_row_jit

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class StepResult:
    """Host copies of one step's sampled tokens, one per scheduled sequence (padding dropped)."""

    tokens: np.ndarray  # int32[n]
    logprobs: np.ndarray  # float32[n]  (zeros when no sequence asked for logprobs)
    top_ids: np.ndarray | None  # int32[S, MAX_LOGPROBS]; None when no sequence asked for logprobs
    top_logprobs: np.ndarray | None  # float32[S, MAX_LOGPROBS]


@dataclasses.dataclass(frozen=True)
class PendingStep:
    """A dispatched step whose results are still on the device; `fetch()` waits for them."""

    result: SampleResult
    num_seqs: int
    with_logprobs: bool

    def fetch(self) -> StepResult:
        r, n = self.result, self.num_seqs
        if self.with_logprobs:
            tokens, logprobs, top_ids, top_logprobs = jax.device_get((r.tokens, r.logprobs, r.top_ids, r.top_logprobs))
        else:  # the logprob arrays are placeholders: leave them on the device
            tokens, logprobs = jax.device_get((r.tokens, r.logprobs))
            top_ids = top_logprobs = None
        return StepResult(tokens[:n], logprobs[:n], top_ids, top_logprobs)


class ModelRunner:
    def __init__(self, model_config: ModelConfig, config: EngineConfig, params: Params) -> None:
        self.model_config = model_config
        self.config = config
        self.params = unstack_layers(params)  # the layout the step reads without copying weights
        self.dtype = model_dtype(params)
        self.cache = init_kv_cache(model_config, config.num_pages, config.page_size, self.dtype, config.kv_cache_dtype)
        self.penalty_state = init_penalty_state(config.max_num_seqs, model_config.vocab_size)
        self.fed_back = jnp.zeros(config.max_num_seqs, jnp.int32)  # the last step's tokens (see step.py)
        self.attention = resolve_attention(config.attention)  # loads native kernels before any program
        self.matmul = "native" if kernels.native_available() else "reference"  # quantized projections
        self._programs: dict[tuple, Any] = {}
        self._program_cache = ProgramCache(program_cache_dir())
        self.num_compiles = 0  # programs made, compiled or loaded whole from the program cache
        self.num_loaded = 0  # of which loaded
        self.compile_seconds = 0.0
        self._warm = False
        self._compile_lock = threading.Lock()

    # ------------------------------------------------------------------ compilation

    def _program(self, key: tuple, fn: Any, *args: Any, **static: Any) -> Any:
        program = self._programs.get(key)
        if program is None:
            start = time.perf_counter()
            program, loaded = self._program_cache.load_or_compile(key, fn, args, static)
            with self._compile_lock:  # warm-up compiles from several threads
                self.compile_seconds += time.perf_counter() - start
                self.num_compiles += 1
                self.num_loaded += loaded
                self._programs[key] = program
            if self._warm:
                logger.warning("compiled %s after warm-up; a bucket is missing from the warm-up set", key)
        return program

    def _step_program(self, num_tokens: int, num_seqs: int) -> Any:
        program = self._programs.get(("step", num_tokens, num_seqs))
        if program is not None:  # every step after warm-up: no abstract arguments to build
            return program
        batch = _abstract(_empty_batch(self.config, num_tokens, num_seqs))
        sampling = _abstract(make_sampling_arrays([], num_seqs))
        penalty_rows = _abstract(PenaltyRows(np.zeros(num_seqs, np.int32), np.zeros(num_seqs, np.int32), np.bool_(False)))
        return self._program(("step", num_tokens, num_seqs), engine_step_jit, self.params, self.cache,
                             self.penalty_state, self.fed_back, batch, sampling, penalty_rows,
                             cfg=self.model_config, attention=self.attention, matmul=self.matmul)  # fmt: skip

    def _load_penalty_program(self) -> Any:
        i32 = jax.ShapeDtypeStruct((), jnp.int32)
        tokens = jax.ShapeDtypeStruct((self.config.max_model_len,), jnp.int32)
        return self._program(("load_penalty_row",), load_penalty_row_jit, self.penalty_state, i32, tokens, i32, i32)

    def warmup(self, progress: bool = True) -> float:
        """Compile every bucket shape now, one program per core at a time (XLA compiles and
        loads cached programs outside the GIL: a cold start here went from 38 s to 30 s on 2
        cores), then run each once; any failure propagates (never swallowed)."""
        start = time.perf_counter()
        shapes = self.config.step_shapes()
        with ThreadPoolExecutor(max_workers=min(len(shapes), os.cpu_count() or 1)) as pool:
            compiled = pool.map(lambda shape: self._step_program(*shape), shapes)
            for _ in tqdm(compiled, total=len(shapes), desc="warm-up: compiling buckets", disable=not progress):
                pass
        self._load_penalty_program()
        for shape in shapes:
            self._exercise(*shape)
        jax.block_until_ready(self.cache)
        self._warm = True
        return time.perf_counter() - start

    def _exercise(self, num_tokens: int, num_seqs: int) -> None:
        """Run a step program once on scratch work, so its first real step does not pay the
        one-time cost of a program's first run (about 100 ms each here: a step that admitted
        a prompt was the slowest of its stream). The work touches every part of the step: a
        decode and a prompt chunk with cached context (on the scratch page), penalties."""
        ps = self.config.page_size
        chunks = [Chunk([0], ps, [SCRATCH_PAGE] * 2)]
        if num_tokens > 1 and num_seqs > 1:
            q = num_tokens - 1
            chunks.append(Chunk([0] * q, ps, [SCRATCH_PAGE] * (-(-(ps + q) // ps))))
        batch = build_step_batch(chunks, ps, num_tokens, num_seqs, self.config.num_listed_pages(num_seqs))
        scratch = np.full(num_seqs, self.penalty_state.scratch_slot, np.int32)
        rows = PenaltyRows(scratch, np.zeros(num_seqs, np.int32), np.bool_(True))
        _, self.cache, self.penalty_state, _ = self._step_program(num_tokens, num_seqs)(
            self.params, self.cache, self.penalty_state, self.fed_back, batch, make_sampling_arrays([], num_seqs), rows
        )

    # ------------------------------------------------------------------ running

    def reset_cache_if_lost(self) -> bool:
        """Rebuild an empty KV cache (and penalty state) if a failed step took the donated
        buffers with it (a donated input is deleted even when the program fails); True if it
        was rebuilt, in which case every page's contents and every slot's history are gone."""
        leaves = jax.tree.leaves((self.cache, self.penalty_state))
        if not any(leaf.is_deleted() for leaf in leaves):
            return False
        logger.warning("the KV cache buffers were lost with a failed step; rebuilding the cache")
        self.cache = init_kv_cache(self.model_config, self.config.num_pages, self.config.page_size, self.dtype,
                                   self.config.kv_cache_dtype)
        self.penalty_state = init_penalty_state(self.config.max_num_seqs, self.model_config.vocab_size)
        return True

    def run(self, batch: ScheduledBatch) -> PendingStep:
        """Dispatch one step (model and sampling in one program) and return without waiting;
        only the sampled tokens come back, when `fetch()`ed. Placeholder tokens in the batch
        (`-(row + 1)`) take the previous dispatched step's sampled token of that row."""
        step_batch = self.prepare(batch)
        seqs = batch.seqs
        num_seqs = step_batch.num_seqs
        self._load_new_penalty_rows(seqs)
        sampling = make_sampling_arrays([(s.params, s.seed, s.index, len(s.output_token_ids)) for s in seqs], num_seqs)
        program = self._step_program(step_batch.num_tokens, num_seqs)
        result, self.cache, self.penalty_state, self.fed_back = program(
            self.params, self.cache, self.penalty_state, self.fed_back, step_batch, sampling,
            self._penalty_rows(seqs, num_seqs),
        )  # fmt: skip
        return PendingStep(result, len(seqs), any(s.params.logprobs is not None for s in seqs))

    def prepare(self, batch: ScheduledBatch) -> StepBatch:
        """The flat host arrays of the step, in the smallest bucket that holds it."""
        cfg = self.config
        num_tokens = bucket_for(batch.num_tokens, cfg.token_buckets)
        num_seqs = bucket_for(len(batch.seqs), cfg.seq_buckets(num_tokens))
        chunks = [
            Chunk(seq.tokens_between(seq.num_computed_tokens, seq.num_computed_tokens + q), seq.num_computed_tokens, seq.pages)
            for seq, q in zip(batch.seqs, batch.num_new_tokens)
        ]
        return build_step_batch(chunks, cfg.page_size, num_tokens, num_seqs, cfg.num_listed_pages(num_seqs))

    def _penalty_rows(self, seqs: tuple[Sequence, ...], num_seqs: int) -> PenaltyRows:
        scratch = self.penalty_state.scratch_slot
        slots = np.full(num_seqs, scratch, np.int32)
        prompt_lens = np.zeros(num_seqs, np.int32)
        for i, seq in enumerate(seqs):
            slots[i] = scratch if seq.penalty_slot is None else seq.penalty_slot
            prompt_lens[i] = len(seq.prompt_token_ids)
        return PenaltyRows(slots, prompt_lens, np.bool_(any(s.penalty_slot is not None for s in seqs)))

    def _load_new_penalty_rows(self, seqs: tuple[Sequence, ...]) -> None:
        """A sequence that just got a penalty slot: load the tokens it will not feed itself
        (cached or forked prompt pages, or all of them after a preemption)."""
        for seq in seqs:
            if seq.penalty_slot is None or seq.penalty_loaded:
                continue
            tokens = np.zeros(self.config.max_model_len, np.int32)
            known = seq.num_computed_tokens
            tokens[:known] = seq.token_ids[:known]
            self.penalty_state = self._load_penalty_program()(
                self.penalty_state, np.int32(seq.penalty_slot), tokens, np.int32(known),
                np.int32(len(seq.prompt_token_ids)),
            )  # fmt: skip
            seq.penalty_loaded = True



def _empty_batch(config: EngineConfig, num_tokens: int, num_seqs: int) -> StepBatch:
    return build_step_batch([], config.page_size, num_tokens, num_seqs, config.num_listed_pages(num_seqs))


def _abstract(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), tree)
