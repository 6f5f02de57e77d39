"""`GET /`: the chat page, `server/static/chat.html` (one file, inline CSS and JS, no build
step), served with a Content-Security-Policy that runs only the page's own inline blocks and
lets it connect only to this server.

The page holds no secret (an API key is typed into it and sent on the WebSocket), so `/` needs
no key; the Host check still applies to it like to every route.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import re
from importlib import resources

from fastapi.responses import Response

PAGE = ("static", "chat.html")


def inline_hashes(html: str, tag: str) -> list[str]:
    """CSP sources (`'sha256-...'`) for the contents of every inline `<tag>` block, so the
    policy can allow exactly these instead of `'unsafe-inline'` (which would also run injected markup)."""
    blocks = re.findall(rf"<{tag}>(.*?)</{tag}>", html, flags=re.DOTALL)
    return [
        f"'sha256-{base64.b64encode(hashlib.sha256(b.encode()).digest()).decode()}'" for b in blocks
    ]


def content_security_policy(html: str) -> str:
    """Nothing from anywhere by default; the page's inline script and style by hash; fetches and
    the WebSocket to this origin only (in CSP Level 3, `'self'` also matches ws:// and wss://
    on the page's own host and port)."""
    return "; ".join(
        [
            "default-src 'none'",
            "script-src " + " ".join(inline_hashes(html, "script")),
            "style-src " + " ".join(inline_hashes(html, "style")),
            "connect-src 'self'",
            "base-uri 'none'",
            "form-action 'none'",
            "frame-ancestors 'none'",
        ]
    )


@functools.lru_cache(maxsize=1)
def _page() -> tuple[bytes, dict[str, str]]:
    html = resources.files("server").joinpath(*PAGE).read_text("utf-8")
    headers = {
        "Content-Security-Policy": content_security_policy(html),
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
        "Cache-Control": "no-cache",
    }
    return html.encode("utf-8"), headers


def chat_page() -> Response:
    body, headers = _page()
    return Response(body, media_type="text/html; charset=utf-8", headers=headers)
