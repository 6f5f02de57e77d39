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

What one grammar may cost (so a costly grammar slows or fails only its own request):
- llguidance's parser limits (`GRAMMAR_LIMITS`) turn lexer and Earley-parser blow-ups into a
  grammar error instead of unbounded work.
- A compile (and the grammar's first mask, computed on the compile thread so it also warms the
  lexer the engine then shares) must finish within `GRAMMAR_COMPILE_TIMEOUT_S`, and the first
  mask within `GRAMMAR_MASK_BUDGET_S`, or the constraint is refused with a ValueError (a 400 on
  the server) naming its field. llguidance cannot be interrupted: a caller stops waiting at the
  deadline while the compile thread finishes (its work is bounded only by what llguidance does
  with the grammar text, itself bounded by the request body limit).
- The masks of all constrained rows of a step are computed in one call on llguidance's own
  thread pool (`fill_bitmasks`), outside the GIL. When that call is slower than the budget, each
  row is timed alone and a grammar whose mask costs more than `GRAMMAR_MASK_BUDGET_S` is
  stopped; it, and a grammar that reaches a limit while generating, fails its own request (the
  engine runs the step without it).
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from typing import Any

import numpy as np

from minivllm_jax.sampling_params import StructuredOutputsParams

# llguidance's parser limits (llguidance.LLParserLimits), spelled out so they are documented.
# Reaching one is a grammar error: at compile (a 400 naming the field) or while generating
# (that request alone ends with finish_reason "error").
GRAMMAR_LIMITS = {
    "max_items_in_row": 2000,  # Earley items in one parser row (ambiguity / alternatives)
    "initial_lexer_fuel": 1_000_000,  # work to build the lexer's regex expressions
    "step_lexer_fuel": 200_000,  # lexer work in one token mask
    "step_max_items": 50_000,  # Earley items in one token mask
    "max_lexer_states": 50_000,  # lexer DFA states (about 1-2 kB each: ~100 MB a grammar at most)
    "max_grammar_size": 500_000,  # symbols in the grammar's productions
}
# How long a request waits for its constraint to compile (and its first mask to be computed).
GRAMMAR_COMPILE_TIMEOUT_S = 10.0
# The most one grammar's token mask may take (its first at compile, any later one in a step).
# Typical JSON schemas take well under 1 ms on a 49k vocabulary; the margin is for a busy CPU.
GRAMMAR_MASK_BUDGET_S = 0.1
# Threads compiling constraints: one costly compile does not hold up the others.
GRAMMAR_COMPILE_THREADS = 2
# Threads computing a step's masks (llguidance's executor).
MASK_FILL_THREADS = max(1, min(8, os.cpu_count() or 1))


def _parser_limits() -> Any:
    import llguidance

    # verbose_errors off: an error names the limit, without dumping the parser state and grammar
    return llguidance.LLParserLimits(**GRAMMAR_LIMITS, verbose_errors=False)


def _error_of(matcher: Any) -> str:
    """llguidance's error text, without the marker it appends when errors are not verbose."""
    return matcher.get_error().replace("<non-verbose/>", "").strip()


class Grammar:
    """One sequence's matcher: which tokens may come next, advanced by each token it samples."""

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher
        self.failure: str | None = (
            None  # why it can go no further (too costly, or it broke on a token)
        )

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (bit `t % 32` of word `t // 32`).
        Raises RuntimeError if the grammar was stopped or reached one of llguidance's limits."""
        import llguidance.numpy

        self._check()
        llguidance.numpy.fill_next_token_bitmask(self._matcher, bitmask, row)
        self._check()

    def _check(self) -> None:
        if self.failure is not None:
            raise RuntimeError(self.failure)
        if self._matcher.is_error():  # a limit reached while computing a mask
            raise RuntimeError(f"the output grammar failed: {_error_of(self._matcher)}")

    def accept(self, token: int) -> None:
        """Advance by a sampled token. The mask allowed it, so a grammar that breaks on it
        reached one of llguidance's limits: the next mask raises, failing this sequence's
        request with the reason (the step runs without it)."""
        if self.failure is None and (
            not self._matcher.consume_token(token) or self._matcher.is_error()
        ):
            self.failure = f"the output grammar failed at token {token}: {_error_of(self._matcher)}"

    @property
    def finished(self) -> bool:
        """The grammar is complete: nothing but the end of the sequence may follow."""
        return self.failure is None and self._matcher.is_stopped() and not self._matcher.is_error()


_executor_lock = threading.Lock()
_executor: Any = None


def _mask_executor() -> Any:
    """llguidance's thread pool for masks, made once a process."""
    global _executor
    with _executor_lock:
        if _executor is None:
            import llguidance

            _executor = llguidance.LLExecutor(num_threads=MASK_FILL_THREADS)
        return _executor


def fill_bitmasks(
    bitmask: np.ndarray, rows: Sequence[tuple[Grammar, int]]
) -> list[Exception | None]:
    """Write each grammar's allowed next tokens into its row of `bitmask` (`int32[B, V/32]`),
    all rows in one call on llguidance's thread pool (outside the GIL); the same rows as
    `Grammar.fill_bitmask` on each. Returns, for each of `rows`, None or the error that fails
    that row alone: its grammar reached a limit, or it is too costly. A call slower than the
    mask budget (per row a thread computed) is rare: then each row is timed alone, and a
    grammar over `GRAMMAR_MASK_BUDGET_S` is stopped, so it ends its own request, not
    everyone's steps."""
    import llguidance.numpy

    live = [
        i
        for i, (grammar, _) in enumerate(rows)
        if grammar.failure is None and not grammar._matcher.is_error()
    ]
    start = time.perf_counter()
    try:
        if live:
            matchers = [(rows[i][0]._matcher, rows[i][1]) for i in live]
            llguidance.numpy.fill_next_token_bitmask_par(_mask_executor(), matchers, bitmask)
        slow = time.perf_counter() - start > GRAMMAR_MASK_BUDGET_S * -(
            -len(live) // MASK_FILL_THREADS
        )
    except Exception:  # noqa: BLE001 (which row? each is computed alone below)
        slow = True
    errors: list[Exception | None] = []
    for grammar, row in rows:
        try:
            if slow:
                _fill_within_budget(grammar, bitmask, row)
            else:
                grammar._check()
            errors.append(None)
        except Exception as e:  # noqa: BLE001 (that row's alone)
            errors.append(e)
    return errors


def _fill_within_budget(grammar: Grammar, bitmask: np.ndarray, row: int) -> None:
    """Fill one row alone, timed (a mask can be computed again); a grammar whose mask took
    longer than `GRAMMAR_MASK_BUDGET_S` is stopped: raises RuntimeError, now and on every fill."""
    start = time.perf_counter()
    grammar.fill_bitmask(bitmask, row)
    took = time.perf_counter() - start
    if took > GRAMMAR_MASK_BUDGET_S:
        grammar.failure = (
            f"the output grammar is too costly to follow: one token mask took {took * 1e3:.0f} ms "
            f"(limit {GRAMMAR_MASK_BUDGET_S * 1e3:.0f} ms)"
        )
        grammar._check()


class CompiledGrammar:
    """A checked grammar: the matcher each sequence copies (on its engine's thread)."""

    def __init__(self, matcher: Any) -> None:
        self._template = matcher

    def new_grammar(self) -> Grammar:
        return Grammar(self._template.deep_copy())


class GrammarCompiler:
    """Compiles constraints for one tokenizer and vocabulary, on its own worker threads, with an
    LRU cache of compiled grammars (the same schema from many requests compiles once).

    `vocab_size` is the model's (the logits' width; tokens the tokenizer lacks are never
    allowed); `eos_token_ids` may end a sequence once its grammar is satisfied."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Sequence[int] = (),
        cache_size: int = 256,
    ) -> None:
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
                    self._ll_tokenizer = llguidance.hf.from_tokenizer(
                        self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self._eos or None
                    )
                except ValueError as e:  # e.g. a word-level tokenizer without a decoder
                    raise ValueError(
                        f"structured output is not available with this model's tokenizer: {e}"
                    ) from None
            return self._ll_tokenizer

    def _compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        import llguidance
        import llguidance.numpy

        tokenizer = self._tokenizer()  # built once, not counted against the grammar
        field = f"structured_outputs.{spec.kind}"
        start = time.perf_counter()
        matcher = llguidance.LLMatcher(
            tokenizer, spec.llguidance_grammar(), log_level=0, limits=_parser_limits()
        )
        if matcher.is_error():
            raise ValueError(f"invalid {field}: {_error_of(matcher)}")
        # The first mask here, not on the engine thread: it builds the lexer states that every
        # sequence's copy then shares, and shows a grammar too costly to serve before it is.
        probe, mask = matcher.deep_copy(), np.zeros((1, -(-self.vocab_size // 32)), np.int32)
        mask_start = time.perf_counter()
        llguidance.numpy.fill_next_token_bitmask(probe, mask, 0)
        now = time.perf_counter()
        if probe.is_error():
            raise ValueError(f"invalid {field}: {_error_of(probe)}")
        if now - mask_start > GRAMMAR_MASK_BUDGET_S:
            took, limit = (now - mask_start) * 1e3, GRAMMAR_MASK_BUDGET_S * 1e3
            raise ValueError(
                f"{field} is too costly to follow: its first token mask took {took:.0f} ms "
                f"(limit {limit:.0f} ms)"
            )
        if now - start > GRAMMAR_COMPILE_TIMEOUT_S:  # its waiters gave up: not cached either
            raise ValueError(_timeout_message(field))
        with self._lock:
            self.num_compiled += 1
        return CompiledGrammar(matcher)

    def submit(self, spec: StructuredOutputsParams) -> Future:
        """A future of the compiled grammar (done at once on a cache hit); a bad constraint, or
        one not compiled within `GRAMMAR_COMPILE_TIMEOUT_S`, fails the future with a ValueError."""
        with self._lock:
            future = self._cache.get(spec.key)
            if future is None:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(
                        max_workers=GRAMMAR_COMPILE_THREADS, thread_name_prefix="grammar"
                    )
                future = self._pool.submit(self._compile, spec)
                self._cache[spec.key] = future
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
                future.add_done_callback(self._forget_failure(spec.key))
            else:
                self._cache.move_to_end(spec.key)
        if future.done():
            return future
        return _with_deadline(
            future, GRAMMAR_COMPILE_TIMEOUT_S, _timeout_message(f"structured_outputs.{spec.kind}")
        )

    def _forget_failure(self, key: str):
        def forget(
            future: Future,
        ) -> None:  # a failed compile is not kept: the next try says why again
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


class GrammarQueue:
    """Requests waiting for their grammar (not yet in the scheduler): `submit` one, and
    `ready()` hands back, once each, those whose compile ended, with the grammar or the error."""

    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self._waiting: dict[str, Future] = {}

    def __bool__(self) -> bool:
        return bool(self._waiting)

    def submit(self, request_id: str, spec: StructuredOutputsParams) -> None:
        self._waiting[request_id] = self.compiler.submit(spec)

    def discard(self, request_id: str) -> None:
        self._waiting.pop(request_id, None)

    def ready(self) -> list[tuple[str, CompiledGrammar | None, BaseException | None]]:
        """(request_id, grammar, None) or (request_id, None, error) for each finished compile."""
        done = [(rid, f) for rid, f in self._waiting.items() if f.done()]
        for rid, _ in done:
            del self._waiting[rid]
        return [(rid, None if f.exception() else f.result(), f.exception()) for rid, f in done]

    def clear(self) -> None:
        self._waiting.clear()


def _timeout_message(field: str) -> str:
    return f"{field} did not compile within {GRAMMAR_COMPILE_TIMEOUT_S:g} s; use a smaller or simpler constraint"


def _with_deadline(inner: Future, timeout_s: float, message: str) -> Future:
    """A future with `inner`'s outcome, or a ValueError(message) once `timeout_s` has passed.
    llguidance cannot be interrupted: the compile behind `inner` runs on; the caller stops waiting."""
    outer: Future = Future()
    outer.set_running_or_notify_cancel()

    def settle(error: BaseException | None, result: Any = None) -> None:
        try:
            if error is None:
                outer.set_result(result)
            else:
                outer.set_exception(error)
        except InvalidStateError:  # the other of deadline and compile came first
            pass

    def copy(done: Future) -> None:
        timer.cancel()
        if done.cancelled():
            settle(RuntimeError("the grammar compiler was closed"))
        elif done.exception() is not None:
            settle(done.exception())
        else:
            settle(None, done.result())

    timer = threading.Timer(timeout_s, lambda: settle(ValueError(message)))
    timer.daemon = True
    timer.start()
    inner.add_done_callback(copy)
    return outer
