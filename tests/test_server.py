"""The server as users see it: one real `python -m server` process on a free loopback port,
driven by real clients (the `openai` package, raw SSE over httpx, `websockets`, raw sockets).

The process is started once for the module; the last test stops it with SIGTERM.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.requires_smollm2  # skip locally, fail under CI=true (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m"
API_KEY = "test-key-7f3a"
MAX_QUEUE = 20
# The engine settings of tests/test_engine.py, so the persistent compile cache is shared.
ENGINE_ARGS = [
    "--max-num-seqs",
    "8",
    "--max-model-len",
    "256",
    "--max-num-batched-tokens",
    "128",
    "--num-pages",
    "96",
]
STARTUP_TIMEOUT_S = 300
PROMPT = "The capital of France is"
C, CHAT = "/v1/completions", "/v1/chat/completions"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@dataclasses.dataclass
class Server:
    url: str
    proc: subprocess.Popen
    log: Path
    statuses_while_starting: list[int]

    def metrics(self) -> dict[str, float]:
        """Unlabelled samples of /metrics by name (labelled ones keyed with their labels)."""
        text = httpx.get(f"{self.url}/metrics", headers=AUTH, timeout=10).text  # behind the API key
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                samples[name] = float(value)
        return samples

    def wait_metrics(self, predicate, timeout: float = 30.0) -> dict[str, float]:
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if predicate(m) or time.monotonic() > deadline:
                return m
            time.sleep(0.1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = _free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    env = {**os.environ, "MINIVLLM_API_KEY": API_KEY, "JAX_PLATFORMS": "cpu"}
    cmd = [
        sys.executable,
        "-m",
        "server",
        "--model",
        MODEL,
        "--port",
        str(port),
        "--max-queue",
        str(MAX_QUEUE),
        "--log-level",
        "warning",
        *ENGINE_ARGS,
    ]
    with open(log, "wb") as log_file:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    statuses: list[int] = []
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            assert proc.poll() is None, (
                f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
            )
            assert time.monotonic() < deadline, (
                f"not ready after {STARTUP_TIMEOUT_S}s:\n{log.read_text()[-3000:]}"
            )
            try:
                status = httpx.get(f"{url}/health", timeout=5).status_code
            except httpx.TransportError:
                status = 0  # not listening yet
            statuses.append(status)
            if status == 200:
                break
            time.sleep(0.25)
        yield Server(url, proc, log, statuses)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def post(server: Server, path: str, body, **kw) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=AUTH, timeout=120, **kw)


def sse_events(server: Server, path: str, body: dict) -> list:
    """Raw SSE: every event is one `data: ...` line followed by a blank line."""
    with httpx.stream("POST", f"{server.url}{path}", json=body, headers=AUTH, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    assert raw.endswith("\n\n")
    events = []
    for block in raw.split("\n\n")[:-1]:
        assert block.startswith("data: ") and "\n" not in block, block
        payload = block[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    return events[:-1]


# ---------------------------------------------------------------------- basics


def test_health_is_503_while_warming_up_then_200(server):
    assert 503 in server.statuses_while_starting, server.statuses_while_starting
    assert server.statuses_while_starting[-1] == 200
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok", "model": MODEL}


def test_models_lists_served_model(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_openai_completions_streaming_and_not(client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    choice = full.choices[0]
    assert full.object == "text_completion" and full.model == MODEL and full.id.startswith("cmpl-")
    assert choice.text and choice.finish_reason in ("length", "stop") and choice.index == 0
    assert (
        full.usage.prompt_tokens == 5
        and full.usage.total_tokens == 5 + full.usage.completion_tokens
    )
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    reasons = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert reasons == [choice.finish_reason]
    assert (
        chunks[-1].choices == []
        and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    )


def test_openai_chat_streaming_and_not(client):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a color."},
    ]
    full = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0
    )
    msg = full.choices[0].message
    assert full.object == "chat.completion" and msg.role == "assistant" and msg.content
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == msg.content
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_raw_sse_n2_seeded_choices(server):
    body = {
        "prompt": "Once upon a time",
        "max_tokens": 8,
        "temperature": 0.9,
        "seed": 3,
        "n": 2,
        "stream": True,
    }
    events = sse_events(server, "/v1/completions", body)
    texts, finished = {0: "", 1: ""}, {}
    for e in events:
        assert (
            set(e) >= {"id", "object", "created", "model", "choices"}
            and e["object"] == "text_completion"
        )
        (c,) = e["choices"]
        texts[c["index"]] += c["text"]
        if c["finish_reason"]:
            finished[c["index"]] = c["finish_reason"]
    assert finished == {0: "length", 1: "length"}
    again = post(
        server, "/v1/completions", {**body, "stream": False}
    ).json()  # same seed: same samples
    assert [c["text"] for c in again["choices"]] == [texts[0], texts[1]]


def test_logprobs_formats(server):
    out = post(
        server,
        "/v1/completions",
        {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 3},
    ).json()
    lp = out["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"])
    assert len(lp["tokens"]) == out["usage"]["completion_tokens"]
    assert "".join(lp["tokens"]) == out["choices"][0]["text"]
    assert lp["text_offset"][0] == 0 and all(len(t) == 3 for t in lp["top_logprobs"])
    assert all(
        lp["token_logprobs"][i] == max(t.values()) for i, t in enumerate(lp["top_logprobs"])
    )  # greedy
    chat = post(
        server,
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 4,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 2,
        },
    ).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == 4 and all(
        len(c["top_logprobs"]) == 2 and c["logprob"] <= 0 for c in content
    )
    assert (
        bytes(b for c in content for b in c["bytes"]).decode()
        == chat["choices"][0]["message"]["content"]
    )


# ---------------------------------------------------------------------- equality with the engine


def _ws_generate(server: Server, requests: list[dict]) -> list[dict]:
    """Send requests one after another over one socket; returns per request the text and done."""
    import websockets

    async def go():
        results = []
        uri = server.url.replace("http://", "ws://") + "/v1/stream"
        async with websockets.connect(uri, additional_headers=AUTH) as ws:
            for req in requests:
                await ws.send(json.dumps(req))
                text, msgs = "", []
                while True:
                    msg = json.loads(await asyncio.wait_for(ws.recv(), 60))
                    msgs.append(msg)
                    if msg["type"] == "token":
                        text += msg["text"]
                    if msg["type"] in ("done", "error"):
                        break
                results.append({"text": text, "last": msgs[-1], "messages": msgs})
        return results

    return asyncio.run(go())


def test_greedy_text_equals_llm_generate_over_http_sse_and_websocket(server):
    from minivllm_jax import LLM, SamplingParams

    prompts = [PROMPT, "def fibonacci(n):", "Q: What is 2 + 2?\nA:"]
    # Same engine settings as the server; no warm-up: only the few shapes used get compiled.
    llm = LLM(
        MODEL,
        max_num_seqs=8,
        max_model_len=256,
        max_num_batched_tokens=128,
        num_pages=96,
        warmup=False,
        use_tqdm=False,
    )
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    expected = [o.outputs[0].text for o in outs]
    body = {"max_tokens": 32, "temperature": 0}

    def http(p):
        return post(server, C, {**body, "prompt": p}).json()["choices"][0]["text"]

    def sse(p):
        return "".join(
            e["choices"][0]["text"]
            for e in sse_events(server, C, {**body, "prompt": p, "stream": True})
        )

    def ws():
        return [r["text"] for r in _ws_generate(server, [{**body, "prompt": p} for p in prompts])]

    # All at once, so the server batches them together (greedy is batch-invariant).
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(http, p) for p in prompts] + [pool.submit(sse, p) for p in prompts]
        ws_texts = pool.submit(ws)
        texts = [f.result() for f in futures]
    assert texts == expected * 2 and ws_texts.result() == expected

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat_expected = llm.chat(
        messages, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False
    )[0]
    chat = post(
        server, "/v1/chat/completions", {"messages": messages, "max_tokens": 24, "temperature": 0}
    ).json()
    assert chat["choices"][0]["message"]["content"] == chat_expected.outputs[0].text
    assert chat["usage"]["prompt_tokens"] == len(chat_expected.prompt_token_ids)


def test_websocket_sequence_errors_and_cancel(server):
    results = _ws_generate(
        server,
        [
            {"prompt": PROMPT, "max_tokens": 5, "temperature": 0},
            {
                "prompt": PROMPT,
                "max_tokens": 5,
                "temperature": "hot",
            },  # error; the socket stays open
            {
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 3,
                "temperature": 0,
                "logprobs": 1,
            },
            {"prompt": PROMPT, "model": "gpt-4"},
        ],
    )
    assert results[0]["last"]["type"] == "done" and results[0]["last"]["finish_reason"] == "length"
    assert results[0]["last"]["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 5,
        "total_tokens": 10,
    }
    tokens = [m for m in results[0]["messages"] if m["type"] == "token"]
    assert sum(len(m["token_ids"]) for m in tokens) == 5 and all(m["index"] == 0 for m in tokens)
    assert results[1]["last"] == {
        "type": "error",
        "status": 400,
        "message": results[1]["last"]["message"],
        "param": "temperature",
        "code": None,
    }
    assert all("logprobs" in m for m in results[2]["messages"] if m["type"] == "token")
    assert results[3]["last"]["type"] == "error" and results[3]["last"]["code"] == "model_not_found"

    import websockets

    async def cancel():
        uri = server.url.replace("http://", "ws://") + "/v1/stream"
        async with websockets.connect(uri, additional_headers=AUTH) as ws:
            await ws.send(
                json.dumps(
                    {"prompt": PROMPT, "max_tokens": 200, "temperature": 0, "ignore_eos": True}
                )
            )
            assert json.loads(await ws.recv())["type"] == "token"
            await ws.send(json.dumps({"type": "cancel"}))
            while (msg := json.loads(await asyncio.wait_for(ws.recv(), 30)))["type"] == "token":
                pass
            return msg

    done = asyncio.run(cancel())
    assert (
        done["type"] == "done"
        and done["finish_reason"] == "abort"
        and done["usage"]["completion_tokens"] < 200
    )

    async def no_key():
        uri = server.url.replace("http://", "ws://") + "/v1/stream"
        async with websockets.connect(uri):
            pass

    with pytest.raises(websockets.InvalidStatus) as e:
        asyncio.run(no_key())
    assert e.value.response.status_code == 401


# ---------------------------------------------------------------------- bad input

USER = [{"role": "user", "content": "Hi"}]
IMAGE_PART = {"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}
TOO_LONG_PROMPT = "hello " * 400  # about 400 tokens > max_model_len 256
# (id, path, body: dict | bytes, status, param, code); headers are AUTH unless the id says otherwise.
BAD_INPUTS = [
    ("malformed json", C, b'{"prompt": "x",', 400, None, None),
    ("json array body", C, b"[1, 2]", 400, None, None),
    ("empty body", C, b"", 400, None, None),
    ("invalid utf-8", C, b'{"prompt": "\xff\xfe"}', 400, None, None),
    ("nan literal", C, b'{"prompt": "x", "temperature": NaN}', 400, "temperature", None),
    ("deeply nested json", C, b"[" * 100_000 + b"]" * 100_000, 400, None, None),
    ("unknown field", C, {"prompt": "x", "foo": 1}, 400, "foo", "unknown_field"),
    ("missing prompt", C, {"max_tokens": 4}, 400, "prompt", None),
    ("max_tokens as string", C, {"prompt": "x", "max_tokens": "10"}, 400, "max_tokens", None),
    ("temperature as string", C, {"prompt": "x", "temperature": "hot"}, 400, "temperature", None),
    ("stream as string", C, {"prompt": "x", "stream": "yes"}, 400, "stream", None),
    ("negative temperature", C, {"prompt": "x", "temperature": -0.5}, 400, "temperature", None),
    ("top_p zero", C, {"prompt": "x", "top_p": 0}, 400, "top_p", None),
    ("top_p above one", C, {"prompt": "x", "top_p": 1.5}, 400, "top_p", None),
    ("top_k zero", C, {"prompt": "x", "top_k": 0}, 400, "top_k", None),
    ("min_p above one", C, {"prompt": "x", "min_p": 2}, 400, "min_p", None),
    ("n zero", C, {"prompt": "x", "n": 0}, 400, "n", None),
    ("n too large", C, {"prompt": "x", "n": 1000}, 400, "n", None),
    ("n>1 greedy", C, {"prompt": "x", "n": 2, "temperature": 0}, 400, "n", None),
    ("logprobs too many", C, {"prompt": "x", "logprobs": 21}, 400, "logprobs", None),
    ("presence_penalty", C, {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty", None),
    (
        "frequency_penalty",
        C,
        {"prompt": "x", "frequency_penalty": -3},
        400,
        "frequency_penalty",
        None,
    ),
    (
        "repetition_penalty zero",
        C,
        {"prompt": "x", "repetition_penalty": 0},
        400,
        "repetition_penalty",
        None,
    ),
    ("negative seed", C, {"prompt": "x", "seed": -1}, 400, "seed", None),
    ("empty stop string", C, {"prompt": "x", "stop": [""]}, 400, "stop", None),
    ("stop not a string", C, {"prompt": "x", "stop": 5}, 400, "stop", None),
    ("max_tokens zero", C, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", None),
    (
        "max_tokens too large",
        C,
        {"prompt": "x", "max_tokens": 100_000},
        400,
        "max_tokens",
        "context_length_exceeded",
    ),
    (
        "prompt too long",
        C,
        {"prompt": TOO_LONG_PROMPT, "max_tokens": 1},
        400,
        "prompt",
        "context_length_exceeded",
    ),
    (
        "huge prompt rejected unread",
        C,
        {"prompt": "a" * 900_000},
        400,
        "prompt",
        "context_length_exceeded",
    ),
    ("empty prompt", C, {"prompt": ""}, 400, "prompt", None),
    ("empty token list", C, {"prompt": []}, 400, "prompt", None),
    ("token id out of range", C, {"prompt": [1, 99_999_999]}, 400, "prompt", None),
    ("batched prompts", C, {"prompt": ["a", "b"]}, 400, "prompt", None),
    ("echo unsupported", C, {"prompt": "x", "echo": True}, 400, "echo", None),
    (
        "logit_bias unsupported",
        C,
        {"prompt": "x", "logit_bias": {"50": 100}},
        400,
        "logit_bias",
        None,
    ),
    (
        "stream_options without stream",
        C,
        {"prompt": "x", "stream_options": {"include_usage": True}},
        400,
        "stream_options",
        None,
    ),
    ("unknown model", C, {"model": "gpt-4", "prompt": "x"}, 404, "model", "model_not_found"),
    ("oversize body", C, {"prompt": "x" * (1 << 20)}, 413, None, "request_too_large"),
    ("missing api key", C, {"prompt": "x"}, 401, None, "invalid_api_key"),
    ("wrong api key", C, {"prompt": "x"}, 401, None, "invalid_api_key"),
    ("chat empty messages", CHAT, {"messages": []}, 400, "messages", None),
    ("chat missing messages", CHAT, {"max_tokens": 3}, 400, "messages", None),
    (
        "chat bad role",
        CHAT,
        {"messages": [{"role": "wizard", "content": "x"}]},
        400,
        "messages.0.role",
        None,
    ),
    (
        "chat content not text",
        CHAT,
        {"messages": [{"role": "user", "content": 7}]},
        400,
        "messages.0.content",
        None,
    ),
    (
        "chat image part",
        CHAT,
        {"messages": [{"role": "user", "content": [IMAGE_PART]}]},
        400,
        "messages.0.content.0.type",
        None,
    ),
    (
        "chat top_logprobs alone",
        CHAT,
        {"messages": USER, "top_logprobs": 2},
        400,
        "top_logprobs",
        None,
    ),
    (
        "chat top_logprobs too many",
        CHAT,
        {"messages": USER, "logprobs": True, "top_logprobs": 50},
        400,
        "top_logprobs",
        None,
    ),
    (
        "chat tool without function",
        CHAT,
        {"messages": USER, "tools": [{"type": "function"}]},
        400,
        "tools.0.function",
        None,
    ),
    (
        "chat tool_choice unknown function",
        CHAT,
        {
            "messages": USER,
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}},
        },
        400,
        "tool_choice",
        None,
    ),
    (
        "chat two output constraints",
        CHAT,
        {"messages": USER, "response_format": {"type": "json_object"}, "guided_regex": "a+"},
        400,
        "guided_regex",
        None,
    ),
    (
        "chat max_tokens too large",
        CHAT,
        {"messages": USER, "max_tokens": 10_000},
        400,
        "max_tokens",
        "context_length_exceeded",
    ),
    (
        "chat unknown model",
        CHAT,
        {"model": "/etc/passwd", "messages": USER},
        404,
        "model",
        "model_not_found",
    ),
]


def _send_bad(server: Server, case) -> httpx.Response:
    name, path, body, *_ = case
    headers = dict(AUTH)
    if name == "missing api key":
        headers = {}
    elif name == "wrong api key":
        headers = {"Authorization": "Bearer nope"}
    if isinstance(body, bytes):
        headers["Content-Type"] = "application/json"
        return httpx.post(f"{server.url}{path}", content=body, headers=headers, timeout=60)
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=60)


def test_bad_inputs_get_openai_errors_while_a_good_stream_completes(server):
    assert len(BAD_INPUTS) >= 30
    good = {
        "prompt": "Once upon a time, in a small village by the sea, there lived",
        "max_tokens": 48,
        "temperature": 0,
        "ignore_eos": True,
    }
    expected = post(server, C, good).json()["choices"][0]["text"]
    streamed: dict = {}

    def stream_good():
        try:
            events = sse_events(server, C, {**good, "stream": True})
            streamed["text"] = "".join(e["choices"][0]["text"] for e in events)
            streamed["finish"] = [
                e["choices"][0]["finish_reason"] for e in events if e["choices"][0]["finish_reason"]
            ]
        except Exception as e:  # reported by the assert below
            streamed["error"] = repr(e)

    thread = threading.Thread(target=stream_good)
    thread.start()
    failures = []
    for case in BAD_INPUTS:
        name, _, _, status, param, code = case
        r = _send_bad(server, case)
        try:
            err = r.json()["error"]
            ok = (
                r.status_code == status
                and set(err) == {"message", "type", "param", "code"}
                and isinstance(err["message"], str)
                and err["message"]
                and err["param"] == param
                and (code is None or err["code"] == code)
            )
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            failures.append(f"{name}: {r.status_code} {r.text[:300]}")
    thread.join(120)
    assert not failures, "\n".join(failures)
    assert streamed.get("text") == expected and streamed.get("finish") == ["length"], streamed
    # Nothing leaked: every admitted request finished and every page came back.
    m = server.wait_metrics(
        lambda m: m["minivllm_requests_in_flight"] == 0 and m["minivllm_kv_pages_used"] == 0
    )
    assert m["minivllm_requests_in_flight"] == 0 and m["minivllm_kv_pages_used"] == 0


def test_unknown_route_and_method_are_json_errors(server):
    r = httpx.get(f"{server.url}/v1/nope", headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx.get(f"{server.url}/v1/completions", headers=AUTH)
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    assert httpx.get(f"{server.url}/v1/models").status_code == 401  # every /v1 path needs the key
    assert httpx.get(f"{server.url}/docs").status_code == 404  # no extra surface


# ---------------------------------------------------------------------- disconnects and limits


def _raw_request(server: Server, path: str, body: dict) -> socket.socket:
    """Send a request on a raw socket and return it unread (the caller closes it = disconnect)."""
    data = json.dumps(body).encode()
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {API_KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock


def test_queue_limit_then_disconnects_free_every_page(server):
    base = server.metrics()
    assert base["minivllm_kv_pages_used"] == 0
    long = {"prompt": PROMPT, "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    # MAX_QUEUE requests in flight: SSE streams, non-streaming ones, and one WebSocket.
    chat = {
        "messages": USER,
        "max_tokens": 200,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    socks = [_raw_request(server, C, {**long, "stream": True}) for _ in range(MAX_QUEUE - 6)]
    socks += [_raw_request(server, CHAT, chat)]
    socks += [_raw_request(server, C, long) for _ in range(4)]

    import websockets

    async def ws_then_full():
        uri = server.url.replace("http://", "ws://") + "/v1/stream"
        async with websockets.connect(uri, additional_headers=AUTH) as ws:
            await ws.send(json.dumps(long))
            m = server.wait_metrics(
                lambda m: (
                    m["minivllm_requests_in_flight"] == MAX_QUEUE and m["minivllm_kv_pages_used"]
                )
            )
            assert m["minivllm_requests_in_flight"] == MAX_QUEUE and m["minivllm_kv_pages_used"] > 0
            # Full: HTTP gets 429 with Retry-After, the socket gets an error message.
            r = post(server, C, {"prompt": PROMPT, "max_tokens": 1})
            assert r.status_code == 429 and r.headers["Retry-After"] == "1"
            assert r.json()["error"]["code"] == "queue_full"
            await ws.send(
                json.dumps({"prompt": PROMPT, "max_tokens": 1})
            )  # queued behind the first
            # Then drop everything mid-stream: WebSocket first, then the HTTP clients.
        for s in socks:
            s.close()

    asyncio.run(ws_then_full())
    m = server.wait_metrics(
        lambda m: m["minivllm_requests_in_flight"] == 0 and m["minivllm_kv_pages_used"] == 0
    )
    assert m["minivllm_requests_in_flight"] == 0
    assert m["minivllm_kv_pages_free"] == base["minivllm_kv_pages_free"]
    assert m["minivllm_num_requests_running"] == 0 and m["minivllm_num_requests_waiting"] == 0
    assert (
        m["minivllm_generation_tokens_total"] - base["minivllm_generation_tokens_total"]
        < MAX_QUEUE * 200
    )
    assert m['minivllm_requests_finished_total{finish_reason="abort"}'] >= MAX_QUEUE
    assert post(server, C, {"prompt": PROMPT, "max_tokens": 2}).status_code == 200  # still serving


# ---------------------------------------------------------------------- metrics and load


def test_metrics_exposition(server):
    text = httpx.get(f"{server.url}/metrics", headers=AUTH).text
    for name in (
        "num_requests_running",
        "num_requests_waiting",
        "kv_pages_used",
        "kv_pages_free",
        "generation_tokens_total",
        "compiles_total",
        "time_to_first_token_seconds",
        "time_per_output_token_seconds",
    ):
        assert f"# TYPE minivllm_{name} " in text
    m = server.metrics()
    for h in (
        "time_to_first_token_seconds",
        "time_per_output_token_seconds",
        "e2e_request_latency_seconds",
    ):
        buckets = [v for k, v in m.items() if k.startswith(f"minivllm_{h}_bucket")]
        assert buckets == sorted(buckets) and buckets[-1] == m[f"minivllm_{h}_count"] > 0


def test_loopback_load_has_no_errors_and_no_recompiles(server, tmp_path):
    before = server.metrics()
    out = tmp_path / "load.json"
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "serving" / "load_test.py"),
        "--url",
        server.url,
        "--api-key",
        API_KEY,
        "--requests",
        "32",
        "--concurrency",
        "8",
        "--max-tokens",
        "12",
        "--warmup-requests",
        "0",
        "--deadline",
        "240",
        "--out",
        str(out),
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(out.read_text())
    assert report["completed"] == 32 and report["errors"] == 0
    assert report["ttft_s"]["p50"] > 0 and report["output_tokens"] == 32 * 12
    after = server.metrics()
    assert after["minivllm_compiles_total"] == before["minivllm_compiles_total"]
    # Continuous batching across HTTP requests: far fewer engine steps than tokens generated.
    steps = after["minivllm_engine_steps_total"] - before["minivllm_engine_steps_total"]
    tokens = after["minivllm_generation_tokens_total"] - before["minivllm_generation_tokens_total"]
    assert tokens == 32 * 12 and steps < tokens / 2


# ---------------------------------------------------------------------- shutdown (keep last)


def test_sigterm_drains_in_flight_stream_and_exits_cleanly(server):
    first_chunk = threading.Event()
    result: dict = {}

    def stream():
        body = {
            "prompt": PROMPT,
            "max_tokens": 24,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream("POST", f"{server.url}{C}", json=body, headers=AUTH, timeout=120) as r:
            lines = []
            for line in r.iter_lines():
                lines.append(line)
                first_chunk.set()
        result["lines"] = [x for x in lines if x]

    thread = threading.Thread(target=stream)
    thread.start()
    assert first_chunk.wait(60)
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(60) == 0, server.log.read_text()[-3000:]
    thread.join(30)
    lines = result["lines"]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(x.removeprefix("data: ")) for x in lines[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # drained, not cut
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{server.url}/health", timeout=5)
