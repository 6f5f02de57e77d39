"""How a failure is contained, mechanically: whom a failed step blames, the batch without its
failed rows, and how the host state is rebuilt when the KV cache was lost (every sequence is
recomputed from its tokens) or when a crash left it unknown (every sequence is dropped).

The engine decides when each applies and fails the requests (`LLMEngine.step`, `recover`);
nothing here reads requests or touches the device.
"""

from __future__ import annotations

from minivllm_jax.engine.kv.pages import PageManager
from minivllm_jax.engine.sched_output import ScheduledBatch
from minivllm_jax.engine.scheduler import Scheduler
from minivllm_jax.engine.sequence import Sequence, SequenceStatus


class DispatchFailed(Exception):
    """Dispatching `batch` raised (the cause): the step is failed as a whole."""

    def __init__(self, batch: ScheduledBatch) -> None:
        super().__init__(f"dispatching a step over {len(batch.seqs)} sequences failed")
        self.batch = batch


def without(batch: ScheduledBatch, drop: set[int]) -> ScheduledBatch | None:
    """The batch less the sequences whose `seq_id` is in `drop` (None if none is left): a row
    that failed on the host costs only itself, the step runs without it."""
    keep = [i for i, seq in enumerate(batch.seqs) if seq.seq_id not in drop]
    if not keep:
        return None
    drafts = tuple(batch.drafts[i] for i in keep) if batch.drafts else ()
    return ScheduledBatch(
        tuple(batch.seqs[i] for i in keep),
        tuple(batch.num_new_tokens[i] for i in keep),
        sum(1 for i in keep if i < batch.num_decodes),
        batch.num_steps,
        drafts if any(drafts) else (),
    )


def suspects(batch: ScheduledBatch) -> list[str]:
    """The ids of the requests a failed step is blamed on, each once, in batch order.

    Every step carries the running decodes, so blaming the whole step would let one bad
    prompt end every stream. The suspects are the requests that brought prompt work into
    the step; its decodes did not advance and simply run again next step (should a
    decode-only step fail, all of its requests are the suspects)."""
    seqs = batch.seqs[batch.num_decodes :] or batch.seqs
    return list(dict.fromkeys(seq.request_id for seq in seqs))


def recompute_all(scheduler: Scheduler, page_manager: PageManager) -> None:
    """The KV cache was rebuilt empty: no page holds what the host thinks, so every sequence
    gives its pages back (running ones go back to waiting, to be recomputed from their
    tokens), queued page copies are forgotten and the prefix cache forgets every page."""
    for seq in list(scheduler.running):
        scheduler.preempt(seq, allow_swap=False)
    for seq in list(scheduler.waiting):
        if seq.pages:  # a waiting sample may already share its prompt's pages (forked)
            page_manager.free_pages(seq)
        scheduler.forget_swapped(seq)
    # Queued page copies go, and every cached page: one queued to be filled from disk holds
    # nothing yet.
    scheduler.drop_page_moves()
    page_manager.clear_cache()
    page_manager.reset()  # no sequence holds a page now: the accounting starts afresh


def abandon(seqs: list[Sequence], scheduler: Scheduler) -> None:
    """After a crash (state unknown): end every sequence ("abort" unless it had a reason) and
    empty the scheduler's queues. Their pages, swap copies and penalty rows are dropped, not
    freed: the accounting they would be freed into is not trusted (`reset_accounting`)."""
    for seq in seqs:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = seq.finish_reason or "abort"
        seq.pages, seq.page_hashes, seq.swapped, seq.penalty_slot = [], [], None, None
    scheduler.running, scheduler.waiting = [], []


def reset_accounting(scheduler: Scheduler, page_manager: PageManager) -> None:
    """With no sequence left, rebuild the accounting from scratch rather than trust what a
    crash left (refcounts, free list, prefix cache, penalty slots, swap pool), so that
    recovering can never fail on it."""
    page_manager.reset()
    scheduler.reset()
