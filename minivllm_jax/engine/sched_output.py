"""What the scheduler hands the engine and the runner each step: data only, no behaviour.

The runner imports these types, never the scheduler (vLLM v1's `sched/output.py`). A
`ScheduledBatch` is one ragged step: the sequences it feeds, how many tokens each, their draft
tokens, and the page copies (`PageMoves`) that must run on the device before it.
"""

from __future__ import annotations

import dataclasses

from minivllm_jax.engine.kv.pages import CachedPage
from minivllm_jax.engine.kv.swap import SwappedKV
from minivllm_jax.engine.sequence import Sequence


@dataclasses.dataclass(frozen=True)
class PageMoves:
    """Page copies to dispatch before a step, in this order (`KVTiers.move_pages`): copies out
    first (they read pages that the copies in and the step may then overwrite), then copies in."""

    swap_outs: tuple[tuple[Sequence, SwappedKV], ...] = ()  # preempted: its pages to the host
    to_disk: tuple[tuple[int, CachedPage], ...] = ()  # cached pages about to be reused
    swap_ins: tuple[tuple[Sequence, SwappedKV, tuple[int, ...]], ...] = ()  # resumed: into pages
    from_disk: tuple[tuple[int, dict], ...] = ()  # prefix pages found on disk: their contents

    def __bool__(self) -> bool:
        return bool(self.swap_outs or self.to_disk or self.swap_ins or self.from_disk)


NO_MOVES = PageMoves()


@dataclasses.dataclass(frozen=True)
class ScheduledBatch:
    """One ragged step: the sequences it feeds (decodes first), how many tokens each, their
    draft tokens, and the page copies to run before it."""

    seqs: tuple[Sequence, ...]  # decodes first, then prompt chunks
    num_new_tokens: tuple[int, ...]  # tokens each sequence feeds this step
    num_decodes: int
    num_steps: int = 1  # > 1: a decode-only batch run that many steps in one program
    # Speculative decoding: each decode's draft tokens, fed after its last token (counted in
    # num_new_tokens) and verified in the step; empty when the batch speculates nothing.
    drafts: tuple[tuple[int, ...], ...] = ()
    moves: PageMoves = NO_MOVES  # to run before the step

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def draft(self, i: int) -> tuple[int, ...]:
        return self.drafts[i] if self.drafts else ()

    def samples_next_token(self, i: int) -> bool:
        """A prompt chunk that stops short of the sequence's end samples nothing."""
        seq = self.seqs[i]
        return seq.num_computed_tokens + self.num_new_tokens[i] - len(self.draft(i)) == len(seq)
