"""Checks against the browser as the attacker. By default the server listens on loopback with
no API key, so the one party that can reach it uninvited is a web page open in the user's
browser. The gate (`server/middleware.py`) applies these:

- Host: a DNS-rebinding page reaches 127.0.0.1 under its own name; its requests carry that
  name as Host, so a Host that is not ours gets 421.
- Origin: browsers let any page open a WebSocket to any address (no CORS applies), so a
  handshake from another origin gets 403 unless `--allowed-origins` lists it.
- Content-Type: a cross-site `<form>` or `fetch` may POST `text/plain` without a CORS
  preflight; a POST body that is not `application/json` gets 415.
- API key on a WebSocket: a browser cannot set `Authorization` on one, so a page offers the
  key as a subprotocol (`websocket_key`); the server accepts the plain `minivllm` one.

And against other clients, once several API keys are configured (one per tenant): each key's
requests get their own prefix-cache salt (`request_cache_salt`), so no tenant can tell by timing
whether another sent a prompt (vLLM's `cache_salt`); `/metrics` needs a key too.

No response carries CORS headers, so other origins can never read an HTTP response.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from collections.abc import Collection
from typing import Any
from urllib.parse import urlsplit

DEFAULT_PORTS = {"http": 80, "https": 443}
SCOPE_KEY_SALT = (
    "minivllm.key_cache_salt"  # set in the ASGI scope by the gate for a request's API key
)
WS_SUBPROTOCOL = (
    "minivllm"  # the subprotocol the server accepts; a client offering a key offers it too
)
WS_KEY_PREFIX = (
    "minivllm.bearer."  # + the API key, base64url without padding (subprotocols are tokens)
)


def header(scope: dict[str, Any], name: bytes) -> str | None:
    """The first value of header `name` (lower-case bytes), or None when absent."""
    for key, value in scope.get("headers") or []:
        if key == name:
            return value.decode("latin-1")
    return None


def split_host(value: str) -> tuple[str, int | None]:
    """'Example.com:8000' -> ('example.com', 8000); '[::1]:80' -> ('::1', 80); no port -> None.
    A malformed port gives port -1, which never matches anything."""
    value = value.strip().lower()
    if value.startswith("["):  # an IPv6 literal
        end = value.find("]")
        if end == -1:
            return value, None
        host, rest = value[1:end], value[end + 1 :]
    elif value.count(":") == 1:
        host, _, port = value.partition(":")
        rest = ":" + port
    else:  # a plain name, or a bare IPv6 address (several colons, no port)
        host, rest = value, ""
    if not rest:
        return host, None
    port = rest[1:]
    return host, int(port) if rest[0] == ":" and port.isdigit() else -1


def host_allowed(scope: dict[str, Any], allowed: frozenset[str] | None) -> bool:
    """Whether the request's Host, minus its port, is in `allowed` (None: no check).
    A request without a Host header is refused while the check is on."""
    if allowed is None:
        return True
    value = header(scope, b"host")
    return value is not None and split_host(value)[0] in allowed


def normalize_hosts(hosts: Collection[str] | None) -> frozenset[str] | None:
    """Allowed host names compared like Host headers are ('[::1]' == '::1'); None or '*': any."""
    if hosts is None or "*" in hosts:
        return None
    return frozenset(split_host(h)[0] for h in hosts)


def origin_key(origin: str) -> tuple[str, str, int] | None:
    """'http://LocalHost:3000' -> ('http', 'localhost', 3000), default ports filled in; None
    for anything that is not a plain scheme://host[:port] (e.g. the 'null' origin)."""
    try:
        parts = urlsplit(origin.strip())
        port = parts.port
    except ValueError:
        return None
    if parts.scheme not in DEFAULT_PORTS or not parts.hostname or parts.path not in ("", "/"):
        return None
    if parts.query or parts.fragment or parts.username is not None:
        return None
    return parts.scheme, parts.hostname, port if port is not None else DEFAULT_PORTS[parts.scheme]


class OriginPolicy:
    """Which `Origin` a WebSocket handshake may carry: none at all (not a browser), the
    server's own (scheme, host and port of the request's Host), or one listed ('*': any)."""

    def __init__(self, allowed: Collection[str] = ()) -> None:
        self.any = "*" in allowed
        keys = {o: origin_key(o) for o in allowed if o != "*"}
        bad = [o for o, k in keys.items() if k is None]
        if bad:
            raise ValueError(f"allowed origins must look like 'http://host:port', got {bad}")
        self.keys = frozenset(keys.values())

    def allows(self, scope: dict[str, Any]) -> bool:
        origin = header(scope, b"origin")
        if origin is None or self.any:
            return True
        key = origin_key(origin)
        return key is not None and (key in self.keys or key == _own_origin(scope))


def _own_origin(scope: dict[str, Any]) -> tuple[str, str, int] | None:
    host = header(scope, b"host")
    if host is None:
        return None
    scheme = "https" if scope.get("scheme") in ("https", "wss") else "http"
    name, port = split_host(host)
    return scheme, name, port if port is not None else DEFAULT_PORTS[scheme]


def websocket_key(scope: dict[str, Any]) -> str | None:
    """The API key a browser offered as the subprotocol `minivllm.bearer.<base64url(key)>`
    beside `minivllm` (it cannot set `Authorization` on a WebSocket); None when absent or malformed."""
    for offered in scope.get("subprotocols") or []:
        if offered.startswith(WS_KEY_PREFIX):
            encoded = offered[len(WS_KEY_PREFIX) :]
            try:
                raw = base64.b64decode(
                    encoded + "=" * (-len(encoded) % 4), altchars=b"-_", validate=True
                )
                return raw.decode("utf-8")
            except (binascii.Error, UnicodeDecodeError):
                return None
    return None


def is_json(content_type: str | None) -> bool:
    """`application/json`, parameters such as `; charset=utf-8` allowed, any case."""
    return (
        content_type is not None
        and content_type.split(";", 1)[0].strip().lower() == "application/json"
    )


def api_key_list(keys: str | Collection[str] | None) -> tuple[str, ...]:
    """The accepted API keys: None or '' -> none (no key required); 'a,b' or ['a', 'b'] -> both."""
    if keys is None:
        return ()
    items = keys.split(",") if isinstance(keys, str) else list(keys)
    return tuple(dict.fromkeys(k.strip() for k in items if k.strip()))


def matching_key(offered: str, keys: Collection[str]) -> str | None:
    """The key among `keys` equal to `offered`, or None. Every key is compared, in constant time,
    so the time taken does not tell which key (or how much of one) was matched."""
    found = None
    for key in keys:
        if hmac.compare_digest(offered.encode(), key.encode()):
            found = key
    return found


def key_cache_salt(key: str) -> str:
    """The prefix-cache salt of requests made with `key`: a digest, so the key itself is never
    kept beside the cache."""
    return "api-key:" + hashlib.sha256(key.encode()).hexdigest()[:32]


def request_cache_salt(scope: dict[str, Any], requested: str | None) -> str | None:
    """The salt a request runs under: its own `cache_salt`, within its API key's salt when the
    gate set one (several keys configured), so two keys never share pages even with equal salts."""
    key_salt = scope.get(SCOPE_KEY_SALT)
    if key_salt is None:
        return requested
    if requested is None:
        return key_salt
    return (
        key_salt + ":" + hashlib.sha256(requested.encode("utf-8", "surrogatepass")).hexdigest()[:32]
    )
