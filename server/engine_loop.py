"""`AsyncEngine`: one `LLMEngine` on one background thread, bridged to asyncio.

The engine is not thread-safe, so exactly one thread touches it. Handlers send it commands
(add, abort, stop) through a list guarded by a condition variable; the thread runs them
between steps and sleeps on the condition when there is nothing to do (no polling). Each
request's newest output goes back to its own `RequestStream` slot via
`loop.call_soon_threadsafe`, so all HTTP and WebSocket requests share the engine's continuous
batches.

Faults: a failed device step fails only its batch (the engine returns their outputs with
`error` set; those streams raise `RequestFailed`). An exception that escapes the engine (a
host-side bug) fails every request in flight with `EngineStopped`, recovers the engine and
serves again on the same thread, at most `max_restarts` times in `restart_window_s`; past that
the loop stays down and `alive` is False.

Beam search (`beam_search()`) is a coroutine over ordinary requests: each round adds every
live beam as a one-token request and awaits them, so beams share every step with the other
requests (nothing waits for an idle engine); a cancelled caller aborts the round in flight and
starts no other.

`DataParallelEngine`: several replicas (`LLM(data_parallel_size=M)`), one `AsyncEngine` each.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from minivllm_jax.engine.decoding.beam_search import (
    MAX_BEAM_WIDTH,
    BeamSearchOutput,
    BeamSearchParams,
    BeamSearchState,
    check_prompt,
    round_sampling_params,
)
from minivllm_jax.engine.router import PrefixRouter
from minivllm_jax.outputs import RequestOutput
from minivllm_jax.sampling_params import SamplingParams
from server.metrics import EngineStats, ServerMetrics

logger = logging.getLogger(__name__)


class EngineStopped(RuntimeError):
    """The engine loop is shutting down or died; the request cannot be served."""


class RequestFailed(RuntimeError):
    """The engine step that carried this request failed; the engine goes on serving others."""


class QueueFull(RuntimeError):
    """`max_queue` requests are already in flight; the client should retry later."""


# Beams of all the searches running on one engine together (each search counts its width):
# rows a search adds every round, so this bounds beam width x concurrent searches.
MAX_CONCURRENT_BEAM_ROWS = 4 * MAX_BEAM_WIDTH


class RequestStream:
    """Async iterator over one request's cumulative `RequestOutput`s.

    It holds one slot, not a queue: every field of an output is cumulative, so the newest one
    replaces the last and a consumer that stops reading holds O(1) outputs however many steps
    run. The final output (or the error that ends the stream) is the last thing put, so it is
    delivered exactly once. `abort()` is idempotent and safe after the end; callers use it in
    `finally` so a client that goes away frees its pages.

    The request leaves the `max_queue` count when the engine is done with it (its final output
    or error arrives), not when the consumer reads that: a client that stops reading a finished
    stream holds no slot, so it cannot make others' requests 429 while the engine idles.
    """

    def __init__(
        self, owner: AsyncEngine, request_id: str, prompt_tokens: int, n: int, arrival: float
    ) -> None:
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.n = n
        self.aborted = False
        self._owner = owner
        self._slot: RequestOutput | BaseException | None = (
            None  # newest output, or the error ending it
        )
        self._ready = asyncio.Event()  # set while the slot holds something unread, or on abort
        self._closed = False
        self._released = False  # left the in-flight count (engine done, or closed first)
        self._arrival = arrival
        self._last_token_time: float | None = None
        self._tokens = 0

    def _put(self, item: RequestOutput | BaseException) -> None:
        """Event-loop side: keep the newest output; an error is final and wins over any output."""
        if not isinstance(self._slot, BaseException):
            self._slot = item
        self._ready.set()
        if isinstance(item, BaseException) or item.finished:
            self._release()  # the engine holds nothing more for it, whether or not anyone reads

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._closed:
            raise StopAsyncIteration
        await self._ready.wait()
        if self.aborted:
            raise StopAsyncIteration
        self._ready.clear()
        item, self._slot = self._slot, None
        assert item is not None, "the stream was woken with nothing to read"
        if isinstance(item, BaseException):
            self._close("error" if isinstance(item, RequestFailed) else None)
            raise item
        self._observe(item)
        if item.finished:
            self._close(item.outputs[0].finish_reason or "stop")
        return item

    def abort(self) -> None:
        if self._closed:
            return
        self.aborted = True
        self._owner._submit(lambda: self._owner._abort_now(self.request_id))
        self._close("abort")
        self._ready.set()  # wake a consumer blocked in __anext__

    def _observe(self, out: RequestOutput) -> None:
        """TTFT once; then the gap per token of the longest choice (n choices advance together)."""
        now = time.monotonic()
        tokens = max(len(c.token_ids) for c in out.outputs)
        new = tokens - self._tokens
        if new <= 0:
            return
        metrics = self._owner.metrics
        if self._last_token_time is None:
            metrics.ttft.observe(now - self._arrival)
        else:
            metrics.itl.observe((now - self._last_token_time) / new, new)
        self._tokens, self._last_token_time = tokens, now

    def _release(self) -> None:
        """Leave the in-flight count exactly once (the engine finished it, or it was closed)."""
        if not self._released:
            self._released = True
            self._owner.num_in_flight -= 1

    def _close(self, reason: str | None) -> None:
        """The consumer is done with it (finished, aborted or failed): record it once."""
        if self._closed:
            return
        self._closed = True
        self._release()
        if reason is not None:
            self._owner.metrics.observe_finished(reason, time.monotonic() - self._arrival)


class AsyncEngine:
    """Owns an `LLMEngine` on a daemon thread; `add()` returns a `RequestStream`."""

    def __init__(
        self,
        engine: Any,
        *,
        max_queue: int = 256,
        metrics: ServerMetrics | None = None,
        max_restarts: int = 5,
        restart_window_s: float = 60.0,
        max_beam_rows: int = MAX_CONCURRENT_BEAM_ROWS,
    ) -> None:
        self.engine = engine
        self.max_queue = max_queue
        self.max_beam_rows = max_beam_rows
        self.beam_rows = 0  # event-loop side: the widths of the beam searches running
        self.max_restarts = max_restarts
        self.restart_window_s = restart_window_s
        self.restarts: collections.deque[float] = (
            collections.deque()
        )  # engine thread: recent restart times
        self.metrics = metrics or ServerMetrics()
        self.num_in_flight = 0  # event-loop side: admitted requests not yet closed
        self.error: BaseException | None = None
        self._cond = threading.Condition()
        self._commands: list[Callable[[], None]] = []
        self._stopping = False
        self._closing = False  # engine thread: no more adds (set when failing everything)
        self._finished = False  # the thread is gone: commands run inline
        self._streams: dict[
            str, tuple[asyncio.AbstractEventLoop, RequestStream]
        ] = {}  # engine thread only
        self._busy_since: float | None = (
            None  # engine thread: when its current iteration began; None while idle
        )
        self.stats = self._snapshot()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping and self.error is None

    def stalled_for(self) -> float:
        """Seconds the engine thread has spent in its current iteration (commands and one step);
        0 while it waits for work. A large value means a hung step (`/health` reports it)."""
        since = self._busy_since  # one read: the engine thread may clear it meanwhile
        return 0.0 if since is None else time.monotonic() - since

    async def add(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        request_id: str,
        arrival: float | None = None,
        cache_salt: str | None = None,
    ) -> RequestStream:
        """Queue a tokenized request. Raises QueueFull, EngineStopped, or the engine's
        ValueError for a bad request (checked on the engine thread, between steps).
        `arrival` (time.monotonic) is when the server received it; latencies count from there.
        `cache_salt`: prefix-cache pages are shared only with requests of the same salt."""
        loop, arrival = self._admit(arrival)
        return await self._add_admitted(loop, prompt_ids, params, request_id, arrival, cache_salt)

    async def _add_admitted(
        self,
        loop: asyncio.AbstractEventLoop,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        request_id: str,
        arrival: float,
        cache_salt: str | None = None,
    ) -> RequestStream:
        """`add` past the admission checks (a beam search's rows: the search was admitted once,
        so a full queue cannot fail it halfway)."""
        stream = RequestStream(self, request_id, len(prompt_ids), params.n, arrival)
        self.num_in_flight += 1
        added: asyncio.Future[None] = loop.create_future()

        def add_now() -> None:
            if self._closing:
                _resolve(loop, added, EngineStopped("the engine is shutting down"))
                return
            try:
                salted = (
                    {} if cache_salt is None else {"cache_salt": cache_salt}
                )  # stand-in engines take none
                self.engine.add_request(list(prompt_ids), params, request_id=request_id, **salted)
            except Exception as e:
                _resolve(loop, added, e)
                return
            self._streams[request_id] = (loop, stream)
            _resolve(loop, added, None)

        self._submit(add_now)
        try:
            await added
        except BaseException:  # rejected, or the handler was cancelled while waiting
            stream._close(None)
            self._submit(lambda: self._abort_now(request_id))
            raise
        return stream

    async def beam_search(
        self,
        prompt_ids: Sequence[int],
        params: BeamSearchParams,
        arrival: float | None = None,
        cache_salt: str | None = None,
    ) -> BeamSearchOutput:
        """Beam search for one prompt as ordinary requests in the shared batch: each round adds
        every live beam (prompt + beam, one token, its top log-probs; the prefix cache holds the
        earlier rounds' pages) and awaits them, then `BeamSearchState` picks the next beams.
        Cancelling the caller (a client that left) aborts the round in flight and starts no
        other. Counts once in `max_queue` (its rows are added past it, so a full queue cannot
        fail it halfway) and its width in `max_beam_rows`. Raises QueueFull past either,
        EngineStopped, ValueError (a bad request) or RequestFailed (a step serving it failed).
        `cache_salt`: its rows' prefix-cache salt, as `add`'s."""
        loop, arrival = self._admit(arrival)
        if self.beam_rows + params.beam_width > self.max_beam_rows:
            raise QueueFull(
                f"{self.beam_rows} beams of running beam searches (max_beam_rows={self.max_beam_rows}); "
                f"this one needs {params.beam_width} more"
            )
        check_prompt(len(prompt_ids), params, self.engine.config.max_model_len)
        eos = self.engine.eos_token_ids
        search = BeamSearchState(prompt_ids, params, eos)
        sampling = round_sampling_params(search.num_candidates)
        search_id = f"beam-{uuid.uuid4().hex}"
        self.num_in_flight += 1
        self.beam_rows += params.beam_width
        try:
            for round_ in itertools.count():
                if search.done:
                    break
                rows = [f"{search_id}.{round_}.{j}" for j in range(len(search.running))]
                # Each row is a request of its own (as vLLM's rows): its latencies count from the round's start.
                beams = search.beams()
                search.advance(
                    await self._beam_round(
                        loop, rows, beams, sampling, time.monotonic(), cache_salt
                    )
                )
        finally:
            self.num_in_flight -= 1
            self.beam_rows -= params.beam_width
        decode = lambda tokens: self.engine.tokenizer.decode(tokens, skip_special_tokens=True)  # noqa: E731
        out = search.hypotheses(decode, eos)
        self.metrics.observe_finished(out.sequences[0].finish_reason, time.monotonic() - arrival)
        return out

    async def _beam_round(
        self,
        loop: asyncio.AbstractEventLoop,
        request_ids: list[str],
        beams: list[list[int]],
        sampling: SamplingParams,
        arrival: float,
        cache_salt: str | None,
    ) -> list[dict[int, float]]:
        """Add one request a beam, all at once, and await them; each one's next-token log-probs.
        Whatever ends it early (an error, the caller cancelled) aborts every request of the round."""
        adds = [
            asyncio.ensure_future(self._add_admitted(loop, ids, sampling, rid, arrival, cache_salt))
            for rid, ids in zip(request_ids, beams)
        ]
        try:
            await asyncio.wait(
                adds
            )  # all of them, even when one fails: each added one is aborted below
            streams = [a.result() for a in adds]  # raises the first failure, if any
            finals = await asyncio.gather(
                *(_final_output(s) for s in streams), return_exceptions=True
            )
            for out in finals:
                if isinstance(out, BaseException):
                    raise out  # a step serving a row failed: the search fails with it
            return [out.outputs[0].logprobs[0] for out in finals]
        finally:
            for a in adds:
                if not a.done():
                    a.cancel()  # `add` aborts its request itself
                elif not a.cancelled() and a.exception() is None:
                    a.result().abort()  # idempotent: a no-op for a finished stream

    def _admit(self, arrival: float | None) -> tuple[asyncio.AbstractEventLoop, float]:
        """Refuse work when stopped or full; else the caller's event loop and arrival time."""
        if not self.alive:
            raise EngineStopped("the engine is not running")
        if self.num_in_flight >= self.max_queue:
            raise QueueFull(f"{self.num_in_flight} requests in flight (max_queue={self.max_queue})")
        return asyncio.get_running_loop(), time.monotonic() if arrival is None else arrival

    def stop(self, timeout: float | None = 10.0) -> None:
        """Abort everything, fail open streams with EngineStopped, and join the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ------------------------------------------------------------------ engine thread

    def _submit(self, command: Callable[[], None]) -> None:
        with self._cond:
            if not self._finished:
                self._commands.append(command)
                self._cond.notify()
                return
        command()  # the engine thread is gone, so running it here cannot race with it

    def _abort_now(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self.engine.abort(request_id)

    def _run(self) -> None:
        """The engine thread: serve until `stop()`; survive engine crashes within the budget."""
        try:
            while True:
                try:
                    self._serve()
                    return  # stop() was called
                except (
                    Exception
                ) as e:  # an engine bug: fail what is in flight, recover, serve again
                    if not self._take_restart():
                        raise  # `error` is set before any stream hears of it, so /health agrees
                    self._fail_streams(EngineStopped(f"engine error: {e}"))
                    logger.exception(
                        "engine loop crashed; restarting (%d of at most %d restarts in %.0f s)",
                        len(self.restarts),
                        self.max_restarts,
                        self.restart_window_s,
                    )
                    self._recover()
        except BaseException as e:  # out of restarts, recovery failed, or an interrupt: stay down
            logger.exception("engine loop is down")
            self.error = e
        finally:
            self._fail_all(
                EngineStopped(
                    "the engine stopped" if self.error is None else f"engine error: {self.error}"
                )
            )
            if (
                self.error is None
            ):  # a clean stop: cached pages go to the disk tier, if there is one
                try:
                    self.engine.close()
                except Exception:
                    logger.exception("closing the engine failed")

    def _serve(self) -> None:
        """Run commands and steps until `stop()`; whatever the engine raises propagates."""
        while True:
            with self._cond:
                while not (self._commands or self._stopping or self.engine.has_unfinished()):
                    self._busy_since = None
                    self._cond.wait()
            self._busy_since = time.monotonic()
            self._run_commands()
            if self._stopping:
                return
            if self.engine.has_unfinished():
                outputs = self.engine.step()
                for out in outputs:
                    self._dispatch(out)
            self.stats = self._snapshot()

    def _run_commands(self) -> None:
        """One at a time, so a command that raises loses no other: the rest run after the restart."""
        while True:
            with self._cond:
                if not self._commands:
                    return
                command = self._commands.pop(0)
            command()

    def _take_restart(self) -> bool:
        """Count a restart, unless `max_restarts` already happened within `restart_window_s`."""
        now = time.monotonic()
        while self.restarts and now - self.restarts[0] > self.restart_window_s:
            self.restarts.popleft()
        if len(self.restarts) >= self.max_restarts:
            return False
        self.restarts.append(now)
        return True

    def _recover(self) -> None:
        """Make the engine servable after a crash left its state unknown."""
        recover = getattr(self.engine, "recover", None)  # LLMEngine has it; test stand-ins may not
        if recover is not None:
            recover()
        self.stats = self._snapshot()

    def _dispatch(self, out: RequestOutput) -> None:
        entry = self._streams.get(out.request_id)
        if entry is None:
            return
        if out.finished:
            del self._streams[out.request_id]
        item = (
            out
            if out.error is None
            else RequestFailed(f"the engine step serving this request failed: {out.error}")
        )
        _call_soon(entry[0], entry[1]._put, item)

    def _fail_streams(self, error: EngineStopped) -> None:
        """Abort every request that has a stream and end its stream with `error`."""
        for request_id, (loop, stream) in list(self._streams.items()):
            try:
                self.engine.abort(request_id)
            except Exception:
                logger.exception("abort of %s failed while failing its stream", request_id)
            _call_soon(loop, stream._put, error)
        self._streams.clear()

    def _fail_all(self, error: EngineStopped) -> None:
        self._closing = True
        self._fail_streams(error)
        with self._cond:
            pending, self._commands = self._commands, []
            self._finished = True
        for command in pending:  # queued adds are answered with EngineStopped
            try:
                command()
            except Exception:
                logger.exception("command failed during shutdown")
        self.stats = self._snapshot()

    def _snapshot(self) -> EngineStats:
        return self.engine.stats()


class DataParallelEngine:
    """Data-parallel replicas behind the one server: an `AsyncEngine` (its own thread) per
    replica's `LLMEngine`, with `AsyncEngine`'s surface. Each request goes where `PrefixRouter`
    sends it: the replica that got its leading pages before (so its prefix cache hits), else the
    one with the fewest requests in flight. `max_queue` bounds all replicas together."""

    def __init__(
        self,
        engines: Sequence[Any],
        page_size: int,
        *,
        max_queue: int = 256,
        metrics: ServerMetrics | None = None,
        **kwargs: Any,
    ) -> None:
        self.metrics = metrics or ServerMetrics()
        self.replicas = [
            AsyncEngine(e, max_queue=max_queue, metrics=self.metrics, **kwargs) for e in engines
        ]
        self.router = PrefixRouter(len(self.replicas), page_size)
        self.max_queue = max_queue

    def start(self) -> None:
        for replica in self.replicas:
            replica.start()

    @property
    def alive(self) -> bool:
        return all(r.alive for r in self.replicas)

    @property
    def error(self) -> BaseException | None:
        """The first replica's loop that went down for good, if any."""
        return next((r.error for r in self.replicas if r.error is not None), None)

    def stalled_for(self) -> float:
        """The longest current iteration of any replica (see `AsyncEngine.stalled_for`)."""
        return max(r.stalled_for() for r in self.replicas)

    @property
    def num_in_flight(self) -> int:
        return sum(r.num_in_flight for r in self.replicas)

    @property
    def stats(self) -> EngineStats:
        """The replicas' counters summed."""
        snapshots = [r.stats for r in self.replicas]
        return EngineStats(
            **{
                f.name: sum(getattr(s, f.name) for s in snapshots)
                for f in dataclasses.fields(EngineStats)
            }
        )

    async def add(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        request_id: str,
        arrival: float | None = None,
        cache_salt: str | None = None,
    ) -> RequestStream:
        if self.num_in_flight >= self.max_queue:
            raise QueueFull(f"{self.num_in_flight} requests in flight (max_queue={self.max_queue})")
        replica = self.replicas[
            self.router.pick(prompt_ids, [r.num_in_flight for r in self.replicas])
        ]
        return await replica.add(prompt_ids, params, request_id, arrival, cache_salt)

    async def beam_search(
        self,
        prompt_ids: Sequence[int],
        params: BeamSearchParams,
        arrival: float | None = None,
        cache_salt: str | None = None,
    ) -> BeamSearchOutput:
        """On one replica (all its rounds there, so its prefix cache serves them), picked as `add` picks."""
        if self.num_in_flight >= self.max_queue:
            raise QueueFull(f"{self.num_in_flight} requests in flight (max_queue={self.max_queue})")
        replica = self.replicas[
            self.router.pick(prompt_ids, [r.num_in_flight for r in self.replicas])
        ]
        return await replica.beam_search(prompt_ids, params, arrival, cache_salt)

    def stop(self, timeout: float | None = 10.0) -> None:
        for replica in self.replicas:
            replica.stop(timeout)


async def _final_output(stream: RequestStream) -> RequestOutput:
    """Read a stream to its end; its final output (its error, if it failed)."""
    last = None
    async for out in stream:
        last = out
    if last is None or not last.finished:
        raise EngineStopped(f"request {stream.request_id} ended without an output")
    return last


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the event loop is already closed (process exiting)
        pass


def _resolve(
    loop: asyncio.AbstractEventLoop,
    fut: asyncio.Future[Any],
    error: BaseException | None,
    result: Any = None,
) -> None:
    def set_() -> None:
        if fut.done():
            return
        if error is None:
            fut.set_result(result)
        else:
            fut.set_exception(error)

    _call_soon(loop, set_)
