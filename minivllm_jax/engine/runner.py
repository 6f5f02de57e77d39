"""`ModelRunner`: lays a `ScheduledBatch` out as a flat ragged `StepBatch` in its bucket and
runs the precompiled step programs.

Every program is compiled ahead of time (`jit(...).lower(...).compile()`, or loaded whole from
the program cache, `minivllm_jax.engine.compilation`) for one bucket shape and kept in a dict keyed
by that shape, so a shape outside the warm-up set is visible (`num_compiles` grows) rather than
a silent recompile. A step program is the model and the
sampler together (`minivllm_jax.engine.step`); the KV cache and the penalty state are donated to it.
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
from jax.sharding import Mesh
from tqdm.auto import tqdm

from minivllm_jax import kernels
from minivllm_jax.config import EngineConfig, ModelConfig, bucket_for
from minivllm_jax.engine.compilation import ProgramCache
from minivllm_jax.engine.decoding.structured_output import fill_bitmasks
from minivllm_jax.engine.kv.compression import needs_scores
from minivllm_jax.engine.runtime import program_cache_dir
from minivllm_jax.engine.scheduler import ScheduledBatch
from minivllm_jax.engine.sequence import Sequence
from minivllm_jax.engine.step import (
    PenaltyRows,
    PenaltyState,
    copy_pages_jit,
    engine_multi_step_jit,
    engine_step_jit,
    engine_verify_step_jit,
    gather_pages_jit,
    init_penalty_state,
    load_penalty_row_jit,
    page_attention_scores_jit,
    scatter_pages_jit,
)
from minivllm_jax.models.llama import Params, model_dtype, unstack_layers
from minivllm_jax.ops.attention import resolve_attention
from minivllm_jax.ops.batch import Chunk, StepBatch, build_step_batch
from minivllm_jax.ops.kv_cache import SCRATCH_PAGE, KVCache, init_kv_cache
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
        params: Params,
        mesh: Mesh | None = None,
    ) -> None:
        self.model_config = model_config
        self.config = config
        self.dtype = model_dtype(params)
        params = unstack_layers(params)  # the layout the step reads without copying weights
        self.device = mesh.devices.flat[0] if mesh is not None and mesh.size == 1 else None
        self.mesh = mesh if mesh is not None and mesh.size > 1 else None
        if self.mesh is None:
            self.step_config = model_config
            self.params = params if self.device is None else jax.device_put(params, self.device)
        else:  # KV heads as stored when there are fewer than devices (repeated)
            self.step_config = sharding.stored_config(model_config, mesh.size)
            self.params = sharding.shard_params(params, model_config, mesh)
        # Where the host's per-step arrays go: the default device needs no placing; a replica's
        # device or a mesh (whole on each device) does, since a compiled program takes its
        # arguments where it was compiled for them.
        self.host_sharding = (
            None
            if self.device is None and self.mesh is None
            else jax.sharding.SingleDeviceSharding(self.device)
            if self.mesh is None
            else jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        )
        self._new_device_state()
        self.attention = resolve_attention(
            config.attention, model_config
        )  # loads native kernels before any program
        self.matmul = (
            "native" if kernels.native_available() else "reference"
        )  # quantized projections
        self._programs: dict[tuple, Any] = {}
        devices = list(mesh.devices.flat) if mesh is not None else None  # in the mesh's order
        # Several processes: no stored programs (each would have to load the same ones).
        self.channel = StepChannel() if distributed.is_multiprocess() else None
        self._program_cache = ProgramCache(
            program_cache_dir() if self.channel is None else None, devices
        )
        self.num_compiles = 0  # programs made, compiled or loaded whole from the program cache
        self.num_loaded = 0  # of which loaded
        self.compile_seconds = 0.0
        self._warm = False
        self.page_copy_bytes_per_s: float | None = None  # measured at warm-up when pages may move
        self._compile_lock = threading.Lock()

    def _new_device_state(self) -> None:
        """An empty KV cache, penalty state and fed-back tokens (the last step's tokens, see
        step.py), made where the step reads them: on a mesh the cache split by KV head and the
        rest whole on each device, each process making only its own shards."""
        cfg = self.config

        def make() -> tuple[KVCache, PenaltyState, jax.Array]:
            cache = init_kv_cache(
                self.step_config,
                cfg.cache.num_pages,
                cfg.cache.page_size,
                self.dtype,
                cfg.cache.kv_cache_dtype,
            )
            return (
                cache,
                init_penalty_state(cfg.scheduler.max_num_seqs, self.model_config.vocab_size),
                jnp.zeros(cfg.scheduler.max_num_seqs, jnp.int32),
            )

        if self.host_sharding is None:
            self.cache, self.penalty_state, self.fed_back = make()
            return
        cache = jax.eval_shape(make)[0]
        cache_sharding = (
            self.host_sharding if self.mesh is None else sharding.cache_shardings(cache, self.mesh)
        )
        out = (cache_sharding, self.host_sharding, self.host_sharding)
        self.cache, self.penalty_state, self.fed_back = jax.jit(make, out_shardings=out)()

    # ------------------------------------------------------------------ compilation

    def _abstract(self, tree: Any) -> Any:
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(
                np.shape(x), np.asarray(x).dtype, sharding=self.host_sharding
            ),
            tree,
        )

    def _place(self, tree: Any) -> Any:
        return tree if self.host_sharding is None else jax.device_put(tree, self.host_sharding)

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
                logger.warning(
                    "compiled %s after warm-up; a bucket is missing from the warm-up set", key
                )
        return program

    def _step_program(self, num_tokens: int, num_seqs: int, kind: str = "step") -> Any:
        """The program of a step of this bucket: "step" (samples each sequence's next token),
        "multi_step" (`num_scheduler_steps` decode steps) or "verify" (samples at every token)."""
        extra = (
            {"num_steps": self.config.scheduler.num_scheduler_steps} if kind == "multi_step" else {}
        )
        key = (kind, num_tokens, num_seqs, *extra.values())
        program = self._programs.get(key)
        if program is not None:  # every step after warm-up: no abstract arguments to build
            return program
        inputs = self._abstract(
            _step_inputs(self.config, self.model_config, num_tokens, num_seqs, kind)
        )
        return self._program(
            key,
            STEP_FUNCTIONS[kind],
            self.params,
            self.cache,
            self.penalty_state,
            self.fed_back,
            *inputs,
            cfg=self.step_config,
            attention=self.attention,
            matmul=self.matmul,
            mesh=self.mesh,
            **extra,
        )

    def _load_penalty_program(self) -> Any:
        inputs = self._abstract(_penalty_row_inputs(self.config))
        return self._program(
            ("load_penalty_row",), load_penalty_row_jit, self.penalty_state, *inputs
        )

    def warmup(self, progress: bool = True) -> float:
        """Compile every bucket shape now, one program per core at a time (XLA compiles and
        loads cached programs outside the GIL: a cold start here went from 38 s to 30 s on 2
        cores), then run each once; any failure propagates (never swallowed)."""
        start = time.perf_counter()
        cfg = self.config
        programs = [(*shape, "step") for shape in cfg.scheduler.step_shapes()]
        programs += [(*shape, "multi_step") for shape in cfg.scheduler.multi_step_shapes()]
        programs += [(*shape, "verify") for shape in cfg.verify_shapes()]
        with ThreadPoolExecutor(max_workers=min(len(programs), os.cpu_count() or 1)) as pool:
            compiled = pool.map(lambda p: self._step_program(*p), programs)
            for _ in tqdm(
                compiled,
                total=len(programs),
                desc="warm-up: compiling buckets",
                disable=not progress,
            ):
                pass
        self._load_penalty_program()
        for program in programs:
            self._exercise(*program)
        if (
            cfg.scheduler.preemption_mode != "recompute" or cfg.cache.kv_disk_dir is not None
        ):  # compiles the page moves too
            self.page_copy_bytes_per_s = self.measure_page_copy()
        if cfg.allow_request_kv_compression or (
            cfg.kv_compression is not None and needs_scores(cfg.kv_compression)
        ):
            self._page_scores(Chunk([0], 0, [SCRATCH_PAGE]))
        jax.block_until_ready(self.cache)
        self._warm = True
        return time.perf_counter() - start

    def _exercise(self, num_tokens: int, num_seqs: int, kind: str = "step") -> None:
        """Run a step program once on scratch work, so its first real step does not pay the
        one-time cost of a program's first run (about 100 ms each here: a step that admitted
        a prompt was the slowest of its stream). The work touches every part of the step: a
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
        scratch = np.full(num_seqs, self.penalty_state.scratch_slot, np.int32)
        rows = PenaltyRows(scratch, np.zeros(num_seqs, np.int32), np.bool_(True))
        self._run_step(num_tokens, num_seqs, (batch, inputs[1], rows, *inputs[3:]), kind)

    # ------------------------------------------------------------------ running

    def reset_cache_if_lost(self) -> bool:
        """Rebuild an empty KV cache (and penalty state) if a failed step took the donated
        buffers with it (a donated input is deleted even when the program fails); True if it
        was rebuilt, in which case every page's contents and every slot's history are gone."""
        leaves = jax.tree.leaves((self.cache, self.penalty_state))
        if not any(leaf.is_deleted() for leaf in leaves):
            return False
        logger.warning("the KV cache buffers were lost with a failed step; rebuilding the cache")
        self._new_device_state()
        return True

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
        self._load_new_penalty_rows(seqs)
        inputs = (step_batch, sampling, self._penalty_rows(seqs, num_seqs))
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
        program = self._step_program(num_tokens, num_seqs, kind)
        result, self.cache, self.penalty_state, self.fed_back = program(
            self.params, self.cache, self.penalty_state, self.fed_back, *self._place(inputs)
        )
        return result

    def _load_penalty_row(self, inputs: tuple) -> None:
        self.penalty_state = self._load_penalty_program()(self.penalty_state, *self._place(inputs))

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
                self._load_penalty_row(self.channel.payload(_penalty_row_inputs(self.config)))
            else:
                raise RuntimeError(f"unknown op {op} from the leader")

    def stop_followers(self) -> None:
        """Leader: release the followers from `follow()` (the end of serving)."""
        if self.channel is not None and distributed.is_leader():
            self.channel.announce(distributed.STOP)
            self.channel = None

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        """Copy KV pages `src[i]` -> `dst[i]` (every layer) on the device: copy-on-write of the
        partial page forked sequences share (beam search). The index arrays are `max_num_seqs`
        long, padded with the scratch page, so one compiled program serves every call."""
        if self.channel is not None:
            raise RuntimeError(
                "copying pages is not announced to the other processes of a multi-process run"
            )
        n = self.config.scheduler.max_num_seqs
        for start in range(0, len(src), n):
            pairs = np.full((2, n), SCRATCH_PAGE, np.int32)
            chunk = src[start : start + n]
            pairs[0, : len(chunk)], pairs[1, : len(chunk)] = chunk, dst[start : start + n]
            src_dst = (pairs[0], pairs[1])
            program = self._program(
                ("copy_pages",), copy_pages_jit, self.cache, *self._abstract(src_dst)
            )
            self.cache = program(self.cache, *self._place(src_dst))

    # ------------------------------------------------------------------ page moves (swap, disk tier)

    @property
    def page_move_buckets(self) -> tuple[int, ...]:
        """Page counts of the gather/scatter programs: doublings from 4 up to a whole sequence's."""
        top = 1 << max(2, (self.config.max_pages_per_seq - 1).bit_length())
        return tuple(1 << i for i in range(2, top.bit_length()))

    def _page_index(self, pages: list[int], bucket: int) -> np.ndarray:
        index = np.full(bucket, SCRATCH_PAGE, np.int32)
        index[: len(pages)] = pages
        return index

    def _chunks(self, pages: list[int]) -> list[tuple[list[int], int]]:
        """`pages` in pieces of the largest bucket, each with the bucket it is padded to."""
        top = self.page_move_buckets[-1]
        return [
            (pages[i : i + top], bucket_for(len(pages[i : i + top]), self.page_move_buckets))
            for i in range(0, len(pages), top)
        ]

    def gather_pages(self, pages: list[int]) -> list[tuple[KVCache, int]]:
        """Dispatch copies of whole pages (every layer); returns `(copy, count)` pieces, each a
        cache-shaped tree with the pages on axis 1 (padded to its bucket). Ordered after every
        step dispatched so far, so it reads what they wrote, before any later step reuses them."""
        if self.channel is not None:
            raise RuntimeError("page swaps and the disk tier do not run across several processes")
        out = []
        for piece, bucket in self._chunks(pages):
            index = self._page_index(piece, bucket)
            program = self._program(
                ("gather_pages", bucket), gather_pages_jit, self.cache, *self._abstract((index,))
            )
            out.append((program(self.cache, *self._place((index,))), len(piece)))
        return out

    def scatter_pages(self, pieces: list[tuple[Any, int]], pages: list[int]) -> None:
        """Write pieces from `gather_pages` (or host arrays of the same layout) into `pages`, in order."""
        start = 0
        for data, count in pieces:
            bucket = jax.tree.leaves(data)[0].shape[1]
            index = self._page_index(pages[start : start + count], bucket)
            program = self._program(
                ("scatter_pages", bucket),
                scatter_pages_jit,
                self.cache,
                self._abstract(data),
                *self._abstract((index,)),
            )
            self.cache = program(self.cache, *self._place((data, index)))
            start += count

    def host_pieces(self, pages: list[dict[str, np.ndarray]]) -> list[tuple[KVCache, int]]:
        """Single pages as host arrays (leaf name -> one page, as the disk tier stores them)
        stacked into padded pieces for `scatter_pages`."""
        pieces = []
        for chunk, bucket in self._chunks(pages):
            leaves = {}
            for name in chunk[0]:
                stacked = np.stack([p[name] for p in chunk], axis=1)
                pad = [(0, 0)] * stacked.ndim
                pad[1] = (0, bucket - len(chunk))
                leaves[name] = np.pad(stacked, pad)
            pieces.append((KVCache(**leaves), len(chunk)))
        return pieces

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
        program = self._program(
            ("page_scores",),
            page_attention_scores_jit,
            self.params,
            self.cache,
            self._abstract(batch),
            cfg=self.step_config,
            attention=self.attention,
            matmul=self.matmul,
        )
        return np.asarray(program(self.params, self.cache, self._place(batch)))

    def measure_page_copy(self) -> float:
        """Bytes a second of copying pages out and back (the largest bucket, on the scratch
        page), for the swap cost model; also compiles every page-move program."""
        for bucket in self.page_move_buckets:
            self.scatter_pages(self.gather_pages([SCRATCH_PAGE] * bucket), [SCRATCH_PAGE] * bucket)
        bucket = self.page_move_buckets[-1]
        jax.block_until_ready(self.cache)
        start = time.perf_counter()
        for _ in range(3):
            self.scatter_pages(self.gather_pages([SCRATCH_PAGE] * bucket), [SCRATCH_PAGE] * bucket)
        jax.block_until_ready(self.cache)
        seconds = (time.perf_counter() - start) / 3
        page_bytes = (
            sum(x.nbytes for x in jax.tree.leaves(self.cache)) // self.config.cache.num_pages
        )
        return 2 * bucket * page_bytes / max(seconds, 1e-9)

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

    def _penalty_rows(self, seqs: tuple[Sequence, ...], num_seqs: int) -> PenaltyRows:
        scratch = self.penalty_state.scratch_slot
        slots = np.full(num_seqs, scratch, np.int32)
        prompt_lens = np.zeros(num_seqs, np.int32)
        for i, seq in enumerate(seqs):
            slots[i] = scratch if seq.penalty_slot is None else seq.penalty_slot
            prompt_lens[i] = len(seq.prompt_token_ids)
        return PenaltyRows(
            slots, prompt_lens, np.bool_(any(s.penalty_slot is not None for s in seqs))
        )

    def _load_new_penalty_rows(self, seqs: tuple[Sequence, ...]) -> None:
        """A sequence that just got a penalty slot: load the tokens it will not feed itself
        (cached or forked prompt pages, or all of them after a preemption)."""
        for seq in seqs:
            if seq.penalty_slot is None or seq.penalty_loaded:
                continue
            tokens = np.zeros(self.config.max_model_len, np.int32)
            known = seq.num_computed_tokens
            tokens[:known] = seq.token_ids[:known]
            inputs = (
                np.int32(seq.penalty_slot),
                tokens,
                np.int32(known),
                np.int32(len(seq.prompt_token_ids)),
            )
            if self.channel is not None:
                self.channel.announce(distributed.LOAD_PENALTY_ROW, payload=inputs)
            self._load_penalty_row(inputs)
            seq.penalty_loaded = True


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


def _penalty_row_inputs(config: EngineConfig) -> tuple:
    return np.int32(0), np.zeros(config.max_model_len, np.int32), np.int32(0), np.int32(0)


def _empty_batch(config: EngineConfig, num_tokens: int, num_seqs: int) -> StepBatch:
    return build_step_batch(
        [], config.cache.page_size, num_tokens, num_seqs, config.num_listed_pages(num_seqs)
    )
