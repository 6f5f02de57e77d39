"""Connections cannot starve others: slow readers, idle and surplus WebSockets, slow bodies,
a hung engine step, an engine that is down for good, and a graceful shutdown that drains
WebSockets. Each test runs the real app under a real uvicorn on a loopback port, with the
hand-computable `FakeEngine` of test_server_units (no JAX, no model)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
import uvicorn

import server.app
from server.app import create_app
from server.cli import engine_failure
from server.connections import (
    ConnectionLimits,
    DrainingServer,
    HeaderDeadlineProtocol,
    default_limit_concurrency,
)
from tests.test_server_units import FakeEngine, FakeTokenizer

DEADLINE_S = 10.0  # generous bound for things that happen within a fraction of a second
WIDE = 1 << 20  # characters of text per wide token
WIDE_TOKENS = (
    12  # a stream's first tokens are wide: 12 MB, more than loopback socket buffers hold (4 MB)
)


class WideEngine(FakeEngine):
    """FakeEngine whose first `WIDE_TOKENS` tokens are `WIDE` characters of text each, so a client
    that does not read fills the kernel's socket buffers (and the server's) within a few steps."""

    def step(self):
        return [
            dataclasses.replace(
                out, outputs=[dataclasses.replace(c, text=_widen(c.text)) for c in out.outputs]
            )
            for out in super().step()
        ]


def _widen(text: str) -> str:
    return "".join(ch * WIDE if i < WIDE_TOKENS else ch for i, ch in enumerate(text))


class GatedEngine(FakeEngine):
    """FakeEngine whose step waits while `gate` is clear (a hung device, or a test holding the
    engine at a known point)."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.gate = threading.Event()
        self.gate.set()
        self.in_step = threading.Event()  # set while a step is waiting at the gate

    def step(self):
        if not self.gate.is_set():
            self.in_step.set()
            self.gate.wait()
            self.in_step.clear()
        return super().step()


def _llm(engine: FakeEngine):
    from types import SimpleNamespace

    return SimpleNamespace(engine=engine, tokenizer=FakeTokenizer())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _until(predicate: Callable[[], object], what: str, timeout: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@contextlib.contextmanager
def serving(
    engine: FakeEngine, *, max_queue: int = 8, limits: ConnectionLimits | None = None, **config
) -> Iterator[tuple[DrainingServer, str]]:
    """The app around `engine` under `DrainingServer` (what the CLI runs) on a free port."""
    app = create_app(_llm(engine), model_name="fake", max_queue=max_queue, limits=limits)
    port = _free_port()
    cfg = uvicorn.Config(
        app, host="127.0.0.1", port=port, log_level="warning", lifespan="on", **config
    )
    srv = DrainingServer(
        cfg, drain=app.state.sockets.drain, engine_error=lambda: engine_failure(app.state.minivllm)
    )
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    try:
        _until(lambda: srv.started, "uvicorn to start")
        yield srv, f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(DEADLINE_S)
        assert not thread.is_alive(), "the server did not stop"


def _raw_request(
    port: int, method: str, path: str, body: bytes, rcvbuf: int | None = None
) -> socket.socket:
    """Send one HTTP/1.1 request on a raw socket (small receive buffer if asked) and return it unread."""
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(
            socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf
        )  # before connect: it sets the window
    sock.connect(("127.0.0.1", port))
    head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    sock.sendall(head.encode() + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    return sock


def _read_to_end(sock: socket.socket) -> bytes:
    """Everything until the server closes (EOF or reset), within the deadline."""
    sock.settimeout(DEADLINE_S)
    chunks = []
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(1 << 20):
            chunks.append(chunk)
    return b"".join(chunks)


def _never_reading_stream(port: int, max_tokens: int) -> socket.socket:
    body = json.dumps({"prompt": "x", "max_tokens": max_tokens, "stream": True}).encode()
    return _raw_request(port, "POST", "/v1/completions", body, rcvbuf=4096)


def _post(url: str, max_tokens: int = 2) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/completions", json={"prompt": "x", "max_tokens": max_tokens}, timeout=DEADLINE_S
    )


# ---------------------------------------------------------------------- slow readers


def test_finished_requests_of_clients_that_never_read_hold_no_queue_slot():
    """Two SSE clients that never read, on a server that admits two requests: once the engine
    has finished both, a third request is served (it was a 429 while their handlers, blocked on
    full socket buffers, had not read the final output)."""
    engine = WideEngine(max_model_len=512, pages=8, step_seconds=0.001)
    with serving(
        engine, max_queue=2, limits=ConnectionLimits(send_timeout_s=60, max_websockets=2)
    ) as (srv, url):
        port = srv.config.port
        readers = [_never_reading_stream(port, WIDE_TOKENS) for _ in range(2)]
        try:
            _until(
                lambda: engine.steps >= WIDE_TOKENS and not engine.requests,
                "the engine to finish both streams",
            )
            state = srv.config.app.state.minivllm
            _until(
                lambda: state.engine.num_in_flight == 0, "the finished requests to leave the queue"
            )
            assert engine.page_manager.num_free_pages == 8
            r = _post(url)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["finish_reason"] == "length"
        finally:
            for s in readers:
                s.close()


def test_sse_client_that_stops_reading_is_aborted_and_dropped_after_the_send_timeout():
    engine = WideEngine(
        max_model_len=4096, pages=8, step_seconds=0.005
    )  # 4000 tokens: 20 s if left to finish
    limits = ConnectionLimits(send_timeout_s=0.5, max_websockets=2)
    with serving(engine, max_queue=2, limits=limits) as (srv, url):
        state = srv.config.app.state.minivllm
        reader = _never_reading_stream(srv.config.port, 4000)
        try:
            _until(
                lambda: state.metrics.finished["abort"] == 1,
                "the send timeout to abort the request",
            )
            _until(
                lambda: not engine.requests and engine.page_manager.num_free_pages == 8,
                "the pages to be freed",
            )
            assert engine.steps < 4000  # aborted, not finished
            _until(
                lambda: len(srv.server_state.connections) == 0, "the server to drop the connection"
            )
            received = _read_to_end(reader)  # what the kernel had buffered, then EOF or reset
            assert received.startswith(b"HTTP/1.1 200") and b"[DONE]" not in received
            assert (
                'minivllm_slow_readers_dropped_total{transport="sse"} 1' in state.render_metrics()
            )
        finally:
            reader.close()
        assert _post(url).status_code == 200  # the server serves on


def _ws_handshake(port: int, rcvbuf: int | None = None) -> socket.socket:
    """A raw WebSocket client (no library reading behind the test's back)."""
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", port))
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall(
        (
            f"GET /v1/stream HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
        ).encode()
    )
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(1)
    assert head.startswith(b"HTTP/1.1 101"), head
    return sock


def _ws_send_text(sock: socket.socket, text: str) -> None:
    payload, mask = text.encode(), os.urandom(4)
    assert len(payload) < 126
    sock.sendall(
        bytes([0x81, 0x80 | len(payload)])
        + mask
        + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    )


def test_websocket_client_that_stops_reading_is_aborted_and_dropped_after_the_send_timeout():
    engine = WideEngine(max_model_len=4096, pages=8, step_seconds=0.005)
    limits = ConnectionLimits(send_timeout_s=0.5, max_websockets=2)
    with serving(engine, max_queue=2, limits=limits) as (srv, url):
        state = srv.config.app.state.minivllm
        sock = _ws_handshake(srv.config.port, rcvbuf=4096)
        try:
            _ws_send_text(sock, json.dumps({"prompt": "x", "max_tokens": 4000}))
            _until(
                lambda: state.metrics.finished["abort"] == 1,
                "the send timeout to abort the request",
            )
            _until(
                lambda: not engine.requests and engine.page_manager.num_free_pages == 8,
                "the pages to be freed",
            )
            assert engine.steps < 4000
            _until(
                lambda: len(srv.server_state.connections) == 0, "the server to drop the connection"
            )
            assert (
                'minivllm_slow_readers_dropped_total{transport="websocket"} 1'
                in state.render_metrics()
            )
        finally:
            sock.close()
        assert _post(url).status_code == 200


# ---------------------------------------------------------------------- connections


def test_websocket_cap_and_idle_timeout():
    import websockets.sync.client as ws_client
    from websockets.exceptions import ConnectionClosed

    engine = GatedEngine(step_seconds=0.001)
    limits = ConnectionLimits(max_websockets=1, ws_idle_timeout_s=0.5)
    with serving(engine, limits=limits) as (srv, url):
        uri = url.replace("http", "ws") + "/v1/stream"
        with ws_client.connect(uri) as first:
            engine.gate.clear()  # the first socket's request runs (so it is not idle) until the gate opens
            first.send(json.dumps({"prompt": "x", "max_tokens": 2}))
            _until(engine.in_step.is_set, "the request to start")
            with ws_client.connect(uri) as second, pytest.raises(ConnectionClosed) as refused:
                second.recv(DEADLINE_S)
            assert refused.value.rcvd.code == 1013
            engine.gate.set()
            while json.loads(first.recv(DEADLINE_S))["type"] != "done":
                pass
            with pytest.raises(
                ConnectionClosed
            ) as idle:  # no request for ws_idle_timeout_s: closed
                first.recv(DEADLINE_S)
            assert idle.value.rcvd.code == 1000 and "idle" in idle.value.rcvd.reason
        _until(
            lambda: srv.config.app.state.sockets.count == 0, "the idle socket to leave the count"
        )
        with ws_client.connect(uri) as again:  # the slot is free again
            again.send(json.dumps({"prompt": "x", "max_tokens": 1}))
            assert json.loads(again.recv(DEADLINE_S))["type"] == "token"


def test_a_body_that_does_not_arrive_in_time_is_a_408(monkeypatch):
    monkeypatch.setattr(server.app, "BODY_READ_TIMEOUT_S", 0.3)
    with serving(FakeEngine(step_seconds=0.001)) as (srv, url):
        sock = socket.create_connection(("127.0.0.1", srv.config.port))
        try:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b'Content-Length: 100\r\n\r\n{"prompt"'
            )
            reply = _read_to_end(sock)  # the server answers, then closes (the body is half read)
        finally:
            sock.close()
        assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
        assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"


def test_a_connection_trickling_its_headers_is_closed(monkeypatch):
    monkeypatch.setattr(HeaderDeadlineProtocol, "header_timeout_s", 0.3)
    with serving(FakeEngine(step_seconds=0.001), http=HeaderDeadlineProtocol) as (srv, url):
        slow = [socket.create_connection(("127.0.0.1", srv.config.port)) for _ in range(2)]
        try:
            slow[0].sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # never finished
            assert _read_to_end(slow[0]) == b""  # closed without an answer
            assert _read_to_end(slow[1]) == b""  # nothing sent at all: closed too
        finally:
            for sock in slow:
                sock.close()
        assert httpx.get(f"{url}/health").status_code == 200  # a request that is not slow is served


def test_a_finished_response_nobody_reads_does_not_hold_its_connection(monkeypatch):
    """A non-streaming answer larger than the socket buffers, never read: once the response is
    complete, the connection lasts at most the header deadline (uvicorn's own close would wait
    for the client to read it, for ever)."""
    monkeypatch.setattr(HeaderDeadlineProtocol, "header_timeout_s", 0.3)
    engine = WideEngine(max_model_len=64, step_seconds=0.001)
    with serving(engine, http=HeaderDeadlineProtocol) as (srv, url):
        body = json.dumps({"prompt": "x", "max_tokens": WIDE_TOKENS}).encode()
        reader = _raw_request(srv.config.port, "POST", "/v1/completions", body, rcvbuf=4096)
        try:
            state = srv.config.app.state.minivllm
            _until(lambda: state.metrics.finished["length"] == 1, "the request to finish")
            _until(
                lambda: len(srv.server_state.connections) == 0, "the server to drop the connection"
            )
        finally:
            reader.close()
        assert _post(url).status_code == 200


def test_health_is_503_while_a_step_hangs_and_200_again_after():
    engine = GatedEngine(step_seconds=0.001)
    limits = ConnectionLimits(hung_step_timeout_s=0.3, max_websockets=2)
    with serving(engine, limits=limits) as (srv, url):
        assert httpx.get(f"{url}/health").status_code == 200
        engine.gate.clear()
        result: dict = {}
        waiter = threading.Thread(target=lambda: result.update(r=_post(url, 3)))
        waiter.start()
        try:
            _until(engine.in_step.is_set, "the step to hang")
            _until(
                lambda: httpx.get(f"{url}/health").status_code == 503,
                "/health to report the hung step",
            )
            health = httpx.get(f"{url}/health").json()
            assert health["status"] == "stalled" and "no step progress" in health["error"]
        finally:
            engine.gate.set()
        waiter.join(DEADLINE_S)
        assert result["r"].status_code == 200
        _until(lambda: httpx.get(f"{url}/health").status_code == 200, "/health to recover")


def test_the_server_exits_once_the_engine_loop_is_down_for_good():
    engine = FakeEngine(step_seconds=0.001)
    app = create_app(_llm(engine), model_name="fake", max_queue=4)
    state = app.state.minivllm
    cfg = uvicorn.Config(
        app, host="127.0.0.1", port=_free_port(), log_level="critical", lifespan="on"
    )
    srv = DrainingServer(
        cfg, drain=app.state.sockets.drain, engine_error=lambda: engine_failure(state)
    )
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    _until(lambda: srv.started, "uvicorn to start")
    assert engine_failure(state) is None
    engine.crash = True  # every step raises: the loop restarts until its budget is spent
    for _ in range(state.engine.max_restarts + 1):
        with contextlib.suppress(httpx.TransportError):
            _post(f"http://127.0.0.1:{cfg.port}")
        if not state.engine.alive:
            break
    thread.join(DEADLINE_S)
    assert not thread.is_alive(), "the server kept running with a dead engine"
    assert (
        srv.engine_failure is not None and "device on fire" in srv.engine_failure
    )  # the CLI exits 1 on it


def test_connection_flags_and_their_defaults():
    from server.cli import build_parser

    args = build_parser().parse_args([])
    assert (args.send_timeout, args.ws_idle_timeout, args.hung_step_timeout) == (30.0, 300.0, 120.0)
    assert args.max_websockets is None and args.limit_concurrency is None  # sized from --max-queue
    assert default_limit_concurrency(256, 256) == 256 + 256 + 64
    for flag, value in [
        ("--send-timeout", "0"),
        ("--hung-step-timeout", "nan"),
        ("--max-websockets", "0"),
    ]:
        with pytest.raises(SystemExit):
            build_parser().parse_args([flag, value])
    with pytest.raises(ValueError, match="send_timeout_s"):
        ConnectionLimits(send_timeout_s=0)


# ---------------------------------------------------------------------- graceful shutdown


def test_graceful_shutdown_lets_a_websocket_stream_finish_then_closes_it_with_1001():
    """The path SIGTERM takes (uvicorn sets should_exit): the running request ends with its
    `done`, a request sent meanwhile gets a 503 error message, then the socket closes with 1001."""
    engine = GatedEngine(step_seconds=0.001)
    with serving(engine, limits=ConnectionLimits(max_websockets=4)) as (srv, url):
        sockets = srv.config.app.state.sockets

        async def client() -> list:
            import websockets

            messages: list = []
            async with websockets.connect(url.replace("http", "ws") + "/v1/stream") as ws:
                await ws.send(json.dumps({"prompt": "x", "max_tokens": 20}))
                messages.append(json.loads(await ws.recv()))
                engine.gate.clear()  # hold the stream mid-way while the shutdown starts
                srv.should_exit = True
                while not sockets.draining.is_set():
                    await asyncio.sleep(0.02)
                await ws.send(json.dumps({"prompt": "y", "max_tokens": 2}))
                engine.gate.set()
                with contextlib.suppress(websockets.ConnectionClosed):
                    async for raw in ws:
                        messages.append(json.loads(raw))
                messages.append(("closed", ws.close_code))
            return messages

        messages = asyncio.run(asyncio.wait_for(client(), DEADLINE_S))
        done = [m for m in messages if isinstance(m, dict) and m["type"] == "done"]
        assert (
            len(done) == 1
            and done[0]["finish_reason"] == "length"
            and done[0]["usage"]["completion_tokens"] == 20
        )
        text = "".join(m["text"] for m in messages if isinstance(m, dict) and m["type"] == "token")
        assert len(text) == 20
        errors = [m for m in messages if isinstance(m, dict) and m["type"] == "error"]
        assert (
            len(errors) == 1 and errors[0]["code"] == "shutting_down" and errors[0]["status"] == 503
        )
        assert messages[-1] == ("closed", 1001)
