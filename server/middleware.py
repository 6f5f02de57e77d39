"""`GateMiddleware` (plain ASGI, so streaming is untouched): the checks every request passes
before it reaches a handler, and a request counter by route and status for /metrics.

In order: the Host header (421), a WebSocket's Origin (403), the API key on every `/v1/*`
path and on `/metrics` (401; a browser's WebSocket may offer it as a subprotocol instead;
`/metrics` takes the metrics key instead when one is set), and a JSON Content-Type on every
POST (415). With several API keys, a request's key also picks its prefix-cache salt (put in
the scope as `SCOPE_KEY_SALT`). See `server/security.py` for why.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import Any

from server.protocol import APIError
from server.security import (
    SCOPE_KEY_SALT,
    OriginPolicy,
    api_key_list,
    header,
    host_allowed,
    is_json,
    key_cache_salt,
    matching_key,
    websocket_key,
)
from server.state import ServerState

ROUTES = (
    "/",
    "/health",
    "/metrics",
    "/v1/models",
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/stream",
)


def route_label(path: str) -> str:
    """A bounded label set: unknown paths never create new series."""
    if path in ROUTES:
        return path
    return "/v1/models/{model}" if path.startswith("/v1/models/") else "other"


class GateMiddleware:
    """`allowed_hosts`: Host names accepted, from `normalize_hosts` (None: any). `origins`: who
    may open a WebSocket (default: clients without an Origin and the server's own pages).
    `api_keys`: the keys `/v1/*` accepts (default: `state.api_key`, one key or a comma-separated
    list; none: open). `metrics_api_key`: the one key `/metrics` accepts (default: any API key)."""

    def __init__(
        self,
        app: Any,
        state: ServerState,
        allowed_hosts: frozenset[str] | None = None,
        origins: OriginPolicy | None = None,
        api_keys: Collection[str] | None = None,
        metrics_api_key: str | None = None,
    ) -> None:
        self.app = app
        self.state = state
        self.allowed_hosts = allowed_hosts
        self.origins = origins or OriginPolicy()
        self.api_keys = api_key_list(state.api_key if api_keys is None else api_keys)
        self.metrics_keys = (metrics_api_key,) if metrics_api_key else self.api_keys
        # One key is one tenant: its clients share the cache. Several keys: a salt per key.
        self.key_salts = (
            {k: key_cache_salt(k) for k in self.api_keys} if len(self.api_keys) > 1 else {}
        )

    def _required_keys(self, path: str) -> tuple[str, ...]:
        if path.startswith("/v1"):
            return self.api_keys
        if path == "/metrics" or path.startswith("/metrics/"):
            return self.metrics_keys
        return ()

    def _authorized(self, scope: dict[str, Any]) -> bool:
        """Whether the request carries a key its path accepts (or needs none); records the key's
        cache salt in the scope."""
        keys = self._required_keys(scope["path"])
        if not keys:
            return True
        scheme, _, token = (header(scope, b"authorization") or "").partition(" ")
        if scheme.lower() == "bearer":
            offered: str | None = token.strip()
        else:
            offered = (
                websocket_key(scope) if scope["type"] == "websocket" else None
            )  # a browser page's socket
        key = None if offered is None else matching_key(offered, keys)
        if key is None:
            return False
        if key in self.key_salts:
            scope[SCOPE_KEY_SALT] = self.key_salts[key]
        return True

    def _refusal(self, scope: dict[str, Any]) -> APIError | None:
        """The error that stops this request, or None to let it through."""
        if not host_allowed(scope, self.allowed_hosts):
            return APIError(
                421,
                "the Host header does not name this server (see --allowed-hosts)",
                code="invalid_host",
            )
        if scope["type"] == "websocket" and not self.origins.allows(scope):
            return APIError(
                403,
                "WebSocket connections from this Origin are not allowed (see --allowed-origins)",
                code="origin_not_allowed",
            )
        if not self._authorized(scope):
            return APIError(
                401,
                "missing or invalid API key; send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        if (
            scope["type"] == "http"
            and scope["method"] == "POST"
            and not is_json(header(scope, b"content-type"))
        ):
            return APIError(
                415,
                "request body must be sent with 'Content-Type: application/json'",
                code="unsupported_media_type",
            )
        return None

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
            refusal = self._refusal(scope)
            if refusal is None:
                await self.app(scope, receive, send_and_record)
            else:
                await _deny(scope, receive, send_and_record, refusal)
        finally:
            method = scope.get("method", "WS")
            self.state.metrics.observe_http(method, route_label(scope["path"]), status["code"])


async def _deny(scope: dict[str, Any], receive: Any, send: Any, err: APIError) -> None:
    """Answer `err` as JSON; a WebSocket handshake gets it as an HTTP response where the ASGI
    server supports that, else a close with 1008 (policy violation)."""
    body = json.dumps(err.body()).encode()
    headers = [(b"content-type", b"application/json")]
    headers += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in err.headers.items()]
    if scope["type"] == "http":
        await send({"type": "http.response.start", "status": err.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        return
    await receive()  # websocket.connect
    if "websocket.http.response" in (scope.get("extensions") or {}):
        await send(
            {"type": "websocket.http.response.start", "status": err.status, "headers": headers}
        )
        await send({"type": "websocket.http.response.body", "body": body})
    else:
        await send({"type": "websocket.close", "code": 1008})
