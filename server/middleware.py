"""`GateMiddleware` (plain ASGI, so streaming is untouched): the API key on every `/v1/*`
path, HTTP or WebSocket, and a request counter by route and status for /metrics."""

from __future__ import annotations

import hmac
import json
from typing import Any

from server.protocol import APIError
from server.state import ServerState

ROUTES = ("/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/stream")


def route_label(path: str) -> str:
    """A bounded label set: unknown paths never create new series."""
    if path in ROUTES:
        return path
    return "/v1/models/{model}" if path.startswith("/v1/models/") else "other"


class GateMiddleware:
    def __init__(self, app: Any, state: ServerState) -> None:
        self.app = app
        self.state = state

    def _authorized(self, scope: dict[str, Any]) -> bool:
        key = self.state.api_key
        if key is None or not scope["path"].startswith("/v1"):
            return True
        headers = dict(scope.get("headers") or [])
        scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        status = {"code": 500}

        async def send_and_record(message: dict[str, Any]) -> None:
            kind = message["type"]
            if kind in ("http.response.start", "websocket.http.response.start"):
                status["code"] = message["status"]
            elif kind == "websocket.accept":
                status["code"] = 101
            elif kind == "websocket.close" and status["code"] == 500:
                status["code"] = 403  # closed before accepting: a refused handshake
            await send(message)

        try:
            if self._authorized(scope):
                await self.app(scope, receive, send_and_record)
            else:
                await _deny(scope, receive, send_and_record)
        finally:
            method = scope.get("method", "WS")
            self.state.metrics.observe_http(method, route_label(scope["path"]), status["code"])


async def _deny(scope: dict[str, Any], receive: Any, send: Any) -> None:
    err = APIError(401, "missing or invalid API key; send 'Authorization: Bearer <key>'", code="invalid_api_key")
    body = json.dumps(err.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]
    if scope["type"] == "http":
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        return
    await receive()  # websocket.connect
    if "websocket.http.response" in scope.get("extensions", {}):
        await send({"type": "websocket.http.response.start", "status": 401, "headers": headers})
        await send({"type": "websocket.http.response.body", "body": body})
    else:
        await send({"type": "websocket.close", "code": 1008})
