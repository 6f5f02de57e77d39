"""Output processing: what a request's sampled tokens become (vLLM v1's OutputProcessor).

The engine hands each token it reads to `OutputProcessor.accept`, which records its logprobs
and timing, feeds the grammar and the detokenizer, and says whether the sequence stops there
(a stop token, EOS, a stop string, a complete grammar, or a length limit); `StepUpdate` then
finishes it in the scheduler. `output` builds the `RequestOutput` a caller sees. Nothing here
touches pages, the scheduler or the device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Set

from minivllm_jax.engine.detokenizer import IncrementalDetokenizer
from minivllm_jax.engine.runner import StepResult
from minivllm_jax.engine.sequence import Sequence
from minivllm_jax.outputs import CompletionOutput, RequestMetrics, RequestOutput
from minivllm_jax.sampling_params import SamplingParams

# How a sequence ends: its finish reason ("stop", "length") and stop reason (the stop token
# id, the stop string, or None), as `Scheduler.finish` takes them.
Finish = tuple[str, int | str | None]


@dataclasses.dataclass
class RequestState:
    """One request inside the engine: its samples, their detokenizers and its metrics."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    detokenizers: list[IncrementalDetokenizer]
    metrics: RequestMetrics
    # Samples 1..n-1 wait here until sample 0 has computed the prompt, then fork from it.
    held: list[Sequence] = dataclasses.field(default_factory=list)
    error: str | None = None  # why it failed (finish_reason "error"), reported with its output

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


class OutputProcessor:
    """Stop conditions, detokenization, logprobs and `RequestOutput`s for one engine."""

    def __init__(self, tokenizer, eos_token_ids: Set[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def new_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        seqs: list[Sequence],
        arrival: float,
    ) -> RequestState:
        """The state of a request whose samples are `seqs` (sample 0 runs first, the rest are held)."""
        params = seqs[0].params
        detokenizers = [
            IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids, params.skip_special_tokens, params.stop
            )
            for _ in seqs
        ]
        return RequestState(
            request_id,
            prompt,
            prompt_token_ids,
            params,
            seqs,
            detokenizers,
            RequestMetrics(arrival),
            held=seqs[1:],
        )

    def accept(
        self,
        seq: Sequence,
        request: RequestState,
        result: StepResult,
        row: int,
        slot: int,
        now: float,
    ) -> Finish | None:
        """Take the sampled token at `output_token_ids[slot]` (row `row` of `result`) as read:
        logprobs, metrics, the grammar, the text; how the sequence finishes with it, if it does."""
        token = seq.output_token_ids[slot]
        seq.cumulative_logprob += float(result.logprobs[row])
        if seq.params.logprobs is not None:
            k = seq.params.logprobs
            entry = {token: float(result.logprobs[row])}
            entry.update(
                zip(result.top_ids[row, :k].tolist(), result.top_logprobs[row, :k].tolist())
            )
            seq.logprobs.append(entry)
        request.metrics.first_token_time = request.metrics.first_token_time or now
        request.metrics.last_token_time = now
        if seq.grammar is not None:
            # A grammar this token breaks fails its request at the next mask.
            seq.grammar.accept(token)
        detok = request.detokenizers[seq.index]
        finish = self._stop(seq, token, slot + 1, detok)
        if finish is not None:
            detok.flush()
        return finish

    def _stop(
        self, seq: Sequence, token: int, num_outputs: int, detok: IncrementalDetokenizer
    ) -> Finish | None:
        """Whether this token (the sequence's `num_outputs`-th) ends it. A stop token's text
        is never shown."""
        params = seq.params
        if token in params.stop_token_ids:
            return "stop", token
        if token in self.eos_token_ids and not params.ignore_eos:
            return "stop", None
        detok.add([token])
        if detok.finished:  # a stop string: the text is cut before it
            return "stop", detok.stop_reason
        if seq.grammar is not None and seq.grammar.finished:  # the output is complete
            return "stop", None
        if (
            num_outputs >= params.max_tokens
            or len(seq.prompt_token_ids) + num_outputs >= self.max_model_len
        ):
            return "length", None
        return None

    @staticmethod
    def flush_unfinished(request: RequestState) -> list[Sequence]:
        """The samples that have not ended, their held-back text released (the request fails)."""
        unfinished = []
        for seq, detok in zip(request.seqs, request.detokenizers):
            if not seq.is_finished:
                detok.flush()
                unfinished.append(seq)
        return unfinished

    @staticmethod
    def output(request: RequestState) -> RequestOutput:
        """What the caller sees of the request now."""
        outputs = [
            CompletionOutput(
                index=seq.index,
                text=detok.text,
                token_ids=seq.known_output_token_ids,
                cumulative_logprob=seq.cumulative_logprob,
                logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None,
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
            )
            for seq, detok in zip(request.seqs, request.detokenizers)
        ]
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=outputs,
            finished=request.finished,
            metrics=request.metrics,
            num_cached_tokens=max(s.num_cached_tokens for s in request.seqs),
            error=request.error,
        )
