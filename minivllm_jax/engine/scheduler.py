"""`Scheduler`: continuous batching into one kind of step under a token budget.

Every call to `schedule()` fills one ragged step: running decodes first (one token each,
most urgent first), then prompt chunks (partially prefilled sequences, then waiting ones by
priority) with what is left. While streaming requests decode, the prompt tokens added to a
step are limited so the step stays within the TPOT target (`StepCosts`); offline work gets
the whole budget. Under page pressure the lowest-priority, newest running sequence is
preempted: its pages are freed and it waits to be recomputed (its prefix may still be
cached), or its KV is swapped out to the host pool and back (`minivllm_jax.engine.kv.swap`; the
copies are queued in `swap_outs`/`swap_ins` for the engine). Nothing is ever dropped.
"""

from __future__ import annotations

import dataclasses
import time

from minivllm_jax.config import AUTO_TPOT_FACTOR, EngineConfig, bucket_for
from minivllm_jax.engine.decoding.speculative import MAX_BACKOFF, propose_ngram
from minivllm_jax.engine.kv.block_manager import BlockManager
from minivllm_jax.engine.kv.swap import SwappedKV, SwapPool
from minivllm_jax.engine.sequence import Sequence, SequenceStatus

MIN_PROMPT_CHUNK = 16  # prompt tokens a step may always add: waiting prompts always progress


@dataclasses.dataclass(frozen=True)
class ScheduledBatch:
    seqs: tuple[Sequence, ...]  # decodes first, then prompt chunks
    num_new_tokens: tuple[int, ...]  # tokens each sequence feeds this step
    num_decodes: int
    num_steps: int = 1  # > 1: a decode-only batch run that many steps in one program
    # Speculative decoding: each decode's draft tokens, fed after its last token (counted in
    # num_new_tokens) and verified in the step; empty when the batch speculates nothing.
    drafts: tuple[tuple[int, ...], ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def draft(self, i: int) -> tuple[int, ...]:
        return self.drafts[i] if self.drafts else ()

    def samples_next_token(self, i: int) -> bool:
        """A prompt chunk that stops short of the sequence's end samples nothing."""
        seq = self.seqs[i]
        return seq.num_computed_tokens + self.num_new_tokens[i] - len(self.draft(i)) == len(seq)


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
        self, config: EngineConfig, block_manager: BlockManager, swap_pool: SwapPool | None = None
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        self.swap_pool = swap_pool
        # Pages to copy out, in order, before the next step (each with its sequence) ...
        self.swap_outs: list[tuple[Sequence, SwappedKV]] = []
        self.swap_ins: list[
            tuple[Sequence, SwappedKV, list[int]]
        ] = []  # ... and to copy back into these pages
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

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """Mark finished and give its pages back (the one exit for every sequence)."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = seq.finish_reason or reason
        seq.stop_reason = stop_reason if seq.stop_reason is None else seq.stop_reason
        self.block_manager.free_pages(seq)
        self._drop_swapped(seq)
        self._release_penalty_slot(seq)
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)

    def preempt(self, seq: Sequence, allow_swap: bool = True) -> None:
        """Free the sequence's pages and requeue it: its computed pages are swapped out when the
        swap pool says so (see `SwapPool.should_swap`), else it is recomputed from its tokens."""
        bm, pool = self.block_manager, self.swap_pool
        computed = bm.pages_for(seq.num_computed_tokens - seq.num_dropped_tokens)
        per_token = self.costs.seconds_per_prompt_token()
        if (
            allow_swap
            and pool is not None
            and pool.should_swap(computed, seq.num_computed_tokens, per_token)
        ):
            seq.swapped = pool.take(seq.pages[:computed])
            self.swap_outs.append((seq, seq.swapped))
            bm.free_pages(seq, keep_progress=True)
        else:
            if pool is not None:
                pool.num_recomputes += 1
            bm.free_pages(seq)
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
            self.block_manager.free_pages(seq)
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
        """Forget the queued swap copies (after a failure; the sequences are recomputed)."""
        for _, swapped, _ in self.swap_ins:
            self.swap_pool.release(swapped)
        self.swap_outs, self.swap_ins = [], []

    def reset(self) -> None:
        """Rebuild the accounting from scratch once no sequence is left (after `recover`): every
        penalty slot free, no page move queued, the swap pool empty."""
        if self.running or self.waiting:
            raise RuntimeError(
                f"reset() with {len(self.running)} running and {len(self.waiting)} waiting sequences"
            )
        self.swap_outs, self.swap_ins = [], []
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
                kv for _, kv, _ in self.swap_ins
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
        now = time.monotonic() if now is None else now
        cfg, bm = self.config, self.block_manager
        seqs: list[Sequence] = []
        chunks: list[int] = []

        # 1. Decodes, most urgent first; make page room by preempting the least urgent.
        for seq in sorted(self.running, key=lambda s: s.sort_key):
            if len(seqs) == cfg.scheduler.max_num_batched_tokens:
                break
            if seq.status != SequenceStatus.RUNNING or seq.num_uncomputed_tokens != 1:
                continue  # preempted below while we walked the list, or a prompt chunk
            if len(seq.output_token_ids) >= seq.params.max_tokens or len(seq) >= cfg.max_model_len:
                continue  # its last token is in flight (async scheduling): it ends when read
            while not bm.can_append(seq):
                victim = max(
                    (s for s in self.running if s.status == SequenceStatus.RUNNING),
                    key=lambda s: s.sort_key,
                )
                self.preempt(victim)
                if victim is seq:
                    break
            if seq.status == SequenceStatus.RUNNING:
                bm.append(seq)
                seqs.append(seq)
                chunks.append(1)
        num_decodes = len(seqs)
        drafts = self._propose(seqs) if cfg.speculative is not None else ()
        chunks = [1 + len(d) for d in drafts] or chunks

        # 2. Prompt chunks: partially prefilled sequences, then admissions by priority.
        budget = self._prompt_budget(seqs, sum(chunks), now)
        candidates = sorted((s for s in self.running if s.is_prefill), key=lambda s: s.sort_key)
        self.waiting.sort(key=lambda s: s.sort_key)
        if self._admissions_open(budget, now):
            candidates += self.waiting
        admitted = 0
        for seq in candidates:
            if budget <= 0 or len(seqs) == cfg.scheduler.max_num_seqs:
                break
            if seq.num_pending:
                continue  # preempted with a token in flight: recompute it once that token is read
            admitting = seq.status == SequenceStatus.WAITING
            if admitting:
                if len(self.running) + admitted >= cfg.scheduler.max_num_seqs:
                    break
                # Keep a page per running sequence (and those admitted in this step) so that
                # admission does not force an instant preemption.
                if not bm.can_allocate(seq, reserve=len(self.running) + admitted):
                    break
                swapped = seq.swapped
                bm.allocate(seq)
                if swapped is not None:  # resumes where it was: copy its KV back first
                    self.swap_ins.append((seq, swapped, seq.pages[: swapped.num_pages]))
                    self.swap_pool.num_swap_ins += 1
                    seq.swapped = None
                admitted += 1
            chunk = min(seq.num_uncomputed_tokens, budget)
            seqs.append(seq)
            chunks.append(chunk)
            budget -= chunk
        if not seqs:
            return None
        if len(seqs) == num_decodes and not any(drafts) and self._multi_step_fits(seqs):
            self.num_multi_steps += 1
            for seq in seqs:
                bm.append(seq, lookahead=cfg.scheduler.num_scheduler_steps - 1)
            return ScheduledBatch(
                tuple(seqs), tuple(chunks), num_decodes, cfg.scheduler.num_scheduler_steps
            )
        for seq in seqs[num_decodes:]:
            if seq.status == SequenceStatus.WAITING:
                self.waiting.remove(seq)
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                self._take_penalty_slot(seq)
        drafts = drafts + ((),) * (len(seqs) - num_decodes) if any(drafts) else ()
        return ScheduledBatch(tuple(seqs), tuple(chunks), num_decodes, drafts=drafts)

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
        cfg, bm = self.config, self.block_manager
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
                elif bm.can_append(seq, lookahead=len(draft)):
                    bm.append(seq, lookahead=len(draft))
                else:
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
        bm = self.block_manager
        return (
            sum(bm.pages_for(s.cache_len + k - 1) - len(s.pages) for s in decodes)
            <= bm.num_free_pages
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
