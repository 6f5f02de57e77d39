"""`LLMEngine`: requests in, `RequestOutput`s out, one `step()` at a time.

It takes requests in (`InputProcessor` checks them and makes their n samples), orchestrates
the steps (schedule, move pages, dispatch, read the step before: async scheduling) and
contains faults (a failed row, step or page copy costs only its requests; `faults` holds the
mechanics). It wires the scheduler, page manager and model runner together; `StepUpdate` puts
the tokens it reads into their sequences (n > 1 forks, KV compression) and `OutputProcessor`
turns them into `RequestOutput`s (stops, text, logprobs). Code outside the engine reads
`stats()` and its step listeners (`StepEvent`), never its parts.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Any

from jax.sharding import Mesh

from minivllm_jax.config import EngineConfig, ModelConfig
from minivllm_jax.engine import faults
from minivllm_jax.engine.decoding.structured_output import GrammarCompiler, GrammarQueue
from minivllm_jax.engine.input_processor import InputProcessor
from minivllm_jax.engine.kv.pages import PageManager, check_cache_salt
from minivllm_jax.engine.kv.tiers import KVTiers
from minivllm_jax.engine.output_processor import OutputProcessor, RequestState
from minivllm_jax.engine.runner import ModelRunner, PendingStep, RowsFailed
from minivllm_jax.engine.sched_output import ScheduledBatch
from minivllm_jax.engine.scheduler import Scheduler
from minivllm_jax.engine.sequence import Sequence
from minivllm_jax.engine.stats import EngineStats, StepEvent
from minivllm_jax.engine.step_update import InFlight, StepUpdate, book, drop_pending
from minivllm_jax.models.params import ServingParams
from minivllm_jax.ops.kv_cache import KVCache
from minivllm_jax.outputs import RequestOutput
from minivllm_jax.prompts import prompt_ids
from minivllm_jax.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def _has_grammar(batch: ScheduledBatch) -> bool:
    return any(seq.grammar is not None for seq in batch.seqs)


class LLMEngine:
    def __init__(
        self,
        model_config: ModelConfig,
        config: EngineConfig,
        params: ServingParams,
        tokenizer,
        *,
        eos_token_ids: Seq[int] = (),
        seed: int = 0,
        mesh: Mesh | None = None,
    ) -> None:
        """`mesh`: the devices this engine's model runs on, tensor-parallel (`ModelRunner`)."""
        config.check_model(model_config)
        self.model_config = model_config
        self.config = config
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.input_processor = InputProcessor(model_config, config, seed)
        self.output_processor = OutputProcessor(tokenizer, self.eos_token_ids, config.max_model_len)
        self.seed = seed
        self.runner = ModelRunner(model_config, config, params, mesh)
        self.tiers = KVTiers(
            model_config, config, self.runner
        )  # the swap pool and the disk tier, if any
        self.page_manager = PageManager(
            config.cache.num_pages,
            config.cache.page_size,
            config.cache.enable_prefix_caching,
            self.tiers.disk,
        )
        self.scheduler = Scheduler(config, self.page_manager, self.tiers.swap_pool)
        # Structured output: a request waits in `grammars` (not yet scheduled) until its
        # grammar has compiled on the compiler's threads.
        self.grammar_compiler = GrammarCompiler(
            tokenizer, model_config.vocab_size, self.eos_token_ids
        )
        self.grammars = GrammarQueue(self.grammar_compiler)
        self.requests: dict[str, RequestState] = {}
        self._request_counter = itertools.count()
        # Reads each step's tokens into its sequences and counts tokens, drafts, dropped pages.
        self.step_update = StepUpdate(self.output_processor, self.runner, config.cache.page_size)
        self._in_flight: InFlight | None = None  # the step dispatched and not read yet
        self._last_ready = 0.0  # when the last step's tokens were read
        self.num_steps = 0  # `step()` calls
        self._step_listeners: list[Callable[[StepEvent], None]] = []

    @property
    def params(self) -> ServingParams:
        """The loaded params, in the serving layout the runner holds them."""
        return self.runner.params

    @property
    def kv_cache(self) -> KVCache:
        """The KV buffers (tools measure them; nothing outside the engine writes them)."""
        return self.runner.cache

    def step_program(self, num_tokens: int, num_seqs: int) -> Any:
        """The compiled step program of bucket (`num_tokens`, `num_seqs`) (tools read its HLO)."""
        return self.runner.step_program(num_tokens, num_seqs)

    def running_kv_tokens(self) -> list[int]:
        """Per running sequence, the tokens its KV pages hold between steps: all its tokens but
        the one just sampled (a prompt mid chunked prefill already has pages for all of it)."""
        return [len(s) - (1 if s.output_token_ids else 0) for s in self.scheduler.running]

    def stats(self) -> EngineStats:
        """A snapshot of the queues, the KV pages and the counters (`EngineStats`): each part
        reports its own fields."""
        return EngineStats(
            steps=self.num_steps,
            requests=len(self.requests),
            compiles=self.runner.num_compiles,
            programs_loaded=self.runner.num_loaded,
            **self.scheduler.stats(),
            **self.page_manager.stats(),
            **self.step_update.stats(),
            **self.tiers.stats(self.page_manager),
        )

    def add_step_listener(self, listener: Callable[[StepEvent], None]) -> None:
        """Call `listener` with a `StepEvent` after each device step, once its tokens are read
        (a step that failed gives none). A listener that raises fails the `step()` call."""
        self._step_listeners.append(listener)

    def remove_step_listener(self, listener: Callable[[StepEvent], None]) -> None:
        self._step_listeners.remove(listener)

    def reset_host_state(
        self, config: EngineConfig | None = None, page_manager: PageManager | None = None
    ) -> None:
        """Start the host side afresh with no request in the engine: a new scheduler and page
        manager (an empty prefix cache), without the KV tiers; the compiled programs and the KV
        buffers stay. `config` may change scheduler knobs, never the compiled limits upward;
        `page_manager` replaces the default one. For tools (the benchmarks' ablations)."""
        if self.has_unfinished() or self.requests:
            raise RuntimeError("reset_host_state needs an idle engine: requests are unfinished")
        config = config or self.config
        self.page_manager = page_manager or PageManager(
            config.cache.num_pages, config.cache.page_size, config.cache.enable_prefix_caching
        )
        self.scheduler = Scheduler(config, self.page_manager)

    def follow(self) -> None:
        """A follower process of a multi-process run: run the leader's steps until it stops."""
        self.runner.follow()

    def stop_followers(self) -> None:
        """On the leader of a multi-process run: release the followers (a no-op elsewhere)."""
        self.runner.stop_followers()

    def warmup(self, progress: bool = True) -> float:
        seconds = self.runner.warmup(progress)
        self.tiers.warmed_up()
        return seconds

    def check_accounting(self) -> None:
        """Raise AssertionError unless the pages, penalty slots and swap pool are exactly those
        the live sequences hold (tests call it after every fault)."""
        self.page_manager.check(self.scheduler.running + self.scheduler.waiting)
        self.scheduler.check_accounting()

    def close(self) -> None:
        """A clean shutdown: the cached pages go to the disk tier, if there is one (`KVTiers.close`)."""
        self.tiers.close(self.scheduler, self.page_manager)
        self.grammar_compiler.close()

    # ------------------------------------------------------------------ requests

    def tokenize(self, prompt: str | Seq[int]) -> tuple[str | None, list[int]]:
        """Text is encoded with the tokenizer's own special-token rule (BOS where the tokenizer
        adds one, as HF and vLLM do); token ids (e.g. a chat template's output) are taken as given."""
        ids = prompt_ids(self.tokenizer, prompt, self.model_config.vocab_size)
        return (prompt if isinstance(prompt, str) else None), ids

    def add_request(
        self,
        prompt: str | Seq[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        streaming: bool = True,
        cache_salt: str | None = None,
    ) -> str:
        """Validate and queue a request; returns its id. Raises ValueError on bad input.

        `streaming=False` marks offline work (`LLM.generate`): no client reads its tokens as
        they come, so the scheduler does not hold prompt work back to protect its TPOT.
        `cache_salt` (vLLM's): prefix-cache pages are shared only between requests of equal salt."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        check_cache_salt(cache_salt)
        request_id = str(next(self._request_counter)) if request_id is None else request_id
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, ids = self.tokenize(prompt)
        seqs = self.input_processor.samples(
            request_id,
            ids,
            params,
            priority=priority,
            arrival_time=arrival_time,
            streaming=streaming,
            cache_salt=cache_salt,
            multiprocess=self.runner.channel is not None,
        )
        arrival, spec = seqs[0].arrival_time, seqs[0].params.structured_outputs
        request = self.output_processor.new_request(request_id, text, ids, seqs, arrival)
        self.requests[request_id] = request
        if spec is not None:  # scheduled once its grammar is compiled
            self.grammars.submit(request_id, spec)
        else:
            self.scheduler.add(seqs[0])  # the prompt is prefilled once, by sample 0
        return request_id

    def _admit_compiled(self) -> list[RequestOutput]:
        """Schedule the requests whose grammars compiled (each sample gets its own matcher); fail
        those whose grammar did not."""
        outputs = []
        for request_id, grammar, error in self.grammars.ready():
            request = self.requests[request_id]
            if error is not None:
                outputs.append(self._fail_request(request, f"structured_outputs: {error}"))
                continue
            for seq in request.seqs:
                seq.grammar = grammar.new_grammar()
            self.scheduler.add(request.seqs[0])
        return outputs

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its pages; False if it is unknown or already done."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        self.grammars.discard(request_id)
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
        return True

    def has_unfinished(self) -> bool:
        # A sequence in flight is running, so counted here; a request whose grammar compiles is not yet.
        return self.scheduler.has_unfinished() or bool(self.grammars)

    # ------------------------------------------------------------------ stepping

    def step(self, only_finished: bool = False) -> list[RequestOutput]:
        """Schedule and dispatch a step, then read the step before it; return the outputs of
        requests that changed (finished ones are removed from the engine after this), or of
        those that finished only.

        Async scheduling keeps one step in flight: step N+1 is scheduled and dispatched while
        step N runs, with N's sampled tokens as placeholders fed back on the device; its
        tokens are read (the only wait) after that. A sequence that N stops has one wasted
        row in N+1, whose token is dropped. Without it, each step is read before returning."""
        now = time.monotonic()
        self.num_steps += 1
        previous, self._in_flight = self._in_flight, None
        outputs: list[RequestOutput] = self._admit_compiled() if self.grammars else []
        # Drafts are looked up in known tokens only; a grammar's next mask needs its last token.
        if previous is not None and (self._may_speculate() or _has_grammar(previous.batch)):
            outputs, previous = outputs + self._read(previous, only_finished), None
        batch = self.scheduler.schedule(now)
        if batch is None:
            if previous is None:
                opens = self.scheduler.next_admission_time()
                # Admissions held to gather a batch, or only grammars compiling: wait, do not spin.
                if opens is not None and not outputs:
                    time.sleep(min(max(opens - now, 0.0), 0.005))
                elif self.grammars and not outputs:
                    time.sleep(0.001)
                return outputs
        else:
            for seq in batch.seqs:
                metrics = self.requests[seq.request_id].metrics
                metrics.first_scheduled_time = metrics.first_scheduled_time or now
            try:
                batch, pending = self._dispatch(batch, outputs)
            except faults.DispatchFailed as failure:  # fail this batch only and keep serving
                e, batch = failure.__cause__, failure.batch
                logger.exception(
                    "step over %d sequences failed; failing their requests", len(batch.seqs)
                )
                if previous is not None:  # read it first: its placeholders must not outlive it
                    outputs += self._read(previous, only_finished)
                return outputs + self._fail_batch(batch, f"{type(e).__name__}: {e}")
            if pending is not None:
                self._in_flight = book(batch, pending, now, self.config.cache.page_size)
        if previous is not None:
            outputs += self._read(previous, only_finished)
        current = self._in_flight
        if current is not None and (
            current.batch.drafts or not self.scheduler.config.scheduler.async_scheduling
        ):
            # A speculative step's accepted length decides the next step's input.
            self._in_flight = None
            outputs += self._read(current, only_finished)
        return outputs

    def _dispatch(
        self, batch: ScheduledBatch, outputs: list[RequestOutput]
    ) -> tuple[ScheduledBatch | None, PendingStep | None]:
        """Move pages and dispatch the step; returns the batch that ran and its pending results
        (None, None: nothing was left to run). A sequence whose page copy or host-side row
        preparation failed costs only itself: it is recomputed, or its request fails (its
        output, with `error`, goes to `outputs`), and the step runs without it. Raises
        `faults.DispatchFailed` (with the batch that failed) if dispatching the step itself fails."""
        moves = self.tiers.move_pages(batch.moves, self.scheduler, self.page_manager)
        drop = {seq.seq_id for seq in moves.recompute}
        for seq in moves.failed:
            drop |= self._fail_request_of(
                seq, f"loading its KV pages failed: {moves.error}", outputs
            )
        if self.runner.reset_cache_if_lost():  # a failed copy lost the cache: nothing to run
            faults.recompute_all(self.scheduler, self.page_manager)
            return None, None
        while (batch := faults.without(batch, drop)) is not None:
            try:
                return batch, self.runner.run(batch)
            except RowsFailed as e:
                logger.warning(
                    "preparing %d of %d rows of a step failed: %s",
                    len(e.errors),
                    len(batch.seqs),
                    e,
                )
                for i, error in e.errors.items():
                    drop |= self._fail_request_of(
                        batch.seqs[i], f"{type(error).__name__}: {error}", outputs
                    )
            except Exception as e:
                raise faults.DispatchFailed(batch) from e
        return None, None

    def _fail_request_of(self, seq: Sequence, error: str, outputs: list[RequestOutput]) -> set[int]:
        """Fail the sequence's request (all its samples), adding its output to `outputs`;
        returns the `seq_id`s of its samples (empty if it had already ended)."""
        request = self.requests.get(seq.request_id)
        if request is None:
            return {seq.seq_id}
        outputs.append(self._fail_request(request, error))
        return {s.seq_id for s in request.seqs}

    def _fail_request(self, request: RequestState, error: str) -> RequestOutput:
        """End every sample of the request with finish_reason "error" and remove it; its final output."""
        for seq in self.output_processor.flush_unfinished(request):
            self.scheduler.finish(seq, "error")
        request.error = error
        request.metrics.finished_time = time.monotonic()
        self.requests.pop(request.request_id, None)
        self.grammars.discard(request.request_id)
        return self.output_processor.output(request)

    def _may_speculate(self) -> bool:
        """Some running sequence may propose a draft in the next step."""
        return self.config.speculative is not None and any(
            self.scheduler.wants_draft(s) for s in self.scheduler.running
        )

    def _read(self, step: InFlight, only_finished: bool) -> list[RequestOutput]:
        """Wait for a dispatched step's tokens and process them."""
        try:
            results = step.pending.fetch()
        except Exception as e:  # failed while running: its work and what was fed from it are lost
            logger.exception(
                "step over %d sequences failed; failing their requests", len(step.batch.seqs)
            )
            return self._fail_running_step(step, f"{type(e).__name__}: {e}")
        ready = time.monotonic()
        # With a step in flight before it, this one could only start when that one ended.
        start = max(step.dispatched, self._last_ready)
        batch = step.batch
        self.scheduler.costs.observe(batch.num_tokens, (ready - start) / batch.num_steps)
        self._last_ready = ready
        # A request whose KV compression fails is failed by `_fail_request`.
        outputs = self.step_update.apply(
            step,
            results,
            self.requests,
            self.scheduler,
            self.page_manager,
            self._fail_request,
            only_finished,
        )
        if self._step_listeners:
            event = step.event(start, ready)
            for listener in self._step_listeners:
                listener(event)
        return outputs

    def _fail_batch(self, batch: ScheduledBatch, error: str) -> list[RequestOutput]:
        """Finish the failed step's suspects (`faults.suspects`: all samples of each) with
        finish_reason "error". If the failed step took the KV cache with it, everyone left is
        recomputed."""
        # A request may have ended already (async scheduling runs a finished row once more).
        failed = [self.requests.get(rid) for rid in faults.suspects(batch)]
        outputs = [self._fail_request(request, error) for request in failed if request is not None]
        if self.runner.reset_cache_if_lost():
            faults.recompute_all(self.scheduler, self.page_manager)
        return outputs

    def _fail_running_step(self, step: InFlight, error: str) -> list[RequestOutput]:
        """A dispatched step failed while running (seen when its tokens were read): steps
        dispatched after it were fed its results, so every sequence is recomputed from the
        tokens the host knows, after failing this step's suspects as `_fail_batch` does."""
        self._in_flight = None
        for seq in self.scheduler.running + self.scheduler.waiting:
            drop_pending(seq)
        outputs = self._fail_batch(step.batch, error)
        faults.recompute_all(self.scheduler, self.page_manager)
        return outputs

    def recover(self) -> None:
        """After an exception escaped `step()` (a host-side bug, state unknown): abort every
        request, including sequences the crash left without one, and rebuild the KV cache if
        it was lost, so that new requests can be served."""
        self._in_flight = None
        sched = self.scheduler
        samples = [seq for request in self.requests.values() for seq in request.seqs]
        faults.abandon(sched.running + sched.waiting + samples, sched)
        self.requests.clear()
        self.grammars.clear()
        self.runner.reset_cache_if_lost()
        faults.reset_accounting(sched, self.page_manager)
