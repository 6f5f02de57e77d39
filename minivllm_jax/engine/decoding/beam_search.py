"""Beam search (`LLM.beam_search`) with HF transformers' rules, as ordinary engine requests.

Each round submits every live beam as an ordinary request (prompt + the beam's tokens,
greedy, `max_tokens=1`, `logprobs=` the candidates wanted), so beams share the continuous
batch with every other request, as vLLM's beam search over its engine does. The prefix cache
keeps the pages earlier rounds computed, so a round prefills about one page a beam (the
beam's last, partial page), not its whole prompt (without prefix caching it recomputes the
whole prompt: the same results, slower). The logprobs the engine reports are the raw
log-softmax of the model's logits, whatever the request's sampling settings.

`BeamSearchState` is the engine-free bookkeeping of one prompt, as HF `generate(num_beams=k,
do_sample=False)` (`_beam_search`) does it: each round, the top 2k continuations over all beams
by cumulative log-prob (`(1 + #EOS ids) * k` with several EOS ids); of them, the top k that end
(EOS or the token limit) become finished hypotheses scored `cum_logprob / generated_len **
length_penalty` (EOS counted), and the best k that do not end run on. A prompt stops when its k
hypotheses cannot be beaten (HF's heuristic), when `early_stopping=True` and k have finished,
or at `max_tokens`. Hypotheses come back best first. Two drivers use it: `beam_search` here
(synchronous: adds each round's requests to an `LLMEngine` and steps it) and the server's
`AsyncEngine.beam_search` (each round through its shared loop, cancellable between rounds).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Mapping
from collections.abc import Sequence as Seq
from typing import Any

import numpy as np

from minivllm_jax.sampling_params import (
    MAX_LOGPROBS,
    ContextLengthError,
    ParamError,
    SamplingParams,
)

Prompt = str | Seq[int] | dict[str, Any]
_Choice = tuple[np.float32, int, int]  # a continuation: (cumulative log-prob, parent beam, token)

# A beam's 2k candidates come from one step's top logprobs, of which the engine computes
# MAX_LOGPROBS: the widest beam that fits with one EOS id.
MAX_BEAM_WIDTH = MAX_LOGPROBS // 2


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
        if not isinstance(self.beam_width, int) or not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise ParamError(
                "beam_width",
                f"beam_width must be an integer in [1, {MAX_BEAM_WIDTH}], got {self.beam_width!r}",
            )
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ParamError(
                "max_tokens", f"max_tokens must be a positive integer, got {self.max_tokens!r}"
            )
        if not isinstance(self.length_penalty, (int, float)) or not np.isfinite(
            self.length_penalty
        ):
            raise ParamError(
                "length_penalty",
                f"length_penalty must be a finite number, got {self.length_penalty!r}",
            )
        if self.early_stopping not in (True, False, "never"):
            raise ParamError(
                "early_stopping",
                f"early_stopping must be True, False or 'never', got {self.early_stopping!r}",
            )


@dataclasses.dataclass
class BeamSearchSequence:
    tokens: list[
        int
    ]  # the prompt and the generated tokens (the EOS that ended it included), as vLLM's
    cum_logprob: float  # sum of the generated tokens' log-probs
    score: float  # cum_logprob / num_generated ** length_penalty: the ranking
    text: str  # the generated tokens decoded (without the EOS)
    finish_reason: str  # "stop" (EOS) or "length"


@dataclasses.dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # beam_width hypotheses, best first


def num_candidates(params: BeamSearchParams, eos_token_ids: frozenset[int]) -> int:
    """Candidates read a beam each round: HF keeps (1 + #EOS tokens) * k, at least 2k."""
    eos = frozenset() if params.ignore_eos else eos_token_ids
    n = max(2, 1 + len(eos)) * params.beam_width
    if n > MAX_LOGPROBS:
        raise ParamError(
            "beam_width",
            f"beam_width={params.beam_width} with {len(eos)} EOS tokens needs {n} candidates a beam; "
            f"the engine reports at most {MAX_LOGPROBS}",
        )
    return n


def round_sampling_params(candidates: int) -> SamplingParams:
    """One beam's request in a round: its next token's top `candidates` raw log-probs. Greedy
    and unpenalised (the logprobs are raw either way); `ignore_eos` so nothing but the token
    limit ends it (EOS candidates are the bookkeeping's business)."""
    return SamplingParams(temperature=0.0, max_tokens=1, logprobs=candidates, ignore_eos=True)


def check_prompt(prompt_len: int, params: BeamSearchParams, max_model_len: int) -> None:
    """Refuse a search whose longest beam would not fit the context (a ValueError naming it)."""
    if prompt_len + params.max_tokens > max_model_len:
        raise ContextLengthError(
            "max_tokens",
            f"prompt ({prompt_len} tokens) + max_tokens ({params.max_tokens}) exceeds "
            f"max_model_len ({max_model_len})",
        )


class BeamSearchState:
    """One prompt's beams and finished hypotheses (HF's per-prompt state), engine-free: ask
    `beams()` for the token lists to score, feed each one's next-token log-probs to `advance`,
    until `done`; then `hypotheses`."""

    def __init__(
        self, prompt_ids: Seq[int], params: BeamSearchParams, eos_token_ids: frozenset[int]
    ) -> None:
        self.params = params
        self.eos = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        self.num_candidates = num_candidates(params, self.eos)
        self.prompt_ids = list(prompt_ids)
        # HF's other initial beams score -1e9: never picked, so one beam starts.
        self.running: list[tuple[list[int], np.float32]] = [
            ([], np.float32(0.0))
        ]  # (generated tokens, cum)
        self.finished: list[
            tuple[np.float32, list[int], np.float32]
        ] = []  # (score, tokens, cum), best first
        self.improvable = True  # HF's is_early_stop_heuristic_unsatisfied
        self.done = False

    def beams(self) -> list[list[int]]:
        """Each running beam's full token list (prompt + generated): what to score next."""
        return [self.prompt_ids + generated for generated, _ in self.running]

    def _normalized(self, cum: np.float32, length: int) -> np.float32:
        return cum / np.float32(
            length**self.params.length_penalty
        )  # as torch divides a float32 tensor

    def _top(self, logprobs: Mapping[int, float]) -> list[tuple[int, np.float32]]:
        """A beam's top `num_candidates` (token, log-prob), best first (ties: lower id first)."""
        ranked = sorted(
            ((int(t), np.float32(lp)) for t, lp in logprobs.items() if t >= 0),
            key=lambda c: (-c[1], c[0]),
        )
        return ranked[: self.num_candidates]

    def advance(self, logprobs: Seq[Mapping[int, float]]) -> None:
        """Take each running beam's next-token log-probs (token -> raw log-prob, at least
        `num_candidates` of the best); pick the next running beams and update the finished ones."""
        if self.done:
            raise RuntimeError("advance() on a finished beam search")
        if len(logprobs) != len(self.running):
            raise ValueError(
                f"advance() needs one log-prob map per running beam ({len(self.running)}), got {len(logprobs)}"
            )
        p, k, n = self.params, self.params.beam_width, self.num_candidates
        generated = len(self.running[0][0]) + 1  # by each candidate
        cands = [
            (cum + lp, i, t)
            for i, ((_, cum), row) in enumerate(zip(self.running, logprobs))
            for t, lp in self._top(row)
        ]
        cands = sorted(cands, key=lambda c: (-c[0], c[1], c[2]))[
            :n
        ]  # ties: HF's flat (beam, token) order
        ends = [t in self.eos or generated >= p.max_tokens for _, _, t in cands]
        full = len(self.finished) == k
        if self.improvable and not (full and p.early_stopping is True):
            for (cum, i, t), end in zip(cands[:k], ends):  # only the top k may finish
                if end:
                    tokens = self.prompt_ids + self.running[i][0] + [t]
                    self.finished.append((self._normalized(cum, generated), tokens, cum))
            self.finished = sorted(self.finished, key=lambda h: -h[0])[
                :k
            ]  # stable: earlier ones first on ties
        chosen: list[_Choice] = [c for c, end in zip(cands, ends) if not end][:k]
        if (
            chosen and len(self.finished) == k
        ):  # can the best running beam still beat the worst hypothesis?
            never = p.early_stopping == "never" and p.length_penalty > 0
            best = self._normalized(chosen[0][0], p.max_tokens if never else generated)
            self.improvable = self.improvable and bool(best > self.finished[-1][0])
        self.done = (
            not chosen
            or not self.improvable
            or (p.early_stopping is True and len(self.finished) == k)
        )
        self.running = (
            [] if self.done else [(self.running[i][0] + [t], cum) for cum, i, t in chosen]
        )

    def hypotheses(
        self, decode: Callable[[list[int]], str], eos_token_ids: frozenset[int]
    ) -> BeamSearchOutput:
        """The finished hypotheses, best first; `decode` turns generated ids into text."""
        out = []
        for score, tokens, cum in self.finished:
            generated = tokens[len(self.prompt_ids) :]
            stop = generated[-1] in eos_token_ids and not self.params.ignore_eos
            text = decode(generated[:-1] if stop else generated)
            out.append(
                BeamSearchSequence(
                    tokens, float(cum), float(score), text, "stop" if stop else "length"
                )
            )
        return BeamSearchOutput(out)


# ---------------------------------------------------------------- the synchronous driver

_search_ids = itertools.count()


def _prompt_ids(engine: Any, prompt: Prompt) -> list[int]:
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            prompt = prompt["prompt_token_ids"]
        elif "prompt" in prompt:
            prompt = prompt["prompt"]
        else:
            raise ValueError("a dict prompt needs a 'prompt' or 'prompt_token_ids' key")
    return engine.tokenize(prompt)[1]


def beam_search(
    engine: Any, prompts: list[Prompt], params: BeamSearchParams
) -> list[BeamSearchOutput]:
    """Run beam search for each prompt on `engine` (an `LLMEngine` nobody else is stepping):
    every prompt's beams go into the same rounds; one output per prompt, in order."""
    if not isinstance(params, BeamSearchParams):
        raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
    unfinished = engine.stats().requests
    if unfinished or engine.has_unfinished():  # stepping here would swallow their outputs
        raise RuntimeError(
            f"beam_search steps the engine itself and needs an idle engine: {unfinished} "
            "request(s) are unfinished; let them finish or abort them"
        )
    ids = [_prompt_ids(engine, p) for p in prompts]
    for p in ids:
        check_prompt(len(p), params, engine.config.max_model_len)
    searches = [BeamSearchState(p, params, engine.eos_token_ids) for p in ids]
    sampling = round_sampling_params(num_candidates(params, engine.eos_token_ids))
    tag = f"beam-{next(_search_ids)}"
    for round_ in itertools.count():
        live = [s for s in searches if not s.done]
        if not live:
            break
        rows = {
            f"{tag}.{round_}.{i}.{j}": beam
            for i, s in enumerate(live)
            for j, beam in enumerate(s.beams())
        }
        logprobs = _run_round(engine, rows, sampling)
        for i, s in enumerate(live):
            s.advance([logprobs[f"{tag}.{round_}.{i}.{j}"] for j in range(len(s.running))])
    decode = lambda tokens: engine.tokenizer.decode(tokens, skip_special_tokens=True)  # noqa: E731
    return [s.hypotheses(decode, engine.eos_token_ids) for s in searches]


def _run_round(
    engine: Any, rows: dict[str, list[int]], sampling: SamplingParams
) -> dict[str, dict[int, float]]:
    """Add one request a beam and step until all are done; each one's next-token log-probs.
    On any error the round's requests are aborted, so the engine is left idle."""
    pending = set()
    try:
        for request_id, tokens in rows.items():
            pending.add(
                engine.add_request(tokens, sampling, request_id=request_id, streaming=False)
            )
        logprobs: dict[str, dict[int, float]] = {}
        while pending:
            for out in engine.step(only_finished=True):
                if out.request_id not in pending:
                    continue
                if out.error is not None:
                    raise RuntimeError(f"beam search step failed: {out.error}")
                pending.discard(out.request_id)
                logprobs[out.request_id] = out.outputs[0].logprobs[0]
        return logprobs
    finally:
        for request_id in pending:
            engine.abort(request_id)
