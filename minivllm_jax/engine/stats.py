"""What the engine tells the outside about itself: `EngineStats` (`LLMEngine.stats()`, a
snapshot of counts and counters) and `StepEvent` (given to each step listener after every
device step). Data only: the server, `LLM` and the benchmarks read these, never the engine's
scheduler, runner or page manager."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine: its queues, its KV pages and its counters since it started.
    Every field is a number, so the stats of several replicas add up field by field."""

    running: int  # sequences scheduled (holding pages)
    waiting: int  # sequences queued (swapped-out ones included)
    free_pages: int  # KV pages nobody holds (cached ones included: they can be evicted)
    usable_pages: int  # all KV pages but the scratch page
    generated_tokens: int  # tokens sampled and read
    prompt_tokens: int  # prompt tokens computed (preempted prompts recomputed count again)
    compiles: int  # step programs built (compiled or loaded)
    programs_loaded: int  # of which loaded whole from the program cache
    preemptions: int
    steps: int  # `step()` calls
    draft_tokens: int = 0  # speculative decoding: draft tokens verified
    accepted_tokens: int = 0  # of which accepted
    # The KV tiers (`KVTiers.stats`): pages in the swap pool and on disk, moves and hits.
    swap_pages: int = 0
    swap_outs: int = 0
    swap_ins: int = 0
    disk_pages: int = 0
    disk_bytes: int = 0
    disk_pages_written: int = 0
    disk_corrupt: int = 0
    memory_hit_tokens: int = 0
    disk_hit_tokens: int = 0
    dropped_pages: int = 0  # KV compression: pages a policy dropped
    # Below: read by tools and tests (the server's /metrics does not render them).
    requests: int = 0  # requests not yet finished (grammars compiling included)
    swapped: int = 0  # of `waiting`, the sequences whose pages sit in the swap pool
    cached_pages: int = 0  # pages the prefix cache maps (held by sequences or free)
    swap_recomputes: int = 0  # preemptions the swap pool could not take (recomputed instead)
    swap_bytes_per_second: float = 0.0  # the swap copy rate measured at warm-up (0: no pool)

    def tiers(self) -> dict[str, int]:
        """The fields from `swap_pages` to `dropped_pages`: where KV lives and moves."""
        names = [f.name for f in dataclasses.fields(self)]
        tier_names = names[names.index("swap_pages") : names.index("dropped_pages") + 1]
        return {name: getattr(self, name) for name in tier_names}

    @property
    def used_pages(self) -> int:
        """KV pages held by sequences (the memory tier)."""
        return self.usable_pages - self.free_pages


@dataclasses.dataclass(frozen=True)
class StepEvent:
    """One device step, given to the step listeners (`LLMEngine.add_step_listener`) once its
    tokens are read. Times are `time.monotonic()`; a step dispatched while the one before it
    ran counts from when that one ended, so consecutive events never overlap."""

    num_seqs: int  # rows: the sequences in the step
    num_decodes: int  # of which decodes (the rest bring prompt tokens)
    num_tokens: int  # tokens fed (drafts included)
    num_steps: int  # decode steps the program ran (several: a multi-step batch)
    token_slots: int  # tokens the compiled program computes (num_tokens + padding)
    seq_slots: int  # rows the compiled program holds (num_seqs + padding)
    num_pages: int  # KV pages its sequences had computed into before the step
    start: float
    end: float

    @property
    def kind(self) -> str:
        """ "mixed" (it carries prompt tokens) or "decode"."""
        return "mixed" if self.num_decodes < self.num_seqs else "decode"

    @property
    def seconds(self) -> float:
        return self.end - self.start
