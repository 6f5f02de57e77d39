"""`Scheduler`: continuous batching over waiting and running sequences (prefill first).

Each call to `schedule()` returns one `ScheduledBatch` as plain data: either a prefill step
(up to `max_prefill_rows` prompts, or chunks of long ones, within the token budget) or a
decode step over every running sequence. Under page pressure the lowest-priority, newest
running sequence is preempted: its pages are freed and it goes back to waiting, to be
recomputed later (its prefix may still be in the prefix cache). Nothing is ever dropped.
"""

from __future__ import annotations

import dataclasses

from minivllm_jax.config import EngineConfig, bucket_for
from minivllm_jax.engine.block_manager import BlockManager
from minivllm_jax.engine.sequence import Sequence, SequenceStatus


@dataclasses.dataclass(frozen=True)
class ScheduledBatch:
    is_prefill: bool
    seqs: tuple[Sequence, ...]
    num_new_tokens: tuple[int, ...]  # tokens each row feeds this step

    def samples_next_token(self, i: int) -> bool:
        """A prefill chunk that stops short of the sequence's end samples nothing."""
        seq = self.seqs[i]
        return seq.num_computed_tokens + self.num_new_tokens[i] == len(seq)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0

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
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)

    # ------------------------------------------------------------------ scheduling

    def schedule(self) -> ScheduledBatch | None:
        return self._schedule_prefill() or self._schedule_decode()

    def _schedule_prefill(self) -> ScheduledBatch | None:
        cfg, bm = self.config, self.block_manager
        rows: list[Sequence] = []
        chunks: list[int] = []
        admitted = 0
        # Chunk continuations (already admitted) go first, then waiting ones by priority.
        candidates = [s for s in self.running if s.is_prefill]
        self.waiting.sort(key=lambda s: s.sort_key)
        candidates += self.waiting
        for seq in candidates:
            if len(rows) == cfg.max_prefill_rows:
                break
            admitting = seq.status == SequenceStatus.WAITING
            if admitting and len(self.running) + admitted >= cfg.max_num_seqs:
                break
            # Check the row fits the step before taking any page: allocating and then rolling
            # back would evict prefix-cache pages on every step a long chunk runs.
            computed = bm.computed_on_admission(seq) if admitting else seq.num_computed_tokens
            chunk = min(len(seq) - computed, cfg.max_num_batched_tokens)
            width = bucket_for(max(chunks + [chunk]), cfg.prefill_token_buckets)
            if rows and len(rows) + 1 > cfg.prefill_row_buckets(width)[-1]:
                break
            if admitting:
                # Keep a page per running sequence (those admitted in this step too) so
                # admission does not force an instant preemption.
                if not bm.can_allocate(seq, reserve=len(self.running) + admitted):
                    break
                bm.allocate(seq)
                admitted += 1
            rows.append(seq)
            chunks.append(chunk)
        if not rows:
            return None
        for seq in rows:
            if seq.status == SequenceStatus.WAITING:
                self.waiting.remove(seq)
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
        return ScheduledBatch(True, tuple(rows), tuple(chunks))

    def _schedule_decode(self) -> ScheduledBatch | None:
        bm = self.block_manager
        rows: list[Sequence] = []
        for seq in sorted(self.running, key=lambda s: s.sort_key):
            if seq.status != SequenceStatus.RUNNING:
                continue  # preempted below while we were walking the list
            while not bm.can_append(seq):
                victim = max((s for s in self.running if s.status == SequenceStatus.RUNNING), key=lambda s: s.sort_key)
                self.preempt(victim)
                if victim is seq:
                    break
            if seq.status == SequenceStatus.RUNNING:
                bm.append(seq)
                rows.append(seq)
        if not rows:
            return None
        return ScheduledBatch(False, tuple(rows), tuple(1 for _ in rows))

    def preempt(self, seq: Sequence) -> None:
        """Free the sequence's pages and requeue it; it is recomputed from its tokens later."""
        self.block_manager.free_pages(seq)
        self.running.remove(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(seq)
