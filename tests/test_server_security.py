"""The server against a web page in the user's browser (the attacker when it binds loopback
without an API key): WebSocket Origin, JSON-only POSTs and no CORS, the Host check against DNS
rebinding, and bounded metric labels and stop strings. In-process, with the fake engine of
tests/test_server_units.py, so no model is needed."""

from __future__ import annotations

import asyncio
import base64
import json
import re
from pathlib import Path

import pytest
from starlette.testclient import TestClient, WebSocketDenialResponse

from server.app import create_app
from server.cli import allowed_hosts_for, build_parser
from server.middleware import GateMiddleware
from server.protocol import (
    MAX_N,
    MAX_STOP_CHARS,
    MAX_STOP_TOKEN_IDS,
    MAX_STOPS,
    APIError,
    CompletionRequest,
    parse_request,
)
from server.security import (
    WS_KEY_PREFIX,
    WS_SUBPROTOCOL,
    OriginPolicy,
    host_allowed,
    is_json,
    split_host,
    websocket_key,
)
from server.state import ServerState
from tests.test_server_units import _app_client, expected_text, fake_llm, run

ROOT = Path(__file__).resolve().parents[1]
LOOPBACK_HOSTS = allowed_hosts_for("127.0.0.1", None)
ERROR_KEYS = {"message", "type", "param", "code"}
C = "/v1/completions"
GOOD = {"prompt": "ab", "max_tokens": 3, "temperature": 0}


def _scope(kind: str = "websocket", **headers: str) -> dict:
    return {
        "type": kind,
        "scheme": "ws" if kind == "websocket" else "http",
        "path": "/v1/stream",
        "headers": [(k.encode(), v.encode()) for k, v in headers.items()],
    }


def _stream_once(ws) -> dict:
    ws.send_json({"prompt": "ab", "max_tokens": 2, "temperature": 0})
    text = ""
    while (msg := ws.receive_json())["type"] == "token":
        text += msg["text"]
    assert msg["type"] == "done" and text == expected_text("ab", 2)
    return msg


# ---------------------------------------------------------------------- 10. WebSocket Origin


@pytest.mark.parametrize(
    "origin", ["http://evil.example", "null", "http://testserver:8080", "https://testserver"]
)
def test_ws_cross_origin_handshake_gets_403_json(origin):
    with TestClient(create_app(fake_llm(), model_name="fake")) as client:
        with pytest.raises(WebSocketDenialResponse) as e:
            with client.websocket_connect("/v1/stream", headers={"origin": origin}):
                pass
        assert e.value.status_code == 403 and e.value.headers["content-type"] == "application/json"
        err = e.value.json()["error"]
        assert set(err) == ERROR_KEYS and err["code"] == "origin_not_allowed"
        assert 'method="WS",route="/v1/stream",status="403"' in client.get("/metrics").text


def test_ws_accepts_no_origin_same_origin_and_listed_origins():
    app = create_app(fake_llm(), model_name="fake", allowed_origins=["http://localhost:3000"])
    with TestClient(app) as client:
        with client.websocket_connect("/v1/stream") as ws:  # not a browser: no Origin
            _stream_once(ws)
        with client.websocket_connect(
            "/v1/stream", headers={"origin": "http://testserver"}
        ) as ws:  # our own page
            _stream_once(ws)
        own = {"origin": "http://LOCALHOST:8000"}  # the same origin, spelled differently
        with client.websocket_connect("ws://localhost:8000/v1/stream", headers=own) as ws:
            _stream_once(ws)
        with client.websocket_connect(
            "/v1/stream", headers={"origin": "http://localhost:3000"}
        ) as ws:  # listed
            _stream_once(ws)
        with pytest.raises(WebSocketDenialResponse):
            with client.websocket_connect(
                "/v1/stream", headers={"origin": "http://localhost:3001"}
            ):
                pass


def test_ws_any_origin_with_star():
    with TestClient(create_app(fake_llm(), model_name="fake", allowed_origins=["*"])) as client:
        with client.websocket_connect(
            "/v1/stream", headers={"origin": "http://evil.example"}
        ) as ws:
            _stream_once(ws)


def test_origin_policy_compares_scheme_host_and_port():
    own = OriginPolicy()
    assert own.allows(_scope(host="127.0.0.1:8000", origin="http://127.0.0.1:8000"))
    assert own.allows(_scope(host="[::1]:8000", origin="http://[::1]:8000"))
    assert own.allows(_scope(host="example.com", origin="http://example.com:80"))  # default port
    assert not own.allows(_scope(host="127.0.0.1:8000", origin="http://127.0.0.1:9000"))
    assert not own.allows(_scope(host="127.0.0.1:8000", origin="https://127.0.0.1:8000"))
    assert not own.allows(
        _scope(origin="http://127.0.0.1:8000")
    )  # no Host: nothing to be the same as
    assert OriginPolicy(["http://localhost:3000/"]).allows(
        _scope(host="x", origin="http://localhost:3000")
    )
    with pytest.raises(ValueError, match="allowed origins"):
        OriginPolicy(["localhost:3000"])


def test_ws_refusal_closes_with_1008_when_the_server_has_no_http_response_extension():
    async def app(scope, receive, send):
        raise AssertionError("a refused handshake must not reach the app")

    sent = []

    async def receive():
        return {"type": "websocket.connect"}

    async def send(message):
        sent.append(message)

    gate = GateMiddleware(app, ServerState("fake", api_key=None, max_queue=1, max_body_bytes=1))
    asyncio.run(gate(_scope(host="testserver", origin="http://evil.example"), receive, send))
    assert sent == [{"type": "websocket.close", "code": 1008}]


# ---------------------------------------------------------------------- 11. JSON-only POSTs, no CORS


@pytest.mark.parametrize("path", [C, "/v1/chat/completions"])
@pytest.mark.parametrize(
    "content_type",
    [
        None,
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "application/jsonp",
        "",
    ],
)
def test_post_without_json_content_type_gets_415(path, content_type):
    app = create_app(fake_llm(), model_name="fake")
    body = json.dumps(
        GOOD if path == C else {"messages": [{"role": "user", "content": "q"}]}
    ).encode()
    headers = {} if content_type is None else {"content-type": content_type}

    async def main():
        async with app.router.lifespan_context(app), await _app_client(app) as client:
            r = await client.post(path, content=body, headers=headers)
            assert r.status_code == 415, r.text
            err = r.json()["error"]
            assert set(err) == ERROR_KEYS and err["code"] == "unsupported_media_type"
            assert "application/json" in err["message"]

    run(main())


@pytest.mark.parametrize(
    "content_type",
    ["application/json", "application/json; charset=utf-8", "Application/JSON;charset=UTF-8"],
)
def test_json_content_type_with_parameters_is_accepted(content_type):
    app = create_app(fake_llm(), model_name="fake")

    async def main():
        async with app.router.lifespan_context(app), await _app_client(app) as client:
            r = await client.post(
                C, content=json.dumps(GOOD).encode(), headers={"content-type": content_type}
            )
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected_text("ab", 3)

    run(main())


def test_is_json():
    assert is_json("application/json") and is_json(" APPLICATION/json ; charset=utf-8")
    assert not is_json(None) and not is_json("text/plain") and not is_json("application/json-seq")


def test_no_cors_headers_for_cross_origin_requests():
    app = create_app(fake_llm(), model_name="fake", allowed_origins=["http://localhost:3000"])
    preflight = {
        "origin": "http://evil.example",
        "access-control-request-method": "POST",
        "access-control-request-headers": "content-type",
    }

    async def main():
        async with app.router.lifespan_context(app), await _app_client(app) as client:
            for origin in (
                "http://evil.example",
                "http://localhost:3000",
            ):  # the WS allow-list grants no CORS
                r = await client.options(C, headers={**preflight, "origin": origin})
                assert not any(k.startswith("access-control-") for k in r.headers), r.headers
                r = await client.get("/v1/models", headers={"origin": origin})
                assert r.status_code == 200 and "access-control-allow-origin" not in r.headers

    run(main())


# ---------------------------------------------------------------------- 12. Host check (DNS rebinding)


@pytest.mark.parametrize(
    "host, ok",
    [
        ("127.0.0.1:8000", True),
        ("localhost:8000", True),
        ("LOCALHOST", True),
        ("[::1]:8000", True),
        ("[::1]", True),
        ("evil.example", False),
        ("evil.example:8000", False),
        ("localhost.evil.example", False),
        ("127.0.0.1.nip.io", False),
    ],
)
def test_host_check_answers_421_to_other_hosts(host, ok):
    app = create_app(fake_llm(), model_name="fake", allowed_hosts=LOOPBACK_HOSTS)

    async def main():
        async with app.router.lifespan_context(app), await _app_client(app) as client:
            for method, path, kw in (
                ("GET", "/health", {}),
                ("GET", "/v1/models", {}),
                ("POST", C, {"json": GOOD}),
            ):
                r = await client.request(method, path, headers={"host": host}, **kw)
                if ok:
                    assert r.status_code == 200, (path, r.text)
                else:
                    assert r.status_code == 421, (path, r.text)
                    err = r.json()["error"]
                    assert set(err) == ERROR_KEYS and err["code"] == "invalid_host"

    run(main())


def test_host_check_covers_websockets_and_is_off_by_default_in_create_app():
    with TestClient(
        create_app(fake_llm(), model_name="fake", allowed_hosts=LOOPBACK_HOSTS)
    ) as client:
        with pytest.raises(WebSocketDenialResponse) as e:
            with client.websocket_connect("/v1/stream", headers={"host": "evil.example:8000"}):
                pass
        assert e.value.status_code == 421 and e.value.json()["error"]["code"] == "invalid_host"
        with client.websocket_connect("ws://127.0.0.1:8000/v1/stream") as ws:
            _stream_once(ws)
    with TestClient(
        create_app(fake_llm(), model_name="fake")
    ) as client:  # allowed_hosts=None: no check
        assert client.get("/health", headers={"host": "evil.example"}).status_code == 200


def test_host_allowed_and_split_host():
    assert split_host("Example.COM:8000") == ("example.com", 8000)
    assert split_host("[::1]:80") == ("::1", 80) and split_host("::1") == ("::1", None)
    assert split_host("localhost:x") == ("localhost", -1)
    assert not host_allowed(
        _scope("http"), frozenset({"localhost"})
    )  # no Host header while checking
    assert host_allowed(_scope("http"), None)


def test_cli_default_allowed_hosts_follow_the_bind_address():
    args = build_parser().parse_args([])
    assert args.host == "127.0.0.1" and args.allowed_hosts is None and args.allowed_origins == []
    assert set(allowed_hosts_for(args.host, args.allowed_hosts)) == {
        "localhost",
        "127.0.0.1",
        "::1",
    }
    assert set(allowed_hosts_for("localhost", None)) == {"localhost", "127.0.0.1", "::1"}
    assert "127.0.0.2" in allowed_hosts_for("127.0.0.2", None)
    assert (
        allowed_hosts_for("0.0.0.0", None) is None
        and allowed_hosts_for("192.168.1.5", None) is None
    )
    args = build_parser().parse_args(["--host", "0.0.0.0", "--allowed-hosts", "llm.lan, 10.0.0.2"])
    assert allowed_hosts_for(args.host, args.allowed_hosts) == ["llm.lan", "10.0.0.2"]
    args = build_parser().parse_args(
        ["--allowed-hosts", "*", "--allowed-origins", "http://localhost:3000,*"]
    )
    assert allowed_hosts_for(args.host, args.allowed_hosts) is None
    assert args.allowed_origins == ["http://localhost:3000", "*"]


def test_cli_rejects_malformed_allowed_origins_and_empty_lists(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--allowed-origins", "localhost:3000"])
    assert "http://host:port" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--allowed-hosts", " , "])
    assert "comma-separated" in capsys.readouterr().err


# ---------------------------------------------------------------------- 13. bounded labels and stop strings


def test_unknown_http_methods_share_one_metric_label():
    app = create_app(fake_llm(), model_name="fake")

    async def main():
        async with app.router.lifespan_context(app), await _app_client(app) as client:
            for method in ("FOO", "PROPFIND", "X" * 200):
                assert (await client.request(method, "/health")).status_code == 405
            return (await client.get("/metrics")).text

    text = run(main())
    methods = set(re.findall(r'minivllm_http_requests_total\{method="([^"]*)"', text))
    assert methods == {"other"}, methods  # the GET /metrics itself is counted after it answers
    assert 'minivllm_http_requests_total{method="other",route="/health",status="405"} 3' in text


def test_stop_strings_are_bounded():
    def param(stop):
        with pytest.raises(APIError) as e:
            parse_request(CompletionRequest, {"prompt": "x", "stop": stop})
        return e.value.status, e.value.param

    assert param(["s"] * (MAX_STOPS + 1)) == (400, "stop")
    assert param("s" * (MAX_STOP_CHARS + 1)) == (400, "stop")
    assert param(["ok", "s" * (MAX_STOP_CHARS + 1)]) == (400, "stop")
    at_limit = parse_request(
        CompletionRequest, {"prompt": "x", "stop": ["s" * MAX_STOP_CHARS] * MAX_STOPS}
    )
    assert at_limit.sampling_params().stop == ["s" * MAX_STOP_CHARS] * MAX_STOPS
    # A single string is limited by its characters, not by the list-length limit.
    assert parse_request(CompletionRequest, {"prompt": "x", "stop": "s" * (MAX_STOPS + 1)}).stop


def test_too_long_stop_over_http_is_a_400_naming_stop():
    app = create_app(fake_llm(), model_name="fake")

    async def main():
        async with app.router.lifespan_context(app), await _app_client(app) as client:
            r = await client.post(C, json={**GOOD, "stop": "s" * (MAX_STOP_CHARS + 1)})
            assert r.status_code == 400 and r.json()["error"]["param"] == "stop"

    run(main())


def test_readme_limits_match_the_code():
    from minivllm_jax.args import DEFAULT_MAX_MODEL_LEN
    from minivllm_jax.sampling_params import MAX_LOGPROBS
    from server.ws import MAX_PENDING

    readme = (ROOT / "server" / "README.md").read_text()
    limits = readme.split("## Limits", 1)[1].split("\n## ", 1)[0]
    defaults = build_parser().parse_args([])
    for value in (
        MAX_N,
        MAX_STOPS,
        MAX_STOP_CHARS,
        MAX_STOP_TOKEN_IDS,
        MAX_LOGPROBS,
        MAX_PENDING,
        defaults.max_queue,
        defaults.max_body_bytes,
        defaults.max_model_len
        or DEFAULT_MAX_MODEL_LEN,  # None: the engine's default, capped by the model
    ):
        assert re.search(rf"\b{value:,}\b|\b{value}\b", limits), value


# ---------------------------------------------------------------------- 14. the API key on a browser's WebSocket


def _key_protocol(key: str) -> str:
    return WS_KEY_PREFIX + base64.urlsafe_b64encode(key.encode()).decode().rstrip("=")


def test_ws_takes_the_api_key_as_a_subprotocol_and_answers_minivllm():
    key = "k+/é=?"  # characters that are no subprotocol token: base64url carries them
    with TestClient(create_app(fake_llm(), model_name="fake", api_key=key)) as client:
        with client.websocket_connect(
            "/v1/stream", subprotocols=[WS_SUBPROTOCOL, _key_protocol(key)]
        ) as ws:
            assert ws.accepted_subprotocol == WS_SUBPROTOCOL  # echoed, never the key
            _stream_once(ws)
        wrong = ["wrong", key + "x", ""]
        offers = [[WS_SUBPROTOCOL, _key_protocol(w)] for w in wrong] + [
            [WS_SUBPROTOCOL, WS_KEY_PREFIX + "%%"]
        ]
        for offer in [*offers, [WS_SUBPROTOCOL]]:
            with pytest.raises(WebSocketDenialResponse) as e:
                with client.websocket_connect("/v1/stream", subprotocols=offer):
                    pass
            assert (
                e.value.status_code == 401 and e.value.json()["error"]["code"] == "invalid_api_key"
            ), offer
        # Only a WebSocket may carry the key that way; an HTTP request still needs Authorization.
        assert (
            client.get(
                "/v1/models", headers={"sec-websocket-protocol": _key_protocol(key)}
            ).status_code
            == 401
        )


def test_ws_subprotocol_is_echoed_only_when_offered():
    with TestClient(create_app(fake_llm(), model_name="fake")) as client:
        with client.websocket_connect("/v1/stream") as ws:
            assert ws.accepted_subprotocol is None
            _stream_once(ws)
        with client.websocket_connect("/v1/stream", subprotocols=[WS_SUBPROTOCOL]) as ws:
            assert ws.accepted_subprotocol == WS_SUBPROTOCOL


def test_websocket_key_decodes_base64url_and_refuses_garbage():
    def scope(*offered: str) -> dict:
        return {**_scope(), "subprotocols": list(offered)}

    assert websocket_key(scope(WS_SUBPROTOCOL, _key_protocol("sk-1"))) == "sk-1"
    assert websocket_key(scope(WS_SUBPROTOCOL)) is None
    assert websocket_key(scope(WS_KEY_PREFIX + "!!")) is None  # not base64
    assert (
        websocket_key(scope(WS_KEY_PREFIX + base64.urlsafe_b64encode(b"\xff\xfe").decode())) is None
    )  # not UTF-8
