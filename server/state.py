"""`ServerState`: what the HTTP and WebSocket handlers share (the model once loaded, the
engine loop, the tokenizer worker, metrics) and the request steps they have in common.

Before the engine admits a request (and `--max-queue` counts it), its body is parsed, its
prompt tokenized and its output constraints compiled. That work is bounded too: at most
`max_preprocessing` requests are in it at once (more get a 429), each stage has a deadline,
and work a request gave up on at a deadline keeps its place until it ends, so abandoned work
is bounded by the same limit. Reading the body is not counted here (a client sending slowly
would hold a place while costing nothing): it has its own deadline and uvicorn's connection
limit (`server.connections`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Iterator
from typing import Any, Protocol, TypeVar

from minivllm_jax.engine.decoding.beam_search import BeamSearchOutput, BeamSearchParams
from minivllm_jax.sampling_params import ParamError, SamplingParams, StructuredOutputsParams
from server.engine_loop import (
    AsyncEngine,
    DataParallelEngine,
    EngineStopped,
    QueueFull,
    RequestFailed,
    RequestStream,
)
from server.metrics import ServerMetrics
from server.preprocess import Preprocessor, TokenTable
from server.protocol import (
    APIError,
    ChatMessage,
    beam_search_error,
    check_response_size,
    invalid,
    param_error,
    parse_json,
    parse_request,
)

logger = logging.getLogger(__name__)

RETRY_AFTER_S = "1"
# Requests being parsed, tokenized or compiled at once (before the engine admits them).
# Tokenizing and compiles each run on one worker thread, so more would only wait in line.
DEFAULT_MAX_PREPROCESSING = 64
# Stage deadlines. Each stage's work is bounded by the request limits (a 1 MB body parses in
# ~10 ms, a prompt is refused after O(max_model_len) tokenizer work), so passing one means the
# server is overloaded (429, retry) or, for a grammar, that the constraint costs too much (400).
PARSE_DEADLINE_S = 10.0
TOKENIZE_DEADLINE_S = 10.0
GRAMMAR_COMPILE_DEADLINE_S = 30.0
# Bodies larger than this are parsed and validated on a thread, not on the event loop (so
# /health and every stream keep being served meanwhile); smaller ones take well under 1 ms.
PARSE_ON_LOOP_MAX_BYTES = 16 << 10

T = TypeVar("T")


def queue_full(detail: str) -> APIError:
    return APIError(
        429,
        f"server is busy: {detail}; retry later",
        type="rate_limit_error",
        code="queue_full",
        headers={"Retry-After": RETRY_AFTER_S},
    )


def admission_error(e: QueueFull | EngineStopped) -> APIError:
    """Work the engine did not take: a full queue (429) or a stopped engine (503), both retryable."""
    if isinstance(e, QueueFull):
        return queue_full(str(e))
    return APIError(
        503,
        str(e),
        type="service_unavailable",
        code="engine_unavailable",
        headers={"Retry-After": RETRY_AFTER_S},
    )


def stream_error(e: EngineStopped | RequestFailed) -> APIError:
    """The error for a stream that ended early: a failed step is the server's fault (500; the
    cause is in the server log, not sent), a stopped engine is unavailable (503)."""
    if isinstance(e, RequestFailed):
        return APIError(
            500,
            "the engine step serving this request failed",
            type="server_error",
            code="engine_step_failed",
        )
    return APIError(503, str(e), type="service_unavailable", code="engine_unavailable")


def preprocess_timeout(stage: str, deadline_s: float) -> APIError:
    return APIError(
        429,
        f"server is busy: the request's {stage} stage took more than {deadline_s:g} s; retry later",
        type="rate_limit_error",
        code="preprocess_timeout",
        headers={"Retry-After": RETRY_AFTER_S},
    )


class PreprocessSlot:
    """One request's place among those being preprocessed (`PreprocessGate.slot`). Work run
    as a `stage` keeps the place taken until it ends, even when the request stopped waiting for
    it at the stage's deadline (a thread cannot be interrupted)."""

    def __init__(self, gate: PreprocessGate) -> None:
        self._gate = gate
        self._running = 0
        self._closed = self._released = False

    async def stage(
        self, name: str, deadline_s: float, work: Awaitable[T], on_timeout: APIError | None = None
    ) -> T:
        """`work`'s result, or `on_timeout` (default: a 429 naming the stage) after `deadline_s`."""
        task = asyncio.ensure_future(work)
        self._running += 1
        task.add_done_callback(self._work_done)
        try:
            return await asyncio.wait_for(asyncio.shield(task), deadline_s)
        except TimeoutError:
            raise (on_timeout or preprocess_timeout(name, deadline_s)) from None

    def _work_done(self, task: asyncio.Future[Any]) -> None:
        if not task.cancelled():
            task.exception()  # retrieved: the request may have stopped waiting for it
        self._running -= 1
        self._release_if_idle()

    def close(self) -> None:
        self._closed = True
        self._release_if_idle()

    def _release_if_idle(self) -> None:
        if self._closed and not self._running and not self._released:
            self._released = True
            self._gate.active -= 1


class PreprocessGate:
    """At most `limit` requests between arrival and engine admission; the next one is a 429
    at once (no waiting: a client retrying later costs nothing meanwhile). Used on the event
    loop thread only, so a plain counter is exact."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.active = 0

    @contextlib.contextmanager
    def slot(self) -> Iterator[PreprocessSlot]:
        if self.active >= self.limit:
            raise queue_full(f"{self.active} requests are being preprocessed (limit {self.limit})")
        self.active += 1
        slot = PreprocessSlot(self)
        try:
            yield slot
        finally:
            slot.close()


class LLMLike(Protocol):
    """What the server needs from `minivllm_jax.LLM` (tests may pass a stand-in)."""

    engine: Any
    tokenizer: Any


class ServerState:
    def __init__(
        self,
        model_name: str,
        *,
        api_key: str | Collection[str] | None,
        max_queue: int,
        max_body_bytes: int,
        max_preprocessing: int = DEFAULT_MAX_PREPROCESSING,
    ) -> None:
        self.model_name = model_name
        self.api_key = api_key
        self.max_queue = max_queue
        self.max_body_bytes = max_body_bytes
        self.gate = PreprocessGate(max_preprocessing)
        self.status = "loading"  # loading -> ready | failed
        self.error: str | None = None
        self.metrics = ServerMetrics()
        self.created = int(time.time())
        self.llm: LLMLike | None = None
        self.engine: AsyncEngine | DataParallelEngine | None = None
        self.pre: Preprocessor | None = None
        self.table: TokenTable | None = None

    # ------------------------------------------------------------------ lifecycle

    def attach(self, llm: LLMLike) -> None:
        """Wrap a loaded, warmed-up LLM and start its engine loop (any thread may call this)."""
        self.table = TokenTable(llm.tokenizer)
        compiler = getattr(
            llm.engine, "grammar_compiler", None
        )  # stand-in engines in tests may have none
        self.pre = Preprocessor(
            llm.tokenizer, llm.engine.config.max_model_len, self.table.max_token_bytes, compiler
        )
        replicas = getattr(llm, "engines", [llm.engine])  # data parallelism: several
        if len(replicas) > 1:
            engine = DataParallelEngine(
                replicas,
                llm.engine.config.cache.page_size,
                max_queue=self.max_queue,
                metrics=self.metrics,
            )
        else:
            engine = AsyncEngine(llm.engine, max_queue=self.max_queue, metrics=self.metrics)
        engine.start()
        self.llm, self.engine = llm, engine
        self.status = "ready"  # last: handlers check it before touching the fields above

    def fail(self, error: BaseException) -> None:
        self.error = f"{type(error).__name__}: {error}"
        self.status = "failed"

    def close(self) -> None:
        if self.engine is not None:
            self.engine.stop()
        if self.pre is not None:
            self.pre.close()

    @property
    def healthy(self) -> bool:
        return self.status == "ready" and self.engine is not None and self.engine.alive

    # ------------------------------------------------------------------ request steps

    def require_ready(self) -> None:
        if self.healthy:
            return
        if self.status == "loading":
            message, code = (
                "the model is still loading and warming up; retry shortly",
                "model_loading",
            )
        elif self.status == "failed":
            message, code = f"the model failed to load: {self.error}", "model_load_failed"
        else:
            message, code = "the engine is not running", "engine_unavailable"
        raise APIError(
            503,
            message,
            type="service_unavailable",
            code=code,
            headers={"Retry-After": RETRY_AFTER_S},
        )

    def check_capacity(self) -> None:
        """Refuse early when the queue is full, before reading and tokenizing the body
        (`AsyncEngine.add` checks again, exactly, at admission)."""
        if self.engine is not None and self.engine.num_in_flight >= self.max_queue:
            raise queue_full(
                f"{self.engine.num_in_flight} requests in flight (max_queue={self.max_queue})"
            )

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(
                404,
                f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def preprocessing(self) -> contextlib.AbstractContextManager[PreprocessSlot]:
        """A place among the requests being preprocessed, held until the engine admits the
        request (or it fails); a 429 when all are taken."""
        return self.gate.slot()

    async def parse(self, slot: PreprocessSlot, model: type[Any], raw: bytes) -> Any:
        """The body as `model` (`parse_json` then `parse_request`): on a thread when it is large."""
        return await self.run_parse(slot, len(raw), lambda: parse_request(model, parse_json(raw)))

    async def run_parse(self, slot: PreprocessSlot, size: int, parse: Callable[[], T]) -> T:
        """`parse()` of a body of `size` bytes: at once when it is small, else on a thread as
        the "parse" stage (its deadline: PARSE_DEADLINE_S)."""
        if size <= PARSE_ON_LOOP_MAX_BYTES:
            return parse()
        return await slot.stage("parse", PARSE_DEADLINE_S, asyncio.to_thread(parse))

    async def prompt_ids(
        self,
        slot: PreprocessSlot,
        prompt: str | list[int] | None,
        messages: list[ChatMessage] | None,
        tools: list[dict[str, Any]] | None = None,
        parallel_tool_calls: bool = True,
    ) -> list[int]:
        assert self.pre is not None
        if messages is not None:
            work = self.pre.chat(
                [m.as_template_dict() for m in messages], tools, parallel_tool_calls
            )
        elif prompt is None:
            raise invalid("prompt is required", "prompt")
        else:
            work = self.pre.encode(prompt)
        return await slot.stage("tokenize", TOKENIZE_DEADLINE_S, work)

    async def check_constraints(
        self, slot: PreprocessSlot, constraints: list[tuple[str, StructuredOutputsParams]]
    ) -> None:
        """Compile the request's output constraints before it is admitted (400 for a bad one, or
        for constraints that take more than GRAMMAR_COMPILE_DEADLINE_S to compile)."""
        assert self.pre is not None
        if not constraints:
            return
        param = constraints[0][0].split(".")[0]  # "tools" for a tool's parameters
        too_slow = invalid(
            f"{param}: the output constraints took more than {GRAMMAR_COMPILE_DEADLINE_S:g} s to "
            "compile; simplify them",
            param,
            "grammar_compile_timeout",
        )
        await slot.stage(
            "grammar_compile", GRAMMAR_COMPILE_DEADLINE_S, self.pre.compile(constraints), too_slow
        )

    def check_response_size(
        self,
        prompt_ids: list[int],
        n: int,
        logprobs: int | None,
        max_tokens: int | None,
        renames: dict[str, str] | None = None,
    ) -> None:
        """`protocol.check_response_size` with max_tokens resolved as the engine does (unset: the
        rest of the context)."""
        assert self.llm is not None
        rest = max(self.llm.engine.config.max_model_len - len(prompt_ids), 1)
        check_response_size(
            n, logprobs, rest if max_tokens is None else max_tokens, max_tokens is not None, renames
        )

    async def start(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str,
        arrival: float,
        renames: dict[str, str] | None = None,
        cache_salt: str | None = None,
    ) -> RequestStream:
        """Admit a request into the engine, or raise the matching APIError (400/429/503).
        `cache_salt`: from `security.request_cache_salt` (the request's field and its API key)."""
        assert self.engine is not None
        self.check_response_size(prompt_ids, params.n, params.logprobs, params.max_tokens, renames)
        try:
            return await self.engine.add(prompt_ids, params, request_id, arrival, cache_salt)
        except (QueueFull, EngineStopped) as e:
            raise admission_error(e) from None
        except ParamError as e:  # names its field (the engine's own checks, e.g. the length)
            raise param_error(e, renames) from None
        except (ValueError, TypeError) as e:
            raise invalid(str(e), "prompt") from None

    async def beam_search(
        self,
        prompt_ids: list[int],
        params: BeamSearchParams,
        arrival: float,
        cache_salt: str | None = None,
    ) -> BeamSearchOutput:
        """Run one beam search on the engine (`AsyncEngine.beam_search`), or raise the matching
        APIError: 429/503 as `start` (429 also past the concurrent beam rows), 400 for a search
        that refuses the request, 500 if it failed. `cache_salt` as `start`'s."""
        assert self.engine is not None
        self.check_response_size(prompt_ids, params.beam_width, None, params.max_tokens)
        try:
            return await self.engine.beam_search(prompt_ids, params, arrival, cache_salt)
        except (QueueFull, EngineStopped) as e:
            raise admission_error(e) from None
        except RequestFailed as e:
            raise stream_error(e) from None
        except ValueError as e:
            raise beam_search_error(e) from None

    def render_metrics(self) -> str:
        engine = self.engine
        return self.metrics.render(
            engine.stats if engine is not None else None,
            ready=self.healthy,
            in_flight=engine.num_in_flight if engine is not None else 0,
        )
