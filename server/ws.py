"""`WS /v1/stream`: JSON requests in, `{"type": "token"}` messages then `{"type": "done"}` out.

Requests on one socket run one after another; one sent while another streams waits its turn.
`{"type": "cancel"}` aborts the current request (it ends with `finish_reason: "abort"`).
A bad request gets `{"type": "error", ...}` and the socket stays open for the next one. A
client that disconnects aborts its request, so its KV pages go back to the pool at once.

Limits (`server.connections`): a socket idle for `ws_idle_timeout_s` is closed with 1000; past
`max_websockets` open ones a new socket is closed with 1013; a client that reads nothing for
`send_timeout_s` loses its request and its connection. At shutdown the running request finishes,
later ones get a 503 error message, then the socket is closed with 1001.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import WebSocket

from server.connections import (
    WS_GOING_AWAY,
    WS_NORMAL,
    WS_TRY_AGAIN_LATER,
    OpenSockets,
    SlowReader,
    drop_connection,
    send_within,
)
from server.engine_loop import EngineStopped, RequestFailed, RequestStream
from server.protocol import APIError, StreamRequest, parse_json, parse_request
from server.responses import ChoiceTracker, chat_logprobs, usage
from server.security import WS_SUBPROTOCOL, request_cache_salt
from server.state import ServerState, stream_error

logger = logging.getLogger(__name__)

MAX_PENDING = 8  # requests queued on one socket behind the one streaming
MAX_CANCEL_BYTES = 256  # a cancel message is '{"type": "cancel"}' and some whitespace at most


async def serve_socket(websocket: WebSocket, state: ServerState, sockets: OpenSockets) -> None:
    # A browser that offered subprotocols (the chat page, for its API key) drops a socket whose
    # answer names none of them, so the plain one is echoed back; the key one never is.
    offered = websocket.scope.get("subprotocols") or []
    await websocket.accept(subprotocol=WS_SUBPROTOCOL if WS_SUBPROTOCOL in offered else None)
    if not sockets.enter():
        if sockets.draining.is_set():
            await websocket.close(WS_GOING_AWAY, "the server is shutting down")
        else:
            await websocket.close(
                WS_TRY_AGAIN_LATER,
                f"too many open WebSockets (max {sockets.limits.max_websockets})",
            )
        return
    try:
        await _serve_requests(websocket, state, sockets)
    finally:
        sockets.leave()


async def _serve_requests(websocket: WebSocket, state: ServerState, sockets: OpenSockets) -> None:
    limits = sockets.limits

    async def send(message: dict[str, Any]) -> None:
        await send_within(websocket.send_json(message), limits.send_timeout_s)

    pending: collections.deque[dict[str, Any]] = collections.deque()
    receiving: asyncio.Task[Any] | None = None
    try:
        while True:
            if pending:
                message = pending.popleft()
            else:
                receiving = receiving or asyncio.ensure_future(websocket.receive())
                if not await _arrives(receiving, sockets):
                    if sockets.draining.is_set():
                        await websocket.close(WS_GOING_AWAY, "the server is shutting down")
                    else:
                        await websocket.close(WS_NORMAL, f"idle for {limits.ws_idle_timeout_s:g} s")
                    return
                message, receiving = receiving.result(), None
            if message["type"] == "websocket.disconnect":
                return
            if sockets.draining.is_set():  # only the request already running finishes
                await send(error_message(_SHUTTING_DOWN))
                continue
            try:
                started = await _start(state, message, websocket.scope)
            except APIError as e:
                await send(error_message(e))
                continue
            except (
                Exception
            ):  # a server bug in preparing this request: it alone fails, the socket serves on
                logger.exception("preparing a WebSocket request failed")
                await send(error_message(_INTERNAL_ERROR))
                continue
            if started is None:  # a cancel with nothing running
                continue
            stream, top_k = started
            pump = asyncio.ensure_future(_pump(send, state, stream, top_k))
            try:
                while not pump.done():
                    receiving = receiving or asyncio.ensure_future(websocket.receive())
                    await asyncio.wait({pump, receiving}, return_when=asyncio.FIRST_COMPLETED)
                    if pump.done() or not receiving.done():
                        continue
                    message, receiving = receiving.result(), None
                    if message["type"] == "websocket.disconnect":
                        return
                    if _is_cancel(message):
                        stream.abort()
                    elif len(pending) < MAX_PENDING:
                        pending.append(message)
                    else:
                        busy = APIError(
                            429, "too many requests queued on this socket", code="queue_full"
                        )
                        await send(error_message(busy))
                pump.result()  # a send that failed means the client is gone
            finally:
                stream.abort()
                pump.cancel()
    except (
        SlowReader
    ) as e:  # its request is aborted (above); drop what is queued for it, and the socket
        logger.info("dropping a WebSocket client: %s", e)
        state.metrics.observe_slow_reader("websocket")
        await drop_connection(websocket.scope)
    except Exception as e:  # the socket broke mid-send; nothing left to tell the client
        logger.debug("websocket closed: %r", e)
    finally:
        if receiving is not None:
            receiving.cancel()


_INTERNAL_ERROR = APIError(500, "internal server error", type="server_error", code="internal_error")
_SHUTTING_DOWN = APIError(
    503,
    "the server is shutting down; retry on a new connection",
    type="service_unavailable",
    code="shutting_down",
)


async def _arrives(receiving: asyncio.Task[Any], sockets: OpenSockets) -> bool:
    """Wait for the socket's next message; False if it stays idle for the idle timeout, or
    (at once) if the server is draining."""
    draining = asyncio.ensure_future(sockets.draining.wait())
    try:
        await asyncio.wait(
            {receiving, draining},
            timeout=sockets.limits.ws_idle_timeout_s,
            return_when=asyncio.FIRST_COMPLETED,
        )
    finally:
        draining.cancel()
    return receiving.done()


def error_message(e: APIError) -> dict[str, Any]:
    return {
        "type": "error",
        "status": e.status,
        "message": e.message,
        "param": e.param,
        "code": e.code,
    }


def _is_cancel(message: dict[str, Any]) -> bool:
    if _size(message) > MAX_CANCEL_BYTES:  # not parsed here, on the event loop: its turn comes
        return False
    try:
        return _decode(message) == {"type": "cancel"}
    except APIError:
        return False  # a broken message is answered when its turn comes


def _decode(message: dict[str, Any]) -> Any:
    raw = message.get("bytes")
    if raw is None:
        raw = (message.get("text") or "").encode("utf-8", errors="surrogatepass")
    return parse_json(raw)


async def _start(
    state: ServerState, message: dict[str, Any], scope: dict[str, Any]
) -> tuple[RequestStream, int | None] | None:
    arrival = time.monotonic()
    state.require_ready()
    state.check_capacity()
    size = _size(message)
    if size > state.max_body_bytes:
        raise APIError(
            413,
            f"message is larger than the {state.max_body_bytes}-byte limit",
            code="request_too_large",
        )

    def parse() -> StreamRequest | None:
        data = _decode(message)
        return None if data == {"type": "cancel"} else parse_request(StreamRequest, data)

    with state.preprocessing() as slot:  # until the engine admits it
        req = await state.run_parse(slot, size, parse)
        if req is None:
            return None
        state.check_model(req.model)
        params = req.sampling_params()
        await state.check_constraints(slot, req.constraints_to_check())
        ids = await state.prompt_ids(slot, req.prompt, req.messages)
        salt = request_cache_salt(
            scope, req.cache_salt
        )  # the socket's API key and the request's field
        stream = await state.start(ids, params, f"ws-{uuid.uuid4().hex}", arrival, cache_salt=salt)
    return stream, req.logprobs


def _size(message: dict[str, Any]) -> int:
    return len(message.get("bytes") or b"") + len(message.get("text") or "")


async def _pump(
    send: Callable[[dict[str, Any]], Awaitable[None]],
    state: ServerState,
    stream: RequestStream,
    top_k: int | None,
) -> None:
    tracker = ChoiceTracker(stream.n)
    last = None
    try:
        async for out in stream:
            last = out
            for d in tracker.deltas(out):
                if not (d.text or d.token_ids):
                    continue
                msg: dict[str, Any] = {
                    "type": "token",
                    "id": stream.request_id,
                    "index": d.index,
                    "text": d.text,
                    "token_ids": d.token_ids,
                }
                if top_k is not None and d.logprobs is not None and state.table is not None:
                    msg["logprobs"] = chat_logprobs(state.table, d.token_ids, d.logprobs, top_k)
                await send(msg)
    except (EngineStopped, RequestFailed) as e:
        await send(error_message(stream_error(e)))
        return
    reasons = (
        [c.finish_reason or "abort" for c in last.outputs]
        if last is not None
        else ["abort"] * stream.n
    )
    done: dict[str, Any] = {
        "type": "done",
        "id": stream.request_id,
        "finish_reason": reasons[0],
        "usage": usage(last, stream.prompt_tokens),
    }
    if stream.n > 1:
        done["finish_reasons"] = reasons
    await send(done)
