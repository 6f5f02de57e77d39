"""What a device step does to the host's sequences, from dispatch to read (vLLM's
`update_from_output`).

A step is booked when it is dispatched, before its tokens are known (`book`): the tokens it
feeds count as computed and each token it samples is a placeholder, so that the next step can
be scheduled while this one runs (async scheduling). When its tokens are read,
`StepUpdate.apply` puts them in place of the placeholders (with a verify step's accepted draft
tokens), commits the pages that became full, starts the held samples of a request whose prompt
is now computed (n > 1), hands each token to the `OutputProcessor` and finishes the sequence
where that says it stops, then lets the sequence's KV compression policy drop pages. The
engine decides when a step is booked, read or failed; this module owns what that does.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Iterable

from minivllm_jax.engine.decoding.speculative import accepted_length
from minivllm_jax.engine.kv.compression import kept_pages, needs_scores, wants_compression
from minivllm_jax.engine.kv.pages import PageManager
from minivllm_jax.engine.output_processor import OutputProcessor, RequestState
from minivllm_jax.engine.runner import ModelRunner, PendingStep, StepResult
from minivllm_jax.engine.sched_output import ScheduledBatch
from minivllm_jax.engine.scheduler import Scheduler, note_draft_result
from minivllm_jax.engine.sequence import Sequence, SequenceStatus
from minivllm_jax.engine.stats import StepEvent
from minivllm_jax.outputs import RequestOutput

logger = logging.getLogger(__name__)

# Where a row's new tokens are: (the result, the row in it) of each, in order.
Picks = list[tuple[StepResult, int]]


@dataclasses.dataclass(frozen=True)
class InFlight:
    """A dispatched step: its batch, its device results, and for each of its sequences the
    index in `output_token_ids` of the placeholder for the first token it samples (None: none;
    a multi-step batch samples `batch.num_steps` tokens a row, in consecutive places)."""

    batch: ScheduledBatch
    pending: PendingStep
    slots: tuple[int | None, ...]
    dispatched: float
    num_pages: int  # pages its sequences had computed into when it was dispatched

    def event(self, start: float, end: float) -> StepEvent:
        """What the step listeners hear of this step, once its tokens were read at `end`."""
        batch = self.batch
        return StepEvent(
            len(batch.seqs),
            batch.num_decodes,
            batch.num_tokens,
            batch.num_steps,
            *self.pending.bucket,
            self.num_pages,
            start,
            end,
        )


def book(batch: ScheduledBatch, pending: PendingStep, now: float, page_size: int) -> InFlight:
    """Book a dispatched step as done before its tokens are known: each sequence's fed
    tokens count as computed, and each sampled token is a placeholder `-(row + 1)`."""
    slots = []
    num_pages = sum(-(-seq.num_computed_tokens // page_size) for seq in batch.seqs)
    k = batch.num_steps  # a multi-step row also feeds itself the first k - 1 of its k tokens
    for i, seq in enumerate(batch.seqs):
        samples = batch.samples_next_token(i)
        seq.num_computed_tokens += (
            batch.num_new_tokens[i] - len(batch.draft(i)) + k - 1
        )  # drafts: when accepted
        if samples:
            slots.append(len(seq.output_token_ids))
            seq.output_token_ids.extend([-(i + 1)] * k)
            seq.num_pending += k
        else:
            slots.append(None)
    return InFlight(batch, pending, tuple(slots), now, num_pages)


def drop_pending(seq: Sequence) -> None:
    """Forget the placeholders of tokens that will never be read into this sequence."""
    if seq.num_pending:
        del seq.output_token_ids[-seq.num_pending :]
        seq.num_pending = 0


class StepUpdate:
    """Applies read steps to their sequences and counts what they did (the engine's
    token, draft and dropped page counters).

    It holds no sequence or request: the engine passes its request table, scheduler and page
    manager to each `apply` (the scheduler and page manager may be replaced between steps)."""

    def __init__(
        self, output_processor: OutputProcessor, runner: ModelRunner, page_size: int
    ) -> None:
        self.output_processor = output_processor
        self.runner = runner  # `page_scores`, for a KV compression policy that needs them
        self.page_size = page_size
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0
        self.num_draft_tokens = 0  # speculative decoding: draft tokens proposed and verified
        self.num_accepted_tokens = 0  # of which accepted
        self.num_dropped_pages = 0  # KV compression: pages dropped by a policy

    def stats(self) -> dict[str, int]:
        """The token counters' `EngineStats` fields."""
        return dict(
            generated_tokens=self.num_generated_tokens,
            prompt_tokens=self.num_prompt_tokens,
            draft_tokens=self.num_draft_tokens,
            accepted_tokens=self.num_accepted_tokens,
            dropped_pages=self.num_dropped_pages,
        )

    def apply(
        self,
        step: InFlight,
        results: list[StepResult],
        requests: dict[str, RequestState],
        scheduler: Scheduler,
        page_manager: PageManager,
        fail: Callable[[RequestState, str], object],
        only_finished: bool = False,
    ) -> list[RequestOutput]:
        """Put the step's tokens into its sequences; the outputs of the requests that changed
        (of those that finished only, if `only_finished`), and finished ones leave `requests`.
        `results`: one per decode step the program ran (several for a multi-step batch);
        `fail(request, error)`: fails a request whose KV compression policy raised."""
        now = time.monotonic()
        batch = step.batch
        changed: dict[str, RequestState] = {}
        rows = (1 + len(batch.draft(i)) for i in range(len(batch.seqs)))  # verify rows
        starts = [0, *itertools.accumulate(rows)]
        for i, seq in enumerate(batch.seqs):
            request = requests.get(seq.request_id)
            if request is None or seq.is_finished:
                continue  # aborted, or stopped by the step before (this row's token is dropped)
            slot = step.slots[i]
            picks = [] if slot is None else self._put_tokens(batch, i, results, starts[i], slot)
            self._prompt_progress(batch, i, request, scheduler, page_manager)
            if slot is None:
                continue  # a prompt chunk that samples nothing: its request did not change
            self._accept(seq, request, picks, slot, scheduler, now)
            self._maybe_compress(seq, request, page_manager, fail)
            changed[request.request_id] = request
        return self._outputs(changed.values(), requests, only_finished, now)

    def _put_tokens(
        self, batch: ScheduledBatch, i: int, results: list[StepResult], start: int, slot: int
    ) -> Picks:
        """Write row `i`'s tokens over its placeholders, all of them first (every token below
        `num_computed_tokens` is then known); accepted draft tokens were computed in the step."""
        seq = batch.seqs[i]
        picks = self._sampled(batch, i, results, start)
        tokens = [int(result.tokens[row]) for result, row in picks]
        extra = len(tokens) - batch.num_steps  # accepted draft tokens: computed in the step
        seq.output_token_ids[slot : slot + batch.num_steps] = tokens
        seq.num_pending += extra
        seq.num_computed_tokens += extra
        return picks

    def _prompt_progress(
        self,
        batch: ScheduledBatch,
        i: int,
        request: RequestState,
        scheduler: Scheduler,
        page_manager: PageManager,
    ) -> None:
        """What row `i`'s computed tokens give: full pages to share (commit), prompt tokens
        counted, and once the prompt is computed, the request's held samples."""
        seq = batch.seqs[i]
        if seq.status == SequenceStatus.RUNNING:  # not when swapped out meanwhile: no pages
            page_manager.commit(seq)
        if i >= batch.num_decodes:
            self.num_prompt_tokens += batch.num_new_tokens[i]
        if (
            request.held
            and seq.status == SequenceStatus.RUNNING
            and seq.num_computed_tokens >= len(request.prompt_token_ids)
        ):
            fork(request, seq, scheduler, page_manager)  # before a stop can free its pages

    def _accept(
        self,
        seq: Sequence,
        request: RequestState,
        picks: Picks,
        slot: int,
        scheduler: Scheduler,
        now: float,
    ) -> None:
        """Hand the row's tokens to the output processor in order; finish the sequence at the
        first one it stops on (the tokens after it are dropped)."""
        for j, (result, row) in enumerate(picks):
            seq.num_pending -= 1
            self.num_generated_tokens += 1
            finish = self.output_processor.accept(seq, request, result, row, slot + j, now)
            if finish is not None:
                scheduler.finish(seq, *finish)
                drop_pending(seq)  # tokens past the stop, and a row the next step spent on it
                break

    def _maybe_compress(
        self,
        seq: Sequence,
        request: RequestState,
        page_manager: PageManager,
        fail: Callable[[RequestState, str], object],
    ) -> None:
        """Run the sequence's KV compression policy, if it has one, is running and its held
        samples have forked (they share its prompt pages); a policy that raises fails only
        its own request."""
        if seq.kv_compression is None or seq.status != SequenceStatus.RUNNING or request.held:
            return
        try:
            self._compress(seq, page_manager)
        except Exception as e:  # noqa: BLE001 (its policy failed: only this request ends)
            logger.exception("KV compression of %r failed; failing its request", seq)
            fail(request, f"kv_compression: {type(e).__name__}: {e}")

    def _outputs(
        self,
        changed: Iterable[RequestState],
        requests: dict[str, RequestState],
        only_finished: bool,
        now: float,
    ) -> list[RequestOutput]:
        """The changed requests' outputs; finished ones are timed and leave `requests`."""
        outputs = []
        for request in changed:
            if request.finished or not only_finished:
                outputs.append(self.output_processor.output(request))
            if request.finished:
                request.metrics.finished_time = request.metrics.finished_time or now
                requests.pop(request.request_id, None)  # a failed one is gone already
        return outputs

    def _compress(self, seq: Sequence, page_manager: PageManager) -> None:
        """Apply the sequence's KV compression policy: drop the full pages it does not keep
        (`minivllm_jax.engine.kv.compression`), back to the pool. Steps already dispatched read
        the old page list and run before any later step can reuse a dropped page; later steps
        see the shorter list, with the tokens' true positions (`Sequence.num_dropped_tokens`)."""
        config, ps = seq.kv_compression, self.page_size
        known = min(seq.num_computed_tokens, len(seq) - seq.num_pending)  # tokens computed and read
        full = (
            known - 1 - seq.num_dropped_tokens
        ) // ps  # full pages before the last known token's
        if not wants_compression(config, full, ps):
            return
        scores = None
        if needs_scores(config):  # waits for the steps in flight: once per page the sequence fills
            scores = self.runner.page_scores(seq, known - 1)
        keep = set(kept_pages(config, full, ps, scores))
        dropped = [p for i, p in enumerate(seq.pages[:full]) if i not in keep]
        seq.pages = [p for i, p in enumerate(seq.pages[:full]) if i in keep] + seq.pages[full:]
        seq.page_hashes = []  # its pages no longer follow the prefix chain (commit stops too)
        seq.num_dropped_tokens += len(dropped) * ps
        page_manager.release(dropped)
        self.num_dropped_pages += len(dropped)

    def _sampled(
        self, batch: ScheduledBatch, i: int, results: list[StepResult], start: int
    ) -> Picks:
        """Where row `i`'s new tokens are: one per result (a multi-step batch gives several), or
        in a verify step the samples at its last token and at each accepted draft token."""
        draft = batch.draft(i)
        if not draft:
            return [(result, start if batch.drafts else i) for result in results]
        sampled = results[0].tokens[start : start + len(draft) + 1].tolist()
        accepted = accepted_length(draft, sampled)
        self.num_draft_tokens += len(draft)
        self.num_accepted_tokens += accepted
        note_draft_result(batch.seqs[i], accepted)
        return [(results[0], start + j) for j in range(accepted + 1)]


def fork(
    request: RequestState, parent: Sequence, scheduler: Scheduler, page_manager: PageManager
) -> None:
    """Start the held samples on the parent's computed prompt: they share its full pages by
    refcount and compute only the last partial page (under page_size tokens) themselves,
    which also gives each its own logits row to sample its first token from."""
    for child in request.held:
        page_manager.fork(parent, child, len(request.prompt_token_ids) - 1)
        scheduler.add(child)
    request.held = []
