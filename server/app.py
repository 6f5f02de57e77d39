"""FastAPI app: OpenAI-compatible completions and chat (JSON and SSE), `WS /v1/stream`,
`/health`, `/metrics`, `/v1/models` and the chat page at `/`, over one `AsyncEngine` shared by
every request.

Bodies are read and parsed by hand (size limit, strict UTF-8, strict JSON, pydantic models) so
every bad input gets an OpenAI-style `{"error": {...}}` with a 4xx code, never FastAPI's 422.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Coroutine
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.connections import (
    BODY_READ_TIMEOUT_S,
    ConnectionLimits,
    OpenSockets,
    SlowReader,
    drop_connection,
    record_transport,
    send_within,
)
from server.engine_loop import EngineStopped, RequestFailed, RequestStream
from server.metrics import ServerMetrics
from server.middleware import GateMiddleware
from server.page import chat_page
from server.protocol import APIError, ChatCompletionRequest, CompletionRequest
from server.responses import ChatFormatter, CompletionFormatter, _Formatter, beam_search_output, sse
from server.security import OriginPolicy, api_key_list, normalize_hosts, request_cache_salt
from server.state import LLMLike, PreprocessSlot, ServerState, stream_error
from server.ws import serve_socket

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 1 << 20
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def create_app(
    llm_or_factory: LLMLike | Callable[[], LLMLike],
    *,
    model_name: str,
    api_key: str | Collection[str] | None = None,
    metrics_api_key: str | None = None,
    max_queue: int = 256,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    on_load_error: Callable[[BaseException], None] | None = None,
    allowed_hosts: Collection[str] | None = None,
    allowed_origins: Collection[str] = (),
    limits: ConnectionLimits | None = None,
) -> FastAPI:
    """Build the app around an already-built `LLM` (ready at once) or a factory, which runs on
    a background thread after start-up so `/health` answers 503 while it loads and warms up.

    `allowed_hosts`: Host names (port ignored) the server answers to, others get 421; None
    turns the check off (the CLI passes the loopback names when bound to loopback).
    `allowed_origins`: origins besides the server's own whose pages may open the WebSocket.
    `api_key`: one key, or several (a list or 'a,b'): each then gets its own prefix-cache salt.
    `metrics_api_key`: the key `/metrics` needs (default: any `api_key`; open when there is none).
    `limits`: send timeout, WebSocket cap and idle timeout, hung-step timeout (default: the
    `server.connections` constants, at most `max_queue` WebSockets)."""
    limits = limits or ConnectionLimits(max_websockets=max_queue)
    sockets = OpenSockets(limits)
    state = ServerState(
        model_name, api_key=api_key, max_queue=max_queue, max_body_bytes=max_body_bytes
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if hasattr(llm_or_factory, "engine"):
            state.attach(llm_or_factory)  # type: ignore[arg-type]
        else:
            loader = threading.Thread(
                target=_load,
                args=(state, llm_or_factory, on_load_error),
                daemon=True,
                name="model-loader",
            )
            loader.start()
        try:
            yield
        finally:
            await asyncio.to_thread(state.close)

    app = _ServerApp(
        title="minivllm-jax", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.minivllm = state
    app.state.limits, app.state.sockets = limits, sockets
    origins = OriginPolicy(
        allowed_origins
    )  # here, not lazily in the middleware stack: bad ones fail now
    app.add_middleware(
        GateMiddleware,
        state=state,
        allowed_hosts=normalize_hosts(allowed_hosts),
        origins=origins,
        api_keys=api_key_list(api_key),
        metrics_api_key=metrics_api_key,
    )
    _add_error_handlers(app)

    @app.get("/")
    async def page() -> Response:
        return chat_page()

    @app.get("/health")
    async def health() -> Response:
        stalled = state.engine.stalled_for() if state.engine is not None else 0.0
        if (
            state.healthy and stalled >= limits.hung_step_timeout_s
        ):  # a hung step: the supervisor should restart us
            error = f"the engine has made no step progress for {stalled:.0f} s"
            return JSONResponse(
                {"status": "stalled", "error": error}, 503, headers={"Retry-After": "1"}
            )
        if state.healthy:
            return JSONResponse({"status": "ok", "model": state.model_name})
        return JSONResponse(
            {"status": state.status, "error": state.error}, 503, headers={"Retry-After": "1"}
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(
            state.render_metrics(), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(state)]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict[str, Any]:
        state.check_model(model)
        return _model_card(state)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _generate(request, state, COMPLETIONS)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _generate(request, state, CHAT_COMPLETIONS)

    @app.websocket("/v1/stream")
    async def stream(websocket: WebSocket) -> None:
        await serve_socket(websocket, state, sockets)

    return app


GenerateRequest = CompletionRequest | ChatCompletionRequest


@dataclasses.dataclass(frozen=True)
class Endpoint:
    """What tells the completion and chat handlers apart (`_generate` does the rest): the body's
    model, its response ids' prefix, how its prompt becomes token ids, and its formatter."""

    request_model: type[GenerateRequest]
    id_prefix: str
    prompt_ids: Callable[[ServerState, PreprocessSlot, Any], Awaitable[list[int]]]
    formatter: Callable[[ServerState, Any, str], _Formatter]


COMPLETIONS = Endpoint(
    CompletionRequest,
    "cmpl",
    lambda state, slot, req: state.prompt_ids(slot, req.single_prompt(), None),
    lambda state, req, rid: CompletionFormatter(
        rid,
        state.model_name,
        int(time.time()),
        state.table,
        req.logprobs,
        req.n,
        req.include_usage,
    ),
)
CHAT_COMPLETIONS = Endpoint(
    ChatCompletionRequest,
    "chatcmpl",
    lambda state, slot, req: state.prompt_ids(
        slot, None, req.messages, req.offered_tools(), req.parallel_tool_calls is not False
    ),
    lambda state, req, rid: ChatFormatter(
        rid,
        state.model_name,
        int(time.time()),
        state.table,
        (req.top_logprobs or 0) if req.logprobs else None,
        req.n,
        req.include_usage,
        tool_plan=req.parsed_tool_plan(),
    ),
)


async def _generate(request: Request, state: ServerState, endpoint: Endpoint) -> Response:
    """One generation request: read the body, then, holding a preprocessing place until the
    engine admits it, parse it, compile its output constraints, tokenize its prompt and start
    it; answer as JSON or SSE (a beam search as one JSON body)."""
    arrival = time.monotonic()
    state.require_ready()
    state.check_capacity()
    # Read outside the preprocessing places: a slow sender would hold one.
    raw = await _read_body(request, state.max_body_bytes)
    with state.preprocessing() as slot:  # until the engine admits it
        req = await state.parse(slot, endpoint.request_model, raw)
        state.check_model(req.model)
        params = None if req.use_beam_search else req.sampling_params()
        await state.check_constraints(slot, req.constraints_to_check())
        ids = await endpoint.prompt_ids(state, slot, req)
        rid = f"{endpoint.id_prefix}-{uuid.uuid4().hex}"
        fmt = endpoint.formatter(state, req, rid)
        salt = request_cache_salt(request.scope, req.cache_salt)
        stream = (
            None
            if params is None
            else await state.start(ids, params, rid, arrival, req.field_names(), salt)
        )
    if stream is None:
        return await _respond_beam_search(request, state, ids, req, fmt, arrival)
    return await _respond(request, stream, fmt, req.stream)


def _load(
    state: ServerState,
    factory: Callable[[], LLMLike],
    on_error: Callable[[BaseException], None] | None,
) -> None:
    start = time.perf_counter()
    try:
        state.attach(factory())
    except BaseException as e:  # surface it on /health and to the CLI, never swallow it
        if type(e).__module__.startswith("convert") or isinstance(e, (OSError, ValueError)):
            logger.error("loading the model failed: %s", e)  # a user error: one line is enough
        else:
            logger.exception("loading the model failed")
        state.fail(e)
        if on_error is not None:
            on_error(e)
        return
    logger.info("model %r ready in %.1fs", state.model_name, time.perf_counter() - start)


def _model_card(state: ServerState) -> dict[str, Any]:
    card: dict[str, Any] = {"id": state.model_name, "object": "model", "created": state.created}
    card["owned_by"] = "minivllm-jax"
    if state.llm is not None:
        card["max_model_len"] = state.llm.engine.config.max_model_len
    return card


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it is known to exceed `limit` bytes, and with 408
    unless it has all arrived within `BODY_READ_TIMEOUT_S` (a slow body holds a connection)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)

    async def read() -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        return await asyncio.wait_for(read(), BODY_READ_TIMEOUT_S)
    except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
        raise APIError(
            408,
            f"the request body did not arrive within {BODY_READ_TIMEOUT_S:g} s",
            code="request_timeout",
            headers={"Connection": "close"},
        ) from None


def _too_large(limit: int) -> APIError:
    return APIError(
        413, f"request body is larger than the {limit}-byte limit", code="request_too_large"
    )


class _ServerApp(FastAPI):
    """FastAPI, noting each connection's transport in its scope (`record_transport`) so a
    response whose client stopped reading can drop the connection."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket"):
            record_transport(scope, send)
        await super().__call__(scope, receive, send)


class _EngineStreamResponse(StreamingResponse):
    """SSE response that aborts its request however the response ends (done, client gone,
    cancelled at shutdown, or never started). A chunk the client does not take within
    `send_timeout_s` (it stopped reading) aborts the request and drops the connection."""

    def __init__(
        self,
        stream: RequestStream,
        content: AsyncIterator[str],
        send_timeout_s: float,
        metrics: ServerMetrics,
    ) -> None:
        super().__init__(content, media_type="text/event-stream", headers=SSE_HEADERS)
        self._stream = stream
        self._send_timeout_s = send_timeout_s
        self._metrics = metrics

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def send_or_give_up(message: Any) -> None:
            await send_within(send(message), self._send_timeout_s)

        try:
            await super().__call__(scope, receive, send_or_give_up)
        except SlowReader as e:
            logger.info("dropping an SSE client of %s: %s", self._stream.request_id, e)
            self._metrics.observe_slow_reader("sse")
            self._stream.abort()  # before the drop: its pages are free whatever the server does next
            await drop_connection(scope)
        finally:
            self._stream.abort()


async def _respond(
    request: Request, stream: RequestStream, fmt: _Formatter, streaming: bool
) -> Response:
    """Answer an admitted request: SSE, or one JSON body once it is done."""
    if streaming:
        app_state = request.app.state
        return _EngineStreamResponse(
            stream,
            _sse_events(stream, fmt),
            app_state.limits.send_timeout_s,
            app_state.minivllm.metrics,
        )
    try:
        final = await _unless_disconnected(request, _last_output(stream))
    except (EngineStopped, RequestFailed) as e:
        raise stream_error(e) from None
    finally:
        stream.abort()
    if final is None:  # the client is gone; nobody will read this
        return Response(status_code=499)
    return await _json_response(
        lambda: fmt.response(final, stream.prompt_tokens), _token_entries(final, fmt)
    )


async def _respond_beam_search(
    request: Request,
    state: ServerState,
    ids: list[int],
    req: GenerateRequest,
    fmt: _Formatter,
    arrival: float,
) -> Response:
    """`use_beam_search`: one search, its beams in the shared batch (`ServerState.beam_search`),
    answered as one JSON body whose n choices are the hypotheses, best first. A client that
    disconnects cancels it: the round in flight is aborted and no other starts."""
    assert state.engine is not None and state.llm is not None
    rest = state.llm.engine.config.max_model_len - len(
        ids
    )  # no max_tokens: the rest, as the engine resolves it
    params = req.beam_search_params(max(rest, 1))
    salt = request_cache_salt(
        request.scope, req.cache_salt
    )  # its rows share pages as the request's own would
    out = await _unless_disconnected(request, state.beam_search(ids, params, arrival, salt))
    if out is None:  # the client is gone (the search was cancelled)
        return Response(status_code=499)
    final = beam_search_output(fmt.id, ids, out)
    return await _json_response(lambda: fmt.response(final, len(ids)), _token_entries(final, fmt))


# A non-streaming body of more token entries (tokens x (top logprobs + 1)) than this is built and
# serialized on a thread: that is ~1 ms of Python per 100 entries, which on the event loop would
# stall every stream and /health meanwhile.
JSON_ON_LOOP_MAX_TOKEN_ENTRIES = 2048


def _token_entries(out: Any, fmt: _Formatter) -> int:
    return sum(len(c.token_ids) for c in out.outputs) * ((fmt.top_k or 0) + 1)


async def _json_response(build: Callable[[], dict[str, Any]], token_entries: int) -> Response:
    """`JSONResponse(build())`, built off the event loop when the body is large."""
    if token_entries <= JSON_ON_LOOP_MAX_TOKEN_ENTRIES:
        return JSONResponse(build())
    return await asyncio.to_thread(lambda: JSONResponse(build()))


async def _sse_events(stream: RequestStream, fmt: _Formatter) -> AsyncIterator[str]:
    for chunk in fmt.start_chunks():
        yield sse(chunk)
    last = None
    try:
        async for out in stream:
            last = out
            chunks = fmt.chunks(out)
            if chunks:
                yield "".join(sse(c) for c in chunks)
    except (EngineStopped, RequestFailed) as e:
        yield sse(stream_error(e).body())
    else:
        if fmt.include_usage:
            yield sse(fmt.usage_chunk(last, stream.prompt_tokens))
    yield sse("[DONE]")


async def _last_output(stream: RequestStream) -> Any:
    last = None
    async for out in stream:
        last = out
    return last


async def _unless_disconnected(request: Request, work: Coroutine[Any, Any, Any]) -> Any:
    """Run `work` while watching the connection; None if the client disconnects first (the
    body is fully read, so the next `receive()` only returns on disconnect)."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    return task.result() if task in done else None


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> Response:
        return JSONResponse(e.body(), e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        err = APIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", code=code)
        return JSONResponse(err.body(), e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> Response:
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        err = APIError(500, "internal server error", type="server_error", code="internal_error")
        return JSONResponse(err.body(), 500)
