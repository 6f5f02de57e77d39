"""`ModelRunner`: lays a `ScheduledBatch` out as a flat ragged `StepBatch` in its bucket,
dispatches the precompiled step program, and hands back its results to fetch (`PendingStep`).

A step program is the model and the sampler together (`minivllm_jax.engine.step`), compiled
ahead of time for one bucket shape (`compilation.CompileManager`: a shape outside the warm-up
set is visible, never a silent recompile). The runner hands its other concerns to the managers
it builds over one `DeviceState` (the KV cache, penalty state and fed-back tokens each program
donates and returns): `page_mover` (page copies: swap, disk tier, copy-on-write) and
`penalty_slots` (the penalty state's rows).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from minivllm_jax import kernels
from minivllm_jax.config import EngineConfig, ModelConfig, bucket_for
from minivllm_jax.engine.compilation import CompileManager, ProgramCache
from minivllm_jax.engine.decoding.structured_output import fill_bitmasks
from minivllm_jax.engine.device_state import DeviceState
from minivllm_jax.engine.kv.compression import needs_scores
from minivllm_jax.engine.kv.page_mover import PageMover
from minivllm_jax.engine.penalty_slots import PenaltySlots
from minivllm_jax.engine.runtime import program_cache_dir
from minivllm_jax.engine.sched_output import ScheduledBatch
from minivllm_jax.engine.sequence import Sequence
from minivllm_jax.engine.step import (
    PenaltyRows,
    StepSpec,
    engine_multi_step_jit,
    engine_step_jit,
    engine_verify_step_jit,
    page_attention_scores_jit,
)
from minivllm_jax.models.params import ServingParams, model_dtype
from minivllm_jax.ops.attention import resolve_attention
from minivllm_jax.ops.batch import Chunk, StepBatch, build_step_batch
from minivllm_jax.ops.kv_cache import SCRATCH_PAGE, KVCache
from minivllm_jax.ops.sampler import (
    SampleResult,
    SamplingArrays,
    make_sampling_arrays,
    sampling_arrays,
)
from minivllm_jax.parallel import distributed, sharding
from minivllm_jax.parallel.distributed import StepChannel

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

    result: SampleResult  # of a multi-step program: stacked, [num_steps, ...]
    num_rows: int  # real rows: one per sequence (a verify step: one per token)
    with_logprobs: bool
    num_steps: int = 1
    # (tokens, rows) the compiled program computes: padding included
    bucket: tuple[int, int] = (0, 0)

    def fetch(self) -> list[StepResult]:
        """One `StepResult` per decode step the program ran, in order."""
        r, n = self.result, self.num_rows
        if self.with_logprobs:
            tokens, logprobs, top_ids, top_logprobs = jax.device_get(
                (r.tokens, r.logprobs, r.top_ids, r.top_logprobs)
            )
        else:  # the logprob arrays are placeholders: leave them on the device
            tokens, logprobs = jax.device_get((r.tokens, r.logprobs))
            top_ids = top_logprobs = None
        if self.num_steps == 1:
            return [StepResult(tokens[:n], logprobs[:n], top_ids, top_logprobs)]
        return [
            StepResult(
                tokens[j, :n],
                logprobs[j, :n],
                None if top_ids is None else top_ids[j],
                None if top_logprobs is None else top_logprobs[j],
            )
            for j in range(self.num_steps)
        ]


class RowsFailed(Exception):
    """Preparing some rows of a step on the host failed; nothing was dispatched. `errors`: each
    failing row's index in the batch and what it raised (the other rows are fine)."""

    def __init__(self, errors: dict[int, Exception]) -> None:
        super().__init__("; ".join(f"row {i}: {type(e).__name__}: {e}" for i, e in errors.items()))
        self.errors = errors


class ModelRunner:
    """`mesh`: the devices the model runs on. Several: tensor-parallel (`minivllm_jax.parallel.sharding`):
    params and cache split over them, the sampler's state on all of them. One: everything on
    that device (a data-parallel replica). None: the default device."""

    def __init__(
        self,
        model_config: ModelConfig,
        config: EngineConfig,
        params: ServingParams,
        mesh: Mesh | None = None,
    ) -> None:
        self.model_config = model_config
        self.config = config
        self.dtype = model_dtype(params)
        self.device = mesh.devices.flat[0] if mesh is not None and mesh.size == 1 else None
        self.mesh = mesh if mesh is not None and mesh.size > 1 else None
        if self.mesh is None:
            self.step_config = model_config
            self.params = params if self.device is None else jax.device_put(params, self.device)
        else:  # KV heads as stored when there are fewer than devices (repeated)
            self.step_config = sharding.stored_config(model_config, mesh.size)
            self.params = sharding.shard_params(params, model_config, mesh)
        self.state = DeviceState(
            self.step_config, config, model_config.vocab_size, self.dtype, self.mesh, self.device
        )
        pages = "int8" if self.cache.quantized else "auto"  # what the KV pages hold
        self.attention = resolve_attention(
            config.attention, model_config, self.dtype, pages
        )  # loads native kernels before any program
        # projections: the native kernels where they serve the weights (`ops.matmul`)
        self.matmul = "auto" if kernels.native_available() else "reference"
        self.spec = StepSpec(self.step_config, self.attention, self.matmul, self.mesh)
        devices = list(mesh.devices.flat) if mesh is not None else None  # in the mesh's order
        # Several processes: no stored programs (each would have to load the same ones).
        self.channel = StepChannel() if distributed.is_multiprocess() else None
        self.programs = CompileManager(
            ProgramCache(program_cache_dir() if self.channel is None else None, devices)
        )
        self.page_mover = PageMover(self.state, self.programs, config)
        self.penalty_slots = PenaltySlots(self.state, self.programs, config, self.channel)

    @property
    def cache(self) -> KVCache:
        """The KV cache as of the last dispatched program (`DeviceState`)."""
        return self.state.cache

    @cache.setter
    def cache(self, cache: KVCache) -> None:
        self.state.cache = cache

    @property
    def num_compiles(self) -> int:
        """Programs made, compiled or loaded whole from the program cache (`CompileManager`)."""
        return self.programs.num_compiles

    @property
    def num_loaded(self) -> int:
        """Of `num_compiles`, the programs loaded whole from the program cache."""
        return self.programs.num_loaded

    # ------------------------------------------------------------------ compilation

    def step_program(self, num_tokens: int, num_seqs: int, kind: str = "step") -> Any:
        """The program of a step of this bucket: "step" (samples each sequence's next token),
        "multi_step" (`num_scheduler_steps` decode steps) or "verify" (samples at every token)."""
        extra = (
            {"num_steps": self.config.scheduler.num_scheduler_steps} if kind == "multi_step" else {}
        )
        key = (kind, num_tokens, num_seqs, *extra.values())
        program = self.programs.get(key)
        if program is not None:  # every step after warm-up: no abstract arguments to build
            return program
        state = self.state
        inputs = state.abstract(
            _step_inputs(self.config, self.model_config, num_tokens, num_seqs, kind)
        )
        return self.programs.program(
            key,
            STEP_FUNCTIONS[kind],
            self.params,
            state.cache,
            state.penalty_state,
            state.fed_back,
            *inputs,
            spec=self.spec,
            **extra,
        )

    def warmup(self, progress: bool = True) -> float:
        """Compile every bucket shape now, one program per core at a time
        (`CompileManager.compile_all`), then run each once, and compile what else may run
        (page moves, page scores); any failure propagates (never swallowed)."""
        start = time.perf_counter()
        cfg = self.config
        programs = [(*shape, "step") for shape in cfg.scheduler.step_shapes()]
        programs += [(*shape, "multi_step") for shape in cfg.scheduler.multi_step_shapes()]
        programs += [(*shape, "verify") for shape in cfg.verify_shapes()]
        makers = [functools.partial(self.step_program, *p) for p in programs]
        self.programs.compile_all(makers, progress, "warm-up: compiling buckets")
        self.penalty_slots.program()
        for program in programs:
            self._exercise(*program)
        if (
            cfg.scheduler.preemption_mode != "recompute" or cfg.cache.kv_disk_dir is not None
        ):  # compiles the page moves too
            self.page_mover.measure_copy_speed()
        if cfg.allow_request_kv_compression or (
            cfg.kv_compression is not None and needs_scores(cfg.kv_compression)
        ):
            self._page_scores(Chunk([0], 0, [SCRATCH_PAGE]))
        jax.block_until_ready(self.state.cache)
        self.programs.warm = True
        return time.perf_counter() - start

    def _exercise(self, num_tokens: int, num_seqs: int, kind: str = "step") -> None:
        """Run a step program once on scratch work, so its first real step does not pay the
        one-time cost of a program's first run (a step that admitted a prompt was the slowest
        of its stream). The work touches every part of the step: a
        decode and a prompt chunk with cached context (on the scratch page), penalties."""
        ps = self.config.cache.page_size
        lookahead = self.config.scheduler.num_scheduler_steps if kind == "multi_step" else 0
        chunks = [Chunk([0], ps, [SCRATCH_PAGE] * -(-(ps + 1 + lookahead) // ps))]
        if num_tokens > 1 and num_seqs > 1 and kind != "multi_step":
            q = num_tokens - 1
            chunks.append(Chunk([0] * q, ps, [SCRATCH_PAGE] * (-(-(ps + q) // ps))))
        batch = build_step_batch(
            chunks, ps, num_tokens, num_seqs, self.config.num_listed_pages(num_seqs), lookahead
        )
        inputs = _step_inputs(self.config, self.model_config, num_tokens, num_seqs, kind)
        rows = self.penalty_slots.scratch_rows(num_seqs)
        self._run_step(num_tokens, num_seqs, (batch, inputs[1], rows, *inputs[3:]), kind)

    # ------------------------------------------------------------------ running

    def reset_cache_if_lost(self) -> bool:
        """Rebuild an empty KV cache (and penalty state) if a failed step took the donated
        buffers with it (`DeviceState.rebuild_if_lost`); True if it was rebuilt, in which case
        every page's contents and every slot's history are gone."""
        return self.state.rebuild_if_lost()

    def run(self, batch: ScheduledBatch) -> PendingStep:
        """Dispatch one step (model and sampling in one program) and return without waiting;
        only the sampled tokens come back, when `fetch()`ed. Placeholder tokens in the batch
        (`-(row + 1)`) take the previous dispatched step's sampled token of that row."""
        seqs = batch.seqs
        kind = "verify" if batch.drafts else "step" if batch.num_steps == 1 else "multi_step"
        num_tokens, num_seqs = self._bucket(batch)
        rows = [
            (s.sampling_row, len(s.output_token_ids)) for s in seqs
        ]  # typed when the request was added
        num_rows = num_seqs
        if (
            kind == "verify"
        ):  # rows at each last token and draft token: draft token j is output number n + j
            rows = [
                (row, step + j)
                for i, (row, step) in enumerate(rows)
                for j in range(1 + len(batch.draft(i)))
            ]
            num_rows = self.config.verify_rows(num_tokens, num_seqs)
        errors: dict[int, Exception] = {}
        sampling = self._sampling_arrays(batch, rows, num_rows, errors)
        try:
            step_batch = self.prepare(batch)
        except RowsFailed as e:
            errors.update(e.errors)
        if errors:  # before anything is dispatched: the engine fails those rows and runs the rest
            raise RowsFailed(errors)
        self.penalty_slots.load_new(seqs)
        inputs = (step_batch, sampling, self.penalty_slots.rows(seqs, num_seqs))
        if kind == "verify":
            inputs += (_verify_logit_rows(batch, step_batch, num_rows),)
        if self.channel is not None:  # the other processes run this step too
            self.channel.announce(
                distributed.STEP_OPS[kind], step_batch.num_tokens, num_seqs, inputs
            )
        result = self._run_step(step_batch.num_tokens, num_seqs, inputs, kind)
        return PendingStep(
            result,
            len(rows),
            any(s.params.logprobs is not None for s in seqs),
            batch.num_steps,
            (step_batch.num_tokens, step_batch.num_seqs),
        )

    def _sampling_arrays(
        self, batch: ScheduledBatch, rows: list, num_rows: int, errors: dict[int, Exception]
    ) -> SamplingArrays:
        """The per-row sampling settings, with the allowed-token bitmask of each row that samples
        under a grammar (structured output; such rows are never multi-step or drafted, so a
        sequence's row is its index plus the draft rows before it). A row whose grammar fails
        to give its mask is recorded in `errors`."""
        arrays = sampling_arrays(rows, num_rows, self.model_config.vocab_size)
        row, constrained = 0, {}  # batch index -> (grammar, bitmask row)
        for i, seq in enumerate(batch.seqs):
            if seq.grammar is not None and batch.samples_next_token(i):
                constrained[i] = (seq.grammar, row)
            row += 1 + len(batch.draft(i))
        if not constrained:
            return arrays
        # All rows' masks in one call (llguidance's thread pool); a failure is that row's alone.
        for i, error in zip(
            constrained, fill_bitmasks(arrays.token_bitmask, list(constrained.values()))
        ):
            if error is not None:
                errors[i] = error
        return dataclasses.replace(arrays, use_bitmask=np.bool_(True))

    def _run_step(
        self, num_tokens: int, num_seqs: int, inputs: tuple, kind: str = "step"
    ) -> SampleResult:
        program, state = self.step_program(num_tokens, num_seqs, kind), self.state
        result, state.cache, state.penalty_state, state.fed_back = program(
            self.params, state.cache, state.penalty_state, state.fed_back, *state.place(inputs)
        )
        return result

    def follow(self) -> None:
        """On a process other than the leader (`minivllm_jax.parallel.distributed`): run each program the
        leader announces, with its inputs, until it announces the stop."""
        if self.channel is None or distributed.is_leader():
            raise RuntimeError(
                "follow() runs on the processes other than process 0 of a multi-process run"
            )
        while True:
            op, a, b = self.channel.next_op()
            if op == distributed.STOP:
                return
            kind = next((k for k, v in distributed.STEP_OPS.items() if v == op), None)
            if kind is not None:
                self._run_step(
                    a,
                    b,
                    self.channel.payload(_step_inputs(self.config, self.model_config, a, b, kind)),
                    kind,
                )
            elif op == distributed.LOAD_PENALTY_ROW:
                inputs = self.channel.payload(self.penalty_slots.empty_inputs())
                self.penalty_slots.load_row(inputs)
            else:
                raise RuntimeError(f"unknown op {op} from the leader")

    def stop_followers(self) -> None:
        """Leader: release the followers from `follow()` (the end of serving)."""
        if self.channel is not None and distributed.is_leader():
            self.channel.announce(distributed.STOP)
            self.channel = self.penalty_slots.channel = None

    # ------------------------------------------------------------------ KV compression

    def page_scores(self, seq: Sequence, index: int) -> np.ndarray:
        """Attention mass per page of `seq` (`step.page_attention_scores`) from the query of its
        token `index` (computed, known), re-fed at its own slot; waits for the result."""
        if self.channel is not None:
            raise RuntimeError(
                "KV compression by page scores does not run across several processes"
            )
        context = index - seq.num_dropped_tokens
        return self._page_scores(
            Chunk([seq.token_ids[index]], context, seq.pages, seq.num_dropped_tokens)
        )

    def _page_scores(self, chunk: Chunk) -> np.ndarray:
        batch = build_step_batch(
            [chunk], self.config.cache.page_size, 1, 1, self.config.max_pages_per_seq
        )
        state = self.state
        program = self.programs.program(
            ("page_scores",),
            page_attention_scores_jit,
            self.params,
            state.cache,
            state.abstract(batch),
            spec=self.spec,
        )
        return np.asarray(program(self.params, state.cache, state.place(batch)))

    def prepare(self, batch: ScheduledBatch) -> StepBatch:
        """The flat host arrays of the step, in the smallest bucket that holds it."""
        chunks, errors = self._row_chunks(batch)
        if errors:
            raise RowsFailed(errors)
        return self._step_batch(batch, chunks, *self._bucket(batch))

    def _bucket(self, batch: ScheduledBatch) -> tuple[int, int]:
        """(tokens, sequences) of the smallest step program that holds the batch."""
        num_tokens = bucket_for(batch.num_tokens, self.config.scheduler.token_buckets)
        return num_tokens, bucket_for(
            len(batch.seqs), self.config.scheduler.seq_buckets(num_tokens)
        )

    def _row_chunks(self, batch: ScheduledBatch) -> tuple[list[Chunk], dict[int, Exception]]:
        """What each sequence feeds, its tokens already int32 (so building the step cannot fail
        on one row's values); a row that raises is recorded instead (index -> error)."""
        chunks, errors = [], {}
        for i, (seq, q) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            try:  # a sequence with dropped pages (KV compression) feeds its tokens at shifted slots
                start = seq.num_computed_tokens
                tokens = seq.tokens_between(start, start + q - len(batch.draft(i))) + list(
                    batch.draft(i)
                )
                chunks.append(
                    Chunk(
                        np.asarray(tokens, np.int32),
                        start - seq.num_dropped_tokens,
                        seq.pages,
                        seq.num_dropped_tokens,
                    )
                )
            except Exception as e:  # noqa: BLE001 (any failure is that row's alone)
                errors[i] = e
        return chunks, errors

    def _step_batch(
        self, batch: ScheduledBatch, chunks: list[Chunk], num_tokens: int, num_seqs: int
    ) -> StepBatch:
        lookahead = (
            0 if batch.num_steps == 1 else batch.num_steps
        )  # the pages every inner step writes
        cfg = self.config
        return build_step_batch(
            chunks,
            cfg.cache.page_size,
            num_tokens,
            num_seqs,
            cfg.num_listed_pages(num_seqs),
            lookahead,
        )


STEP_FUNCTIONS = {
    "step": engine_step_jit,
    "multi_step": engine_multi_step_jit,
    "verify": engine_verify_step_jit,
}


def _step_inputs(
    config: EngineConfig,
    model_config: ModelConfig,
    num_tokens: int,
    num_seqs: int,
    kind: str = "step",
) -> tuple:
    """Host inputs of a step of this bucket (empty): their shapes and dtypes."""
    rows = PenaltyRows(np.zeros(num_seqs, np.int32), np.zeros(num_seqs, np.int32), np.bool_(False))
    batch = _empty_batch(config, num_tokens, num_seqs)
    vocab = model_config.vocab_size
    if kind != "verify":
        return batch, make_sampling_arrays([], num_seqs, vocab), rows
    num_rows = config.verify_rows(num_tokens, num_seqs)
    return batch, make_sampling_arrays([], num_rows, vocab), rows, np.zeros(num_rows, np.int32)


def _verify_logit_rows(batch: ScheduledBatch, step_batch: StepBatch, num_rows: int) -> np.ndarray:
    """The tokens a verify step samples at, in row order: each sequence's last real token, then
    its draft tokens (padding rows sample token 0, ignored)."""
    rows = np.zeros(num_rows, np.int32)
    r = 0
    for i, (start, q) in enumerate(zip(step_batch.query_start, batch.num_new_tokens)):
        n = 1 + len(batch.draft(i))
        rows[r : r + n] = np.arange(start + q - n, start + q)
        r += n
    return rows


def _empty_batch(config: EngineConfig, num_tokens: int, num_seqs: int) -> StepBatch:
    return build_step_batch(
        [], config.cache.page_size, num_tokens, num_seqs, config.num_listed_pages(num_seqs)
    )
