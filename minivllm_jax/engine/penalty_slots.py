"""`PenaltySlots`: the rows of the device penalty state (`step.PenaltyState`) a step reads.

Contract: the scheduler gives a running sequence that uses penalties a slot
(`Sequence.penalty_slot`, with `penalty_loaded` False). Before the first step that feeds it,
`load_new` writes into that row the tokens the sequence will not feed itself (cached or forked
prompt pages, or all of them after a preemption); every step then updates the row itself
(`step.py`). `rows` gives each row of a step its slot, the scratch slot for a sequence without
one (and for padding).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from minivllm_jax.config import EngineConfig
from minivllm_jax.engine.compilation import CompileManager
from minivllm_jax.engine.device_state import DeviceState
from minivllm_jax.engine.sequence import Sequence
from minivllm_jax.engine.step import PenaltyRows, load_penalty_row_jit
from minivllm_jax.parallel import distributed
from minivllm_jax.parallel.distributed import StepChannel


class PenaltySlots:
    """Loads and addresses the rows of `state.penalty_state`; with a `channel` (the leader of a
    multi-process run) each load is announced so that the followers make it too."""

    def __init__(
        self,
        state: DeviceState,
        programs: CompileManager,
        config: EngineConfig,
        channel: StepChannel | None,
    ) -> None:
        self.state = state
        self.programs = programs
        self.config = config
        self.channel = channel

    def empty_inputs(self) -> tuple:
        """Inputs of a row load (slot, tokens, known, prompt length): their shapes and dtypes."""
        tokens = np.zeros(self.config.max_model_len, np.int32)
        return np.int32(0), tokens, np.int32(0), np.int32(0)

    def program(self) -> Any:
        """The row-load program (compiled at warm-up)."""
        inputs = self.state.abstract(self.empty_inputs())
        return self.programs.program(
            ("load_penalty_row",), load_penalty_row_jit, self.state.penalty_state, *inputs
        )

    def load_row(self, inputs: tuple) -> None:
        """Run one row load (`empty_inputs`' layout); a follower runs the leader's this way."""
        state = self.state
        state.penalty_state = self.program()(state.penalty_state, *state.place(inputs))

    def load_new(self, seqs: tuple[Sequence, ...]) -> None:
        """Load the row of each sequence that just got a slot (see the module docstring)."""
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
            self.load_row(inputs)
            seq.penalty_loaded = True

    def rows(self, seqs: tuple[Sequence, ...], num_seqs: int) -> PenaltyRows:
        """Each row's slot and prompt length for a step of `num_seqs` rows, and whether any
        row applies penalties."""
        scratch = self.state.penalty_state.scratch_slot
        slots = np.full(num_seqs, scratch, np.int32)
        prompt_lens = np.zeros(num_seqs, np.int32)
        for i, seq in enumerate(seqs):
            slots[i] = scratch if seq.penalty_slot is None else seq.penalty_slot
            prompt_lens[i] = len(seq.prompt_token_ids)
        return PenaltyRows(
            slots, prompt_lens, np.bool_(any(s.penalty_slot is not None for s in seqs))
        )

    def scratch_rows(self, num_seqs: int) -> PenaltyRows:
        """Every row on the scratch slot with penalties on (a warm-up run touches every part)."""
        scratch = np.full(num_seqs, self.state.penalty_state.scratch_slot, np.int32)
        return PenaltyRows(scratch, np.zeros(num_seqs, np.int32), np.bool_(True))
