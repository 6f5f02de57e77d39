"""Structured output: constrain sampling to a JSON schema, a regex, a list of choices or a
grammar, with llguidance.

Why llguidance (against xgrammar and outlines-core, checked on this machine): a 3 MB wheel with
no dependencies and an MIT license (xgrammar needs torch and triton, hundreds of MB); it
computes a 49k-token mask in about 2 ms on this CPU with no per-schema precompilation
(a JSON schema compiled in 3 ms here; outlines-core builds a whole regex index per schema
first); and it takes JSON schema, regex, Lark and llama.cpp's GBNF alike (outlines-core has no
context-free grammars).

How it runs:
- `GrammarCompiler` turns a `StructuredOutputsParams` into a compiled matcher, once per distinct
  spec (cached), on its own thread: the engine never waits on a compile, it admits the request
  when the compile is done (`LLMEngine`), and the server compiles on its preprocessing thread
  so a bad schema is a 400 before the engine sees the request.
- Each sequence holds its own matcher (`Grammar`), a copy of the compiled one. Before a step,
  the host writes each constrained row's allowed tokens as a bitmask row (`int32[B, V/32]`);
  the step program applies it to the logits (`sampler.apply_token_bitmask`). Rows without a
  grammar carry all-ones rows, and a batch without any grammar skips the masking entirely
  (one `lax.cond` on a flag), so the program is the same for every mix: no recompiles.
- A constrained row's next mask depends on the token just sampled, so the engine reads a step
  with constrained rows before scheduling the next (no async overlap for those steps), and
  never puts constrained rows in a multi-step or speculative batch.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """What a request's output must match; exactly one of the constraints is set (vLLM's shape).

    - `json`: a JSON schema (a dict, or its JSON text);
    - `regex`: a regular expression the whole output matches;
    - `choice`: the output is exactly one of these strings;
    - `grammar`: a Lark grammar (llguidance's dialect) or a llama.cpp GBNF grammar;
    - `json_object`: any JSON object (OpenAI's `response_format: {"type": "json_object"}`).

    `disable_any_whitespace` (default True, unlike vLLM): JSON is generated compact, without
    free whitespace between tokens. A small model given free whitespace can emit newlines until
    `max_tokens` and never close the object.
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = True

    def __post_init__(self) -> None:
        chosen = [k for k in KINDS if (getattr(self, k) is not None and getattr(self, k) is not False)]
        if len(chosen) != 1:
            raise ValueError(f"structured_outputs needs exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(chosen) if chosen else 'none'}")  # fmt: skip
        if isinstance(self.json, str):
            try:
                schema = json.loads(self.json)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            object.__setattr__(self, "json", schema)
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise ValueError(f"structured_outputs.json must be a JSON schema object, got {type(self.json).__name__}")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ValueError("structured_outputs.regex must be a non-empty string")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise ValueError("structured_outputs.grammar must be a non-empty string")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):  # fmt: skip
                raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", list(self.choice))
        if not isinstance(self.json_object, bool):
            raise ValueError("structured_outputs.json_object must be a boolean")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) is not None and getattr(self, k) is not False)

    @property
    def key(self) -> str:
        """The cache key: the constraint in a canonical text form."""
        value = {"json": self.json, "regex": self.regex, "choice": self.choice, "grammar": self.grammar,
                 "json_object": True}[self.kind]  # fmt: skip
        return json.dumps([self.kind, value, self.disable_any_whitespace], sort_keys=True)

    def llguidance_grammar(self) -> str:
        """The constraint as an llguidance grammar (not yet checked: `GrammarCompiler` does)."""
        import llguidance

        options = {"whitespace_flexible": not self.disable_any_whitespace}
        kind = self.kind
        if kind in ("json", "json_object"):
            schema = {"type": "object"} if kind == "json_object" else self.json
            try:
                return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
            except ValueError as e:
                raise ValueError(f"invalid structured_outputs.json: {e}") from None
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.regex)
        if kind == "choice":
            return llguidance.grammar_from("choice", json.dumps(self.choice))
        try:
            return llguidance.grammar_from("grammar", self.grammar)  # Lark, or GBNF converted to Lark
        except Exception as e:  # the GBNF converter raises its own error types
            raise ValueError(f"invalid structured_outputs.grammar: {e}") from None


def as_structured_outputs(value: StructuredOutputsParams | dict | None) -> StructuredOutputsParams | None:
    """`SamplingParams.structured_outputs` given as a dict (an HTTP body) or the params."""
    if value is None or isinstance(value, StructuredOutputsParams):
        return value
    if isinstance(value, dict):
        unknown = set(value) - {f.name for f in dataclasses.fields(StructuredOutputsParams)}
        if unknown:
            raise ValueError(f"structured_outputs: unknown field(s) {', '.join(sorted(unknown))}")
        return StructuredOutputsParams(**value)
    raise ValueError(f"structured_outputs must be a StructuredOutputsParams, a dict or None, got {type(value).__name__}")


class Grammar:
    """One sequence's matcher: which tokens may come next, advanced by each token it samples."""

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (bit `t % 32` of word `t // 32`)."""
        import llguidance.numpy

        llguidance.numpy.fill_next_token_bitmask(self._matcher, bitmask, row)

    def accept(self, token: int) -> None:
        """Advance by a sampled token. Raises RuntimeError if the grammar did not allow it."""
        if not self._matcher.consume_token(token) or self._matcher.is_error():
            raise RuntimeError(f"token {token} broke the output grammar: {self._matcher.get_error()}")

    @property
    def finished(self) -> bool:
        """The grammar is complete: nothing but the end of the sequence may follow."""
        return self._matcher.is_stopped()


class CompiledGrammar:
    """A checked grammar: the matcher each sequence copies (on its engine's thread)."""

    def __init__(self, matcher: Any) -> None:
        self._template = matcher

    def new_grammar(self) -> Grammar:
        return Grammar(self._template.deep_copy())


class GrammarCompiler:
    """Compiles constraints for one tokenizer and vocabulary, on its own worker thread, with an
    LRU cache of compiled grammars (the same schema from many requests compiles once).

    `vocab_size` is the model's (the logits' width; tokens the tokenizer lacks are never
    allowed); `eos_token_ids` may end a sequence once its grammar is satisfied."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int] = (), cache_size: int = 256) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._ll_tokenizer: Any = None
        self._cache: OrderedDict[str, Future] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self.num_compiled = 0  # grammars compiled (cache misses), for tests and /metrics

    def _tokenizer(self) -> Any:
        """llguidance's view of the tokenizer: built once (about 0.6 s for a 49k vocabulary)."""
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance.hf

                try:
                    self._ll_tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size,
                                                                      eos_token=self._eos or None)  # fmt: skip
                except ValueError as e:  # e.g. a word-level tokenizer without a decoder
                    raise ValueError(f"structured output is not available with this model's tokenizer: {e}") from None
            return self._ll_tokenizer

    def _compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        import llguidance

        grammar = spec.llguidance_grammar()
        matcher = llguidance.LLMatcher(self._tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"invalid structured_outputs.{spec.kind}: {matcher.get_error()}")
        self.num_compiled += 1
        return CompiledGrammar(matcher)

    def submit(self, spec: StructuredOutputsParams) -> Future:
        """A future of the compiled grammar (done at once on a cache hit); a bad constraint
        fails the future with a ValueError."""
        with self._lock:
            future = self._cache.get(spec.key)
            if future is not None:
                self._cache.move_to_end(spec.key)
                return future
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
            future = self._pool.submit(self._compile, spec)
            self._cache[spec.key] = future
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        future.add_done_callback(self._forget_failure(spec.key))
        return future

    def _forget_failure(self, key: str):
        def forget(future: Future) -> None:  # a failed compile is not kept: the next try says why again
            if future.exception() is not None:
                with self._lock:
                    if self._cache.get(key) is future:
                        del self._cache[key]

        return forget

    def compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        """Compile now (or take the cached result); raises ValueError on a bad constraint. For
        callers on their own thread (the server's preprocessing)."""
        return self.submit(spec).result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
