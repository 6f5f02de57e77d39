"""`Scheduler`: continuous batching into one kind of step under a token budget.

Every call to `schedule()` fills one ragged step: running decodes first (one token each,
most urgent first), then prompt chunks (partially prefilled sequences, then waiting ones by
priority) with what is left. While streaming requests decode, the prompt tokens added to a
step are limited so the step stays within the TPOT target (`StepCosts`); offline work gets
the whole budget. Under page pressure the lowest-priority, newest running sequence is
preempted: its pages are freed and it waits to be recomputed (its prefix may still be
cached), or its KV is swapped out to the host pool and back (`minivllm_jax.engine.kv.swap`; the
copies go to the engine as a value, the `PageMoves` of the next `ScheduledBatch`). Nothing is
ever dropped. Pages come from `PageManager.allocate_slots`, all or nothing: when it returns None
the scheduler preempts the least urgent sequence and retries, or stops admitting.
"""

from __future__ import annotations

import time

from minivllm_jax.config import AUTO_TPOT_FACTOR, EngineConfig, bucket_for
from minivllm_jax.engine.decoding.speculative import MAX_BACKOFF, propose_ngram
from minivllm_jax.engine.kv.pages import PageManager
from minivllm_jax.engine.kv.swap import SwappedKV, SwapPool
from minivllm_jax.engine.sched_output import PageMoves, ScheduledBatch
from minivllm_jax.engine.sequence import Sequence, SequenceStatus

MIN_PROMPT_CHUNK = 16  # prompt tokens a step may always add: waiting prompts always progress


class StepCosts:
    """Measured seconds of a step per token bucket (exponential moving average)."""

    def __init__(self, buckets: tuple[int, ...], smoothing: float = 0.3) -> None:
        self.buckets = buckets
        self.smoothing = smoothing
        self.seconds: dict[int, float] = {}

    def observe(self, num_tokens: int, seconds: float) -> None:
        bucket = bucket_for(num_tokens, self.buckets)
        old = self.seconds.get(bucket)
        self.seconds[bucket] = seconds if old is None else old + self.smoothing * (seconds - old)

    def estimate(self, bucket: int) -> float | None:
        """Measured seconds of `bucket`, else those of the largest measured bucket below it
        scaled by the token ratio (an overestimate where steps are memory bound: it errs
        towards protecting the streams, and the next measurement corrects it)."""
        if bucket in self.seconds:
            return self.seconds[bucket]
        below = [b for b in self.seconds if b < bucket]
        return self.seconds[max(below)] * bucket / max(below) if below else None

    def seconds_per_prompt_token(self) -> float | None:
        """A prompt token's share of the largest step measured (recomputing a preempted
        sequence runs such steps), or None before any."""
        if not self.seconds:
            return None
        largest = max(self.seconds)
        return self.seconds[largest] / largest

    def largest_within(self, num_tokens: int, limit_s: float) -> int:
        """The largest bucket >= `num_tokens`'s own whose estimated step time is within `limit_s`
        (at least `num_tokens`' own bucket)."""
        best = bucket_for(num_tokens, self.buckets)
        for b in self.buckets:
            estimate = self.estimate(b)
            if b > best and estimate is not None and estimate <= limit_s:
                best = b
        return best


def note_draft_result(seq: Sequence, accepted: int) -> None:
    """After a lookup that found nothing (or a draft of which nothing was accepted) the sequence
    waits before proposing again, twice as long as the last time; any acceptance resets it."""
    if accepted:
        seq.spec_backoff = 0
        return
    seq.spec_backoff = min(2 * seq.spec_backoff or 1, MAX_BACKOFF)
    seq.spec_resume_at = len(seq.output_token_ids) + seq.spec_backoff


class Scheduler:
    def __init__(
        self, config: EngineConfig, page_manager: PageManager, swap_pool: SwapPool | None = None
    ) -> None:
        self.config = config
        self.page_manager = page_manager
        self.swap_pool = swap_pool
        # Page copies for the next batch's `PageMoves` (kept while no batch is scheduled).
        self._swap_outs: list[tuple[Sequence, SwappedKV]] = []
        self._swap_ins: list[tuple[Sequence, SwappedKV, tuple[int, ...]]] = []
        self._from_disk: list[tuple[int, dict]] = []
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_multi_steps = 0  # batches run as `num_scheduler_steps` decode steps in one program
        self.costs = StepCosts(config.scheduler.token_buckets)
        # Rows of the device penalty state; a running sequence that uses penalties holds one.
        self.free_penalty_slots = list(range(config.scheduler.max_num_seqs))

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def stats(self) -> dict[str, int]:
        """The queues' `EngineStats` fields."""
        swapped = sum(seq.swapped is not None for seq in self.waiting)
        return dict(
            running=len(self.running),
            waiting=len(self.waiting),
            swapped=swapped,
            preemptions=self.num_preemptions,
        )

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """Mark finished and give its pages back (the one exit for every sequence)."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = seq.finish_reason or reason
        seq.stop_reason = stop_reason if seq.stop_reason is None else seq.stop_reason
        self.page_manager.free_pages(seq)
        self._drop_swapped(seq)
        self._release_penalty_slot(seq)
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)

    def preempt(self, seq: Sequence, allow_swap: bool = True) -> None:
        """Free the sequence's pages and requeue it: its computed pages are swapped out when the
        swap pool says so (see `SwapPool.should_swap`), else it is recomputed from its tokens."""
        pm, pool = self.page_manager, self.swap_pool
        computed = pm.pages_for(seq.num_computed_tokens - seq.num_dropped_tokens)
        per_token = self.costs.seconds_per_prompt_token()
        if (
            allow_swap
            and pool is not None
            and pool.should_swap(computed, seq.num_computed_tokens, per_token)
        ):
            seq.swapped = pool.take(seq.pages[:computed])
            self._swap_outs.append((seq, seq.swapped))
            pm.free_pages(seq, keep_progress=True)
        else:
            if pool is not None:
                pool.num_recomputes += 1
            pm.free_pages(seq)
        self._release_penalty_slot(seq)
        self.running.remove(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(seq)

    def _drop_swapped(self, seq: Sequence) -> None:
        """Give back the swap pool pages of a sequence that ends (or is recomputed) swapped out."""
        if seq.swapped is not None:
            self.swap_pool.release(seq.swapped)
            seq.swapped = None

    def recompute(self, seq: Sequence) -> None:
        """Give back its pages and requeue it to be computed again from its tokens (its pages
        hold nothing usable: a failed page copy)."""
        if seq in self.running:
            self.preempt(seq, allow_swap=False)
        else:
            self.page_manager.free_pages(seq)
            self.forget_swapped(seq)

    def swap_out_failed(self, seq: Sequence, swapped: SwappedKV) -> None:
        """Its pages could not be copied out: recompute it from its tokens instead (if it was
        already re-admitted, its swap-in finds no data and recomputes it then)."""
        self.swap_pool.release(swapped)
        if seq.swapped is swapped:
            seq.swapped = None
            seq.num_computed_tokens = seq.num_dropped_tokens = 0
        self.swap_pool.num_recomputes += 1

    def forget_swapped(self, seq: Sequence) -> None:
        """Recompute a swapped-out sequence instead (its copy is not trusted: the cache was lost)."""
        if seq.swapped is not None:
            self._drop_swapped(seq)
            seq.num_computed_tokens = seq.num_dropped_tokens = 0

    def drop_page_moves(self) -> None:
        """Forget the queued page copies (after a failure; the sequences are recomputed)."""
        for _, swapped, _ in self._swap_ins:
            self.swap_pool.release(swapped)
        self._swap_outs, self._swap_ins, self._from_disk = [], [], []

    @property
    def queued_moves(self) -> PageMoves:
        """The page copies the next batch will carry (left queued)."""
        return PageMoves(
            tuple(self._swap_outs),
            tuple(self.page_manager.evicted),
            tuple(self._swap_ins),
            tuple(self._from_disk),
        )

    def take_moves(self) -> PageMoves:
        """The queued page copies, for the caller to dispatch now (the queues empty): `schedule`
        puts them in its batch; a clean shutdown flushes what no batch carried."""
        moves = PageMoves(
            tuple(self._swap_outs),
            tuple(self.page_manager.take_evicted()),
            tuple(self._swap_ins),
            tuple(self._from_disk),
        )
        self._swap_outs, self._swap_ins, self._from_disk = [], [], []
        return moves

    def reset(self) -> None:
        """Rebuild the accounting from scratch once no sequence is left (after `recover`): every
        penalty slot free, no page move queued, the swap pool empty."""
        if self.running or self.waiting:
            raise RuntimeError(
                f"reset() with {len(self.running)} running and {len(self.waiting)} waiting sequences"
            )
        self._swap_outs, self._swap_ins, self._from_disk = [], [], []
        self.free_penalty_slots = list(range(self.config.scheduler.max_num_seqs))
        if self.swap_pool is not None:
            self.swap_pool.reset()

    def check_accounting(self) -> None:
        """Raise AssertionError unless the penalty slots and the swap pool match the sequences
        that hold them (tests call it after every fault)."""
        seqs = self.running + self.waiting
        held = [s.penalty_slot for s in seqs if s.penalty_slot is not None]
        if sorted(held + self.free_penalty_slots) != list(
            range(self.config.scheduler.max_num_seqs)
        ):
            raise AssertionError(
                f"penalty slots: held {sorted(held)}, free {sorted(self.free_penalty_slots)}"
            )
        if self.swap_pool is not None:
            swapped = [s.swapped for s in seqs if s.swapped is not None] + [
                kv for _, kv, _ in self._swap_ins
            ]
            used = sum(kv.num_pages for kv in {id(kv): kv for kv in swapped}.values())
            if used != self.swap_pool.used_pages:
                raise AssertionError(
                    f"swap pool: {self.swap_pool.used_pages} pages used, sequences hold {used}"
                )

    def _take_penalty_slot(self, seq: Sequence) -> None:
        if seq.params.uses_penalties:
            seq.penalty_slot, seq.penalty_loaded = self.free_penalty_slots.pop(), False

    def _release_penalty_slot(self, seq: Sequence) -> None:
        if seq.penalty_slot is not None:
            self.free_penalty_slots.append(seq.penalty_slot)
            seq.penalty_slot = None

    # ------------------------------------------------------------------ scheduling

    def schedule(self, now: float | None = None) -> ScheduledBatch | None:
        """The next step, or None when there is nothing to run: running decodes first (one
        token each, with their drafts), then prompt chunks with what is left of the token
        budget. The batch carries the page copies to run before it (`PageMoves`)."""
        now = time.monotonic() if now is None else now
        cfg = self.config
        seqs = self._schedule_decodes()
        num_decodes = len(seqs)
        drafts = self._propose(seqs) if cfg.speculative is not None else ()
        chunks = [1 + len(d) for d in drafts] or [1] * num_decodes
        self._schedule_prompts(seqs, chunks, self._prompt_budget(seqs, sum(chunks), now), now)
        if not seqs:
            return None
        if len(seqs) == num_decodes and not any(drafts) and self._multi_step_fits(seqs):
            k = cfg.scheduler.num_scheduler_steps
            self.num_multi_steps += 1
            for seq in seqs:  # they fit: `_multi_step_fits` counted the pages
                self.page_manager.allocate_slots(seq, lookahead=k - 1)
            return ScheduledBatch(
                tuple(seqs), tuple(chunks), num_decodes, k, moves=self.take_moves()
            )
        for seq in seqs[num_decodes:]:
            if seq.status == SequenceStatus.WAITING:
                self.waiting.remove(seq)
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                self._take_penalty_slot(seq)
        drafts = drafts + ((),) * (len(seqs) - num_decodes) if any(drafts) else ()
        return ScheduledBatch(
            tuple(seqs), tuple(chunks), num_decodes, drafts=drafts, moves=self.take_moves()
        )

    def _schedule_decodes(self) -> list[Sequence]:
        """Running sequences with one token to feed, most urgent first, each with a page for
        it: made by preempting the least urgent running sequence (maybe itself) until it fits."""
        cfg, pm = self.config, self.page_manager
        decodes: list[Sequence] = []
        for seq in sorted(self.running, key=lambda s: s.sort_key):
            if len(decodes) == cfg.scheduler.max_num_batched_tokens:
                break
            if seq.status != SequenceStatus.RUNNING or seq.num_uncomputed_tokens != 1:
                continue  # preempted below while we walked the list, or a prompt chunk
            if len(seq.output_token_ids) >= seq.params.max_tokens or len(seq) >= cfg.max_model_len:
                continue  # its last token is in flight (async scheduling): it ends when read
            while seq.status == SequenceStatus.RUNNING and pm.allocate_slots(seq) is None:
                self.preempt(
                    max(
                        (s for s in self.running if s.status == SequenceStatus.RUNNING),
                        key=lambda s: s.sort_key,
                    )
                )
            if seq.status == SequenceStatus.RUNNING:
                decodes.append(seq)
        return decodes

    def _schedule_prompts(
        self, seqs: list[Sequence], chunks: list[int], budget: int, now: float
    ) -> None:
        """Append prompt chunks to `seqs` and `chunks` within `budget` tokens: partially
        prefilled sequences, then admissions by priority while the pages and the limits allow."""
        max_num_seqs = self.config.scheduler.max_num_seqs
        candidates = sorted((s for s in self.running if s.is_prefill), key=lambda s: s.sort_key)
        self.waiting.sort(key=lambda s: s.sort_key)
        if self._admissions_open(budget, now):
            candidates += self.waiting
        admitted = 0
        for seq in candidates:
            if budget <= 0 or len(seqs) == max_num_seqs:
                break
            if seq.num_pending:
                continue  # preempted with a token in flight: recompute it once that token is read
            if seq.status == SequenceStatus.WAITING:
                if len(self.running) + admitted >= max_num_seqs:
                    break
                # Keep a page per running sequence (and those admitted in this step) so that
                # admission does not force an instant preemption.
                if not self._admit(seq, reserve=len(self.running) + admitted):
                    break
                admitted += 1
            chunk = min(seq.num_uncomputed_tokens, budget)
            seqs.append(seq)
            chunks.append(chunk)
            budget -= chunk

    def _admit(self, seq: Sequence, reserve: int) -> bool:
        """Give a waiting sequence its pages (`allocate_slots`, all or nothing) and queue the
        copies that fill them: its swapped-out KV, prefix pages found on disk."""
        allocation = self.page_manager.allocate_slots(seq, reserve=reserve)
        if allocation is None:
            return False
        self._from_disk += allocation.disk_loads
        if seq.swapped is not None:  # resumes where it was: copy its KV back first
            pages = allocation.new_pages[: seq.swapped.num_pages]
            self._swap_ins.append((seq, seq.swapped, pages))
            self.swap_pool.num_swap_ins += 1
            seq.swapped = None
        return True

    def wants_draft(self, seq: Sequence) -> bool:
        """The sequence may propose a draft at its next decode (its tokens must all be known:
        the engine then reads the step before scheduling the next)."""
        spec = self.config.speculative
        return (
            spec is not None
            and not seq.params.uses_penalties
            and seq.grammar is None
            and len(seq.output_token_ids) >= seq.spec_resume_at
            and (
                spec.disable_by_batch_size is None
                or len(self.running) <= spec.disable_by_batch_size
            )
        )

    def _propose(self, decodes: list[Sequence]) -> tuple[tuple[int, ...], ...]:
        """N-gram drafts for the decodes that want one, within the token budget and
        `max_model_len`, and with free pages for the tokens they write (prompt work gets what
        is left of the budget: a draft token costs about what a prompt token does)."""
        cfg, pm = self.config, self.page_manager
        spec = cfg.speculative
        prompts_pending = self.waiting or any(s.is_prefill for s in self.running)
        budget = (
            cfg.scheduler.max_num_batched_tokens
            - len(decodes)
            - (MIN_PROMPT_CHUNK if prompts_pending else 0)
        )
        drafts = []
        for seq in decodes:
            draft: list[int] = []
            if budget > 0 and seq.num_pending == 0 and self.wants_draft(seq):
                room = min(
                    spec.num_speculative_tokens,
                    budget,
                    cfg.max_model_len - len(seq),
                    seq.params.max_tokens - len(seq.output_token_ids) - 1,
                )
                draft = propose_ngram(seq.token_ids, spec, room)
                if not draft:
                    note_draft_result(seq, 0)
                elif pm.allocate_slots(seq, lookahead=len(draft)) is None:
                    draft = []
            budget -= len(draft)
            drafts.append(tuple(draft))
        return tuple(drafts)

    def _multi_step_fits(self, decodes: list[Sequence]) -> bool:
        """Run `num_scheduler_steps` decode steps at once: only when no prompt could be
        scheduled (nobody waits, or the running set is full) and none is half computed (a new
        request would wait k steps), every row stays within `max_model_len`, and the pages its
        later steps write are free without preempting anyone."""
        k = self.config.scheduler.num_scheduler_steps
        admissible = self.waiting and len(self.running) < self.config.scheduler.max_num_seqs
        if k == 1 or admissible or any(s.is_prefill for s in self.running):
            return False
        if any(s.grammar is not None for s in decodes):  # each token's mask needs the one before
            return False
        if any(len(s) + k - 1 > self.config.max_model_len for s in decodes):
            return False
        pm = self.page_manager
        return (
            sum(pm.pages_for(s.cache_len + k - 1) - len(s.pages) for s in decodes)
            <= pm.num_free_pages
        )

    def _prompt_budget(self, decodes: list[Sequence], used: int, now: float) -> int:
        """Prompt tokens this step may add after `decodes` (`used` tokens with their drafts).

        The whole budget unless a streaming request is decoding; then as many as keep the step
        within the TPOT target (`target_tpot_ms`, or auto: `AUTO_TPOT_FACTOR` x the measured
        decode-only step of this many decodes), filling the chosen token bucket exactly. A
        prompt that waited past `target_ttft_ms` lifts the limit."""
        cfg = self.config
        left = cfg.scheduler.max_num_batched_tokens - used
        if left <= MIN_PROMPT_CHUNK or not any(s.streaming for s in decodes):
            return left
        if cfg.scheduler.target_ttft_ms is not None:
            # Prompts still before their first token (a preempted sequence had its TTFT already).
            first_tokens = (
                s.arrival_time
                for s in self.waiting + self.running
                if s.is_prefill and not s.output_token_ids
            )
            oldest = min(first_tokens, default=now)
            if (now - oldest) * 1000 >= cfg.scheduler.target_ttft_ms:
                return left
        if cfg.scheduler.target_tpot_ms is not None:
            limit = cfg.scheduler.target_tpot_ms / 1000
        else:
            decode_only = self.costs.seconds.get(bucket_for(len(decodes), self.costs.buckets))
            if decode_only is None:
                return min(left, MIN_PROMPT_CHUNK)  # not measured yet: a small chunk, and learn
            limit = AUTO_TPOT_FACTOR * decode_only
        tokens = self.costs.largest_within(used + MIN_PROMPT_CHUNK, limit)
        return min(left, tokens - used)

    def _admissions_open(self, budget: int, now: float) -> bool:
        """`max_batch_wait_ms`: admit once the oldest waiting prompt has waited that long, or
        the waiting prompts would fill the step or the running set anyway."""
        opens = self.next_admission_time()
        if opens is None or now >= opens:
            return True
        if len(self.running) + len(self.waiting) >= self.config.scheduler.max_num_seqs:
            return True
        return sum(s.num_uncomputed_tokens for s in self.waiting) >= budget

    def next_admission_time(self) -> float | None:
        """When held admissions open at the latest (monotonic seconds), if any are held."""
        if self.config.scheduler.max_batch_wait_ms <= 0 or not self.waiting:
            return None
        return (
            min(s.arrival_time for s in self.waiting)
            + self.config.scheduler.max_batch_wait_ms / 1000
        )
