"""Beam search (`LLM.beam_search`) with HF transformers' rules, on the engine's paged KV cache.

Each round feeds every live beam of every prompt as one ragged batch (each prompt's prefill
once, then one token a beam) and reads the top 2k log-probs of each beam (`(1 + #EOS ids) * k`
with several EOS ids); the host then picks the next beams as HF `generate(num_beams=k,
do_sample=False)` does (`_beam_search`): the top 2k continuations over all beams by cumulative
log-prob; of them, the top k that end (EOS or the token limit) become finished hypotheses
scored `cum_logprob / generated_len ** length_penalty` (EOS counted), and the best k that do
not end run on. A prompt stops when its k hypotheses cannot be beaten (HF's heuristic), when
`early_stopping=True` and k have finished, or at `max_tokens`. Hypotheses come back best first.

Beams share pages: a beam's first child takes its pages over, each further child shares its
full pages by refcount and gets a private copy of the last, partial page (copy-on-write), and a
beam without children gives its pages back.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence as Seq
from typing import Any

import numpy as np

from minivllm_jax.engine.engine import LLMEngine
from minivllm_jax.engine.scheduler import ScheduledBatch
from minivllm_jax.engine.sequence import Sequence
from minivllm_jax.sampling_params import MAX_LOGPROBS, SamplingParams

Prompt = str | Seq[int] | dict[str, Any]
_Choice = tuple[np.float32, int, int]  # a continuation: (cumulative log-prob, parent beam, token)


@dataclasses.dataclass(frozen=True)
class BeamSearchParams:
    """`early_stopping` as HF's: False (stop when the heuristic says no running beam can win),
    True (also stop as soon as `beam_width` hypotheses are finished) or "never" (the heuristic
    assumes a running beam may reach `max_tokens` when `length_penalty > 0`)."""

    beam_width: int
    max_tokens: int
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        # The 2k candidates of a beam come from the step's top logprobs (at most MAX_LOGPROBS).
        if not isinstance(self.beam_width, int) or not 1 <= self.beam_width <= MAX_LOGPROBS // 2:
            raise ValueError(f"beam_width must be an integer in [1, {MAX_LOGPROBS // 2}], got {self.beam_width!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not isinstance(self.length_penalty, (int, float)) or not np.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")


@dataclasses.dataclass
class BeamSearchSequence:
    tokens: list[int]  # the prompt and the generated tokens (the EOS that ended it included), as vLLM's
    cum_logprob: float  # sum of the generated tokens' log-probs
    score: float  # cum_logprob / num_generated ** length_penalty: the ranking
    text: str  # the generated tokens decoded (without the EOS)
    finish_reason: str  # "stop" (EOS) or "length"


@dataclasses.dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # beam_width hypotheses, best first


@dataclasses.dataclass
class _Beam:
    seq: Sequence
    score: np.float32  # cumulative log-prob (float32 sums, as HF's)


class _Search:
    """One prompt's beams and finished hypotheses: HF's per-prompt state."""

    def __init__(self, seq: Sequence, params: BeamSearchParams, num_candidates: int) -> None:
        self.params = params
        self.num_candidates = num_candidates  # HF keeps (1 + #EOS tokens) * k, at least 2k
        self.prompt_len = len(seq.prompt_token_ids)
        self.running = [_Beam(seq, np.float32(0.0))]  # HF's other initial beams score -1e9: never picked
        self.finished: list[tuple[np.float32, list[int], np.float32]] = []  # (score, tokens, cum), best first
        self.improvable = True  # HF's is_early_stop_heuristic_unsatisfied
        self.done = False

    def _normalized(self, cum: np.float32, length: int) -> np.float32:
        return cum / np.float32(length**self.params.length_penalty)  # as torch divides a float32 tensor

    def advance(self, rows: list[tuple[np.ndarray, np.ndarray]], eos: frozenset[int]) -> list[_Choice]:
        """Take the running beams' top (ids, logprobs) rows; returns the next running beams as
        (cumulative score, parent beam, token), best first, and updates the finished ones."""
        p, k, n = self.params, self.params.beam_width, self.num_candidates
        generated = len(self.running[0].seq.output_token_ids) + 1  # by each candidate
        cands = [(b.score + lp, i, int(t)) for i, (b, (ids, lps)) in enumerate(zip(self.running, rows))
                 for t, lp in zip(ids[:n], lps[:n]) if t >= 0]  # fmt: skip
        cands = sorted(cands, key=lambda c: (-c[0], c[1], c[2]))[:n]  # ties: HF's flat (beam, token) order
        ends = [(t in eos and not p.ignore_eos) or generated >= p.max_tokens for _, _, t in cands]
        full = len(self.finished) == k
        if self.improvable and not (full and p.early_stopping is True):
            for (cum, i, t), end in zip(cands[:k], ends):  # only the top k may finish
                if end:
                    self.finished.append((self._normalized(cum, generated), self.running[i].seq.token_ids + [t], cum))
            self.finished = sorted(self.finished, key=lambda h: -h[0])[:k]  # stable: earlier ones first on ties
        running = [c for c, end in zip(cands, ends) if not end][:k]
        if running and len(self.finished) == k:  # can the best running beam still beat the worst hypothesis?
            never = p.early_stopping == "never" and p.length_penalty > 0
            best = self._normalized(running[0][0], p.max_tokens if never else generated)
            self.improvable = self.improvable and bool(best > self.finished[-1][0])
        self.done = not running or not self.improvable or (p.early_stopping is True and len(self.finished) == k)
        return [] if self.done else running


def _rebeam(engine: LLMEngine, search: _Search, chosen: list[_Choice]) -> list[tuple[int, int]]:
    """Move the search's pages to its next beams; returns the (src, dst) pages to copy first."""
    bm = engine.block_manager
    parents = [b.seq for b in search.running]
    first = {}  # parent -> index in `chosen` of the child that takes its pages over
    for j, (_, i, _) in enumerate(chosen):
        first.setdefault(i, j)
    for i, parent in enumerate(parents):
        if i not in first:
            bm.free_pages(parent)
    copies, seqs = [], []
    for j, (_, i, _) in enumerate(chosen):  # forks before any child writes into its parent
        if first[i] == j:
            seqs.append(parents[i])
            continue
        child = Sequence(parents[i].request_id, parents[i].prompt_token_ids, parents[i].params)
        child.output_token_ids = list(parents[i].output_token_ids)
        pair = bm.fork_copy_on_write(parents[i], child)
        copies += [pair] if pair is not None else []
        seqs.append(child)
    for seq, (_, _, token) in zip(seqs, chosen):
        seq.output_token_ids.append(token)
        bm.append(seq)
    search.running = [_Beam(seq, score) for seq, (score, _, _) in zip(seqs, chosen)]
    return copies


def _run_round(engine: LLMEngine, seqs: list[Sequence], n: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Feed every sequence its uncomputed tokens in as few steps as `max_num_seqs` and the token
    budget allow (a long prompt in chunks), all dispatched before any is read; returns each
    sequence's top-n (ids, logprobs) after its last token."""
    cfg, runner = engine.config, engine.runner
    dispatched, i = [], 0
    while i < len(seqs):
        batch, budget = [], cfg.max_num_batched_tokens
        while i < len(seqs) and len(batch) < cfg.max_num_seqs and budget > 0:
            q = min(seqs[i].num_uncomputed_tokens, budget)
            batch.append((i, seqs[i], q))
            budget -= q
            i += q == seqs[i].num_uncomputed_tokens  # else the rest of this prompt goes in the next step
        step = ScheduledBatch(tuple(s for _, s, _ in batch), tuple(q for _, _, q in batch),
                              len(batch) if all(q == 1 for *_, q in batch) else 0)  # fmt: skip
        last = [(j, row) for row, (j, s, q) in enumerate(batch) if q == s.num_uncomputed_tokens]
        engine.move_pages()  # pages the allocations evicted go to the disk tier first, if any
        dispatched.append((runner.run(step), last))
        for _, seq, q in batch:
            seq.num_computed_tokens += q
    rows: list[Any] = [None] * len(seqs)
    for pending, last in dispatched:
        result = pending.fetch()[0]
        for j, row in last:
            rows[j] = (result.top_ids[row, :n], result.top_logprobs[row, :n].astype(np.float32))
    return rows


def _prompt_ids(engine: LLMEngine, prompt: Prompt) -> list[int]:
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            prompt = prompt["prompt_token_ids"]
        elif "prompt" in prompt:
            prompt = prompt["prompt"]
        else:
            raise ValueError("a dict prompt needs a 'prompt' or 'prompt_token_ids' key")
    return engine.tokenize(prompt)[1]


def beam_search(engine: LLMEngine, prompts: list[Prompt], params: BeamSearchParams) -> list[BeamSearchOutput]:
    """Run beam search for each prompt on an idle engine; one output per prompt, in order."""
    if not isinstance(params, BeamSearchParams):
        raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
    if engine.requests or engine.has_unfinished():
        raise RuntimeError(f"beam_search drives the model directly and needs an idle engine: {len(engine.requests)} "
                           "request(s) are unfinished; let them finish or abort them")  # fmt: skip
    if engine.runner.channel is not None:
        raise RuntimeError("beam_search does not run across several processes")
    eos = frozenset() if params.ignore_eos else engine.eos_token_ids
    num_candidates = max(2, 1 + len(eos)) * params.beam_width
    if num_candidates > MAX_LOGPROBS:
        raise ValueError(f"beam_width={params.beam_width} with {len(eos)} EOS tokens needs more than {MAX_LOGPROBS} "
                         "candidates a beam")  # fmt: skip
    ids = [_prompt_ids(engine, p) for p in prompts]
    bm, limit = engine.block_manager, engine.config.max_model_len
    need = [params.beam_width * bm.pages_for(len(p) + params.max_tokens) for p in ids]  # pages at worst, no sharing
    for p, n in zip(ids, need):
        if len(p) + params.max_tokens > limit:
            raise ValueError(f"prompt ({len(p)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                             f"max_model_len ({limit})")  # fmt: skip
        if n > bm.num_usable_pages:
            raise ValueError(f"beam_width={params.beam_width} beams of {len(p) + params.max_tokens} tokens need up to "
                             f"{n} KV pages; the cache has {bm.num_usable_pages}")  # fmt: skip
    engine.step()  # reads a step still in flight (a finished request's last, wasted row), if any
    sampling = SamplingParams(temperature=0.0, max_tokens=params.max_tokens, logprobs=num_candidates)
    searches = [_Search(Sequence("beam", p, sampling), params, num_candidates) for p in ids]
    start = 0
    while start < len(searches):  # as many prompts at once as their pages fit at worst
        end, pages = start + 1, need[start]
        while end < len(searches) and pages + need[end] <= bm.num_free_pages:
            pages, end = pages + need[end], end + 1
        _search_group(engine, searches[start:end], eos)
        start = end
    return [_output(engine, s) for s in searches]


def _search_group(engine: LLMEngine, searches: list[_Search], eos: frozenset[int]) -> None:
    bm, n = engine.block_manager, searches[0].num_candidates
    try:
        for s in searches:
            bm.allocate(s.running[0].seq)
        while live := [s for s in searches if not s.done]:
            rows = iter(_run_round(engine, [b.seq for s in live for b in s.running], n))
            copies = []
            for s in live:
                chosen = s.advance([next(rows) for _ in s.running], eos)
                for b in s.running:
                    bm.commit(b.seq)  # full pages enter the prefix cache (a later prompt may share them)
                copies += _rebeam(engine, s, chosen)
            if copies:
                engine.move_pages()
                engine.runner.copy_pages([src for src, _ in copies], [dst for _, dst in copies])
    except BaseException:
        if engine.runner.reset_cache_if_lost():  # a failed program took the donated cache with it
            bm.clear_cache()
        raise
    finally:  # also on errors: every page goes back
        for s in searches:
            for b in s.running:
                bm.free_pages(b.seq)
            s.running = []


def _output(engine: LLMEngine, search: _Search) -> BeamSearchOutput:
    out = []
    for score, tokens, cum in search.finished:
        generated = tokens[search.prompt_len :]
        stop = generated[-1] in engine.eos_token_ids and not search.params.ignore_eos
        text = engine.tokenizer.decode(generated[:-1] if stop else generated, skip_special_tokens=True)
        out.append(BeamSearchSequence(tokens, float(cum), float(score), text, "stop" if stop else "length"))
    return BeamSearchOutput(out)
