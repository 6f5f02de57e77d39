"""Abuse: property-based bad inputs (Hypothesis) for every request model, over HTTP
(`POST /v1/completions`, `POST /v1/chat/completions`) and the WebSocket (`/v1/stream`), sent to
one real uvicorn server on a loopback port that serves the hand-computable FakeEngine of
tests/test_server_units.py (no JAX, no model: seconds, not minutes).

Properties:
- every answer is a JSON 4xx in OpenAI's error shape (on the WebSocket: an `error` message with
  the same fields) or a well-formed 200 (a JSON completion, or an SSE stream of chunks ending in
  `[DONE]`); never a 5xx, a non-JSON body or a dropped connection;
- good streams (one SSE, one WebSocket), started before the fuzzing and repeated until it ends,
  always produce exactly the text they produce alone;
- the inputs issue 33 names (numbers out of range, token ids out of the vocabulary, tool bombs)
  are 400s naming their field.

Runs are derandomized with a fixed example budget per test, so CI sees the same inputs each time
and the module stays well under a minute. A failing input is collected rather than shrunk, so one
run lists every failing input. The distinct inputs tried and the 4xx answers are counted and
printed at the end of the module.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import uvicorn
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from server.app import DEFAULT_MAX_BODY_BYTES, create_app
from server.protocol import ChatCompletionRequest, CompletionRequest, StreamRequest
from tests.test_server import _free_port
from tests.test_server_units import FakeEngine, FakeTokenizer, expected_text

API_KEY = "abuse-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
JSON_HEADERS = {**AUTH, "Content-Type": "application/json"}
MODEL = "fake"
MAX_MODEL_LEN = 64
VOCAB = 128  # FakeTokenizer: one token per character, id = ord(c) % 128
# Fast fake steps keep valid fuzz requests (up to MAX_MODEL_LEN tokens) cheap.
STEP_SECONDS = 0.002
GOOD_PROMPT, GOOD_TOKENS = "ab", 40
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
# The example budget per fuzz test: enough to hit every strategy branch many times, small
# enough that the module runs in well under a minute.
FUZZ_EXAMPLES = 150
FUZZ_SETTINGS = settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    phases=(Phase.explicit, Phase.generate),
    print_blob=False,
    suppress_health_check=list(HealthCheck),
)
REQUEST_TIMEOUT_S = 30.0
# The tool bomb: 15,000 minimal tools, about 800 KB, under the 1 MiB body limit. Before tools
# were capped it froze the event loop for 8.9 s (/health took 8.4 s). The bound is 4x under that
# and 100x over a healthy /health (milliseconds): it tells a blocked loop from a busy box.
TOOL_BOMB_TOOLS = 15_000
HEALTH_WORST_BOUND_S = 2.0
MAX_TOOLS = 128  # OpenAI's cap on `tools`


# ---------------------------------------------------------------------- the server and good traffic


class StrictUnicodeTokenizer(FakeTokenizer):
    """FakeTokenizer that, like HF's Rust tokenizers, refuses text that is not valid Unicode: a
    lone surrogate (legal as a JSON escape, "\\ud800") raises TypeError, as `encode` does there."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise TypeError(
                "TextEncodeInput must be Union[TextInputSequence, Tuple[InputSequence, InputSequence]]"
            ) from None
        return super().encode(text, add_special_tokens)


@dataclasses.dataclass
class LiveServer:
    url: str
    ws_url: str
    engine: FakeEngine


@pytest.fixture(scope="module")
def live() -> Iterator[LiveServer]:
    """The app over the FakeEngine, served by a real uvicorn on a free loopback port (a thread)."""
    llm = SimpleNamespace(
        engine=FakeEngine(max_model_len=MAX_MODEL_LEN, step_seconds=STEP_SECONDS),
        tokenizer=StrictUnicodeTokenizer(),
    )
    llm.engine.config.vocab_size = VOCAB  # what a real engine's config says
    app = create_app(llm, model_name=MODEL, api_key=API_KEY)
    port = _free_port()
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=port,
        log_level="warning",
        lifespan="on",
        ws_max_size=DEFAULT_MAX_BODY_BYTES,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="abuse-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield LiveServer(f"http://127.0.0.1:{port}", f"ws://127.0.0.1:{port}/v1/stream", llm.engine)
    finally:
        server.should_exit = True
        thread.join(30)


GOOD_BODY = {"prompt": GOOD_PROMPT, "max_tokens": GOOD_TOKENS, "temperature": 0}


def good_sse_text(client: httpx.Client) -> str:
    """One good completion streamed over SSE: its text, or what went wrong."""
    with client.stream("POST", COMPLETIONS, json={**GOOD_BODY, "stream": True}, headers=AUTH) as r:
        raw = r.read().decode()
    if r.status_code != 200:
        return f"HTTP {r.status_code}: {raw[:200]}"
    text = []
    for block in raw.split("\n\n")[:-1]:
        payload = block.removeprefix("data: ")
        if payload != "[DONE]":
            chunk = json.loads(payload)
            if "error" in chunk:
                return f"stream error: {chunk['error']}"
            text.append(chunk["choices"][0]["text"])
    return "".join(text) if raw.endswith("data: [DONE]\n\n") else f"no [DONE]: {raw[-200:]!r}"


def good_ws_text(ws: ClientConnection) -> str:
    """One good request on an open WebSocket: its text, or what went wrong."""
    ws.send(json.dumps(GOOD_BODY))
    text = []
    while True:
        msg = json.loads(ws.recv(timeout=REQUEST_TIMEOUT_S))
        if msg["type"] == "token":
            text.append(msg["text"])
        elif msg["type"] == "done":
            return "".join(text)
        else:
            return f"unexpected message {msg}"


class GoodTraffic:
    """Good requests in a loop on their own threads (one SSE client, one WebSocket) from before
    the fuzzing starts until the module ends; each must give exactly the text it gives alone."""

    def __init__(self, live: LiveServer) -> None:
        self.live = live
        self.expected = expected_text(GOOD_PROMPT, GOOD_TOKENS)
        self.completed: collections.Counter[str] = collections.Counter()
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._loop, args=(kind,), daemon=True) for kind in ("sse", "ws")
        ]

    def alone(self) -> dict[str, str]:
        """The good request over each transport with nothing else running."""
        with httpx.Client(base_url=self.live.url, timeout=REQUEST_TIMEOUT_S) as client:
            sse = good_sse_text(client)
        with connect(self.live.ws_url, additional_headers=AUTH) as ws:
            return {"sse": sse, "ws": good_ws_text(ws)}

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(REQUEST_TIMEOUT_S * 2)

    def _loop(self, kind: str) -> None:
        with httpx.Client(base_url=self.live.url, timeout=REQUEST_TIMEOUT_S) as client:
            ws = None
            while not self._stop.is_set():
                try:
                    if kind == "sse":
                        text = good_sse_text(client)
                    else:
                        ws = ws or connect(self.live.ws_url, additional_headers=AUTH)
                        text = good_ws_text(ws)
                except Exception as e:  # reported by the checks in each test
                    text, ws = f"{type(e).__name__}: {e}", None
                if text == self.expected:
                    self.completed[kind] += 1
                else:
                    self.failures.append(f"{kind}: {text[:300]!r}")
            if ws is not None:
                ws.close()

    def snapshot(self) -> collections.Counter[str]:
        return collections.Counter(self.completed)

    def check_since(self, before: collections.Counter[str]) -> None:
        """No good request failed, and both kinds completed while the caller's test ran."""
        assert not self.failures, "good traffic was harmed:\n" + "\n".join(self.failures[:10])
        deadline = (
            time.monotonic() + REQUEST_TIMEOUT_S
        )  # the stream in progress finishes after the test
        while (
            not all(self.completed[k] > before[k] for k in ("sse", "ws"))
            and time.monotonic() < deadline
        ):
            time.sleep(0.01)
        assert all(self.completed[k] > before[k] for k in ("sse", "ws")), (before, self.completed)


@pytest.fixture(scope="module")
def good(live: LiveServer) -> Iterator[GoodTraffic]:
    traffic = GoodTraffic(live)
    alone = traffic.alone()
    assert alone == {"sse": traffic.expected, "ws": traffic.expected}, alone
    traffic.start()
    try:
        yield traffic
    finally:
        traffic.stop()
    assert not traffic.failures, "good traffic was harmed:\n" + "\n".join(traffic.failures[:10])


# ---------------------------------------------------------------------- counting what was tried


@dataclasses.dataclass
class Tally:
    """Distinct bad inputs sent (by transport, path, headers and body bytes) and their answers."""

    seen: set[str] = dataclasses.field(default_factory=set)
    answers: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)

    def record(self, key: str, body: bytes, answer: str) -> None:
        digest = hashlib.sha256(key.encode("utf-8", "surrogatepass") + b"\0" + body).hexdigest()
        if digest not in self.seen:
            self.seen.add(digest)
            self.answers[answer] += 1

    def summary(self) -> str:
        fourxx = sum(n for a, n in self.answers.items() if a.startswith("4"))
        detail = ", ".join(f"{a}: {n}" for a, n in sorted(self.answers.items()))
        return f"abuse fuzz: {len(self.seen)} distinct inputs tried, {fourxx} got a 4xx ({detail})"


@pytest.fixture(scope="module")
def tally(request: pytest.FixtureRequest) -> Iterator[Tally]:
    counts = Tally()
    yield counts
    # Past output capture, so every run shows the counts (not only a failing one).
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if capture is None or reporter is None:
        print(counts.summary())
        return
    with capture.global_and_fixture_disabled():
        reporter.write_line("")
        reporter.write_line(counts.summary())


# ---------------------------------------------------------------------- answers and what makes them right


def error_shape_problem(err: Any) -> str | None:
    """None if `err` is OpenAI's error object: message (non-empty), type, param, code."""
    if not isinstance(err, dict) or set(err) != {"message", "type", "param", "code"}:
        return f"not OpenAI's error shape: {err!r:.300}"
    if not (isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)):
        return f"error without a message or type: {err!r:.300}"
    if not all(err[k] is None or isinstance(err[k], str) for k in ("param", "code")):
        return f"error param/code not a string or null: {err!r:.300}"
    return None


def http_problem(r: httpx.Response) -> str | None:
    """None if `r` is a JSON 4xx with OpenAI's error body or a well-formed 200; else what is wrong."""
    ctype = r.headers.get("content-type", "")
    if 400 <= r.status_code < 500:
        if not ctype.startswith("application/json"):
            return f"{r.status_code} with content-type {ctype!r}: {r.text[:200]!r}"
        try:
            return error_shape_problem(r.json().get("error"))
        except (ValueError, AttributeError):
            return f"{r.status_code} body is not a JSON object: {r.text[:200]!r}"
    if r.status_code != 200:
        return f"status {r.status_code}: {r.text[:300]!r}"
    if ctype.startswith("text/event-stream"):
        return sse_problem(r.text)
    try:
        body = r.json()
    except ValueError:
        return f"200 body is not JSON: {r.text[:200]!r}"
    if not (isinstance(body, dict) and body.get("choices") and isinstance(body.get("usage"), dict)):
        return f"200 body without choices or usage: {r.text[:300]!r}"
    return None


def sse_problem(raw: str) -> str | None:
    """None if `raw` is `data: <json chunk>` events (no error chunk) ending in `data: [DONE]`."""
    if not raw.endswith("data: [DONE]\n\n"):
        return f"SSE stream does not end in [DONE]: {raw[-300:]!r}"
    for block in raw.split("\n\n")[:-2]:
        if not block.startswith("data: "):
            return f"SSE event is not a data line: {block[:200]!r}"
        try:
            chunk = json.loads(block.removeprefix("data: "))
        except ValueError:
            return f"SSE chunk is not JSON: {block[:200]!r}"
        if "error" in chunk or "choices" not in chunk:
            return f"SSE chunk is an error or has no choices: {block[:300]!r}"
    return None


def ws_problem(ws: ClientConnection) -> tuple[str, str | None]:
    """Read one request's answer: `error` (4xx, OpenAI's fields) or tokens then `done`.
    Returns (the answer's status for the tally, what is wrong or None)."""
    while True:
        msg = json.loads(ws.recv(timeout=REQUEST_TIMEOUT_S))
        kind = msg.get("type") if isinstance(msg, dict) else None
        if kind == "token":
            continue
        if kind == "done":
            ok = isinstance(msg.get("finish_reason"), str) and isinstance(msg.get("usage"), dict)
            return "200", None if ok else f"malformed done message: {msg!r:.300}"
        if kind == "error":
            status = msg.get("status")
            if not (isinstance(status, int) and 400 <= status < 500):
                return str(status), f"error message with status {status}: {msg!r:.300}"
            fields = {k: msg.get(k) for k in ("message", "param", "code")}
            return str(status), error_shape_problem({**fields, "type": "invalid_request_error"})
        return "?", f"unexpected message: {msg!r:.300}"


# ---------------------------------------------------------------------- strategies

HUGE_INTS = [
    2**31 - 1,
    2**31,
    2**32,
    2**53 + 1,
    2**63 - 1,
    2**63,
    2**64,
    -(2**31) - 1,
    -(2**63),
    -(2**63) - 1,
    10**30,
    -(10**30),
]
FLOAT_EXTREMES = [1e308, -1e308, 5e-324, -0.0, 1e-320, 3.4e38, 2.0**64]
NOT_NUMBERS = [
    "NaN",
    "nan",
    "inf",
    "-inf",
    "Infinity",
    "-Infinity",
    "1e999",
    "0x10",
    "1_000",
    "",
    " 1",
]
# Lone UTF-16 halves: valid JSON escapes (json.dumps writes them so), no valid UTF-8 once decoded.
SURROGATES = ["\ud800", "a\udfffb", "\udbff", "x\udc00y"]
ODD_TEXT = [
    "\x00",
    "\u202e",
    "\ufeff",
    "ß" * 10,
    "🙂" * 10,
    "\n" * 100,
    "\\",
    "</s>",
    "<|im_start|>",
    "{{x}}",
]
BIG_VALUES = [
    "x" * 200_000,
    ["x"] * 20_000,
    list(range(50_000)),
    {f"k{i}": i for i in range(5_000)},
    [{"role": "user", "content": "a"}] * 5_000,
]


@dataclasses.dataclass(frozen=True)
class Deep:
    """A value nested `depth` deep, written into the JSON text as is (json.dumps would recurse)."""

    depth: int
    kind: str  # "[" or "{"

    def text(self) -> str:
        if self.kind == "[":
            return "[" * self.depth + "]" * self.depth
        return '{"a":' * self.depth + "1" + "}" * self.depth


def to_json_bytes(value: Any) -> bytes:
    """json.dumps with `Deep` values spliced in as raw text (ASCII: surrogates stay escapes)."""
    deep: dict[str, Deep] = {}

    def swap(v: Any) -> Any:
        if isinstance(v, Deep):
            key = f"__deep_{len(deep)}__"
            deep[key] = v
            return key
        if isinstance(v, dict):
            return {k: swap(x) for k, x in v.items()}
        if isinstance(v, list):
            return [swap(x) for x in v]
        return v

    text = json.dumps(swap(value))
    for key, d in deep.items():
        text = text.replace(json.dumps(key), d.text(), 1)
    return text.encode("ascii")


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=24),
    st.sampled_from(HUGE_INTS + FLOAT_EXTREMES + NOT_NUMBERS + SURROGATES + ODD_TEXT),
)
json_values = st.recursive(
    scalars,
    lambda kids: (
        st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4)
    ),
    max_leaves=10,
)
token_lists = st.lists(
    st.sampled_from([-1, 0, 1, VOCAB - 1, VOCAB, 2**31, 2**32, 2**63, 2**64, -(2**63), True, 1.5]),
    min_size=1,
    max_size=6,
)
deep_values = st.builds(Deep, st.integers(10, 50_000), st.sampled_from(["[", "{"]))
big_values = st.sampled_from(BIG_VALUES)


def minimal_tools(n: int, name: str = "f{i}") -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": name.format(i=i)}} for i in range(n)]


tool_lists = st.one_of(
    st.integers(0, 300).map(minimal_tools),
    st.integers(2, 50).map(lambda n: minimal_tools(n, name="same")),  # duplicate names
    st.lists(
        st.fixed_dictionaries(
            {
                "type": st.just("function"),
                "function": st.fixed_dictionaries(
                    {"name": st.text(max_size=80), "parameters": json_values | deep_values}
                ),
            }
        ),
        max_size=5,
    ),
)
bad_values = st.one_of(json_values, token_lists, deep_values, big_values, tool_lists)

messages = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "system", "assistant", "developer", "tool", "wizard"]),
            "content": st.text(max_size=12)
            | st.lists(
                st.fixed_dictionaries(
                    {"type": st.sampled_from(["text", "image_url"]), "text": st.text(max_size=8)}
                ),
                max_size=3,
            ),
        }
    ),
    min_size=1,
    max_size=4,
)


def sampling_fields() -> dict[str, st.SearchStrategy]:
    """Valid-looking optional sampling fields; mutations break them."""
    return {
        "temperature": st.floats(0, 2),
        "top_p": st.floats(0.01, 1),
        "top_k": st.integers(-1, 100),
        "min_p": st.floats(0, 1),
        "n": st.integers(1, 3),
        "seed": st.integers(0, 2**63 - 1),
        "stop": st.text(min_size=1, max_size=4)
        | st.lists(st.text(min_size=1, max_size=4), max_size=3),
        "presence_penalty": st.floats(-2, 2),
        "frequency_penalty": st.floats(-2, 2),
        "repetition_penalty": st.floats(0.5, 2),
        "ignore_eos": st.booleans(),
        "stream": st.booleans(),
        "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=3),
        "user": st.text(max_size=8),
        "guided_choice": st.lists(st.text(min_size=1, max_size=4), min_size=1, max_size=3),
        "model": st.sampled_from([MODEL, "gpt-4", "", "\ud800"]),
    }


def field_names(model: type) -> list[str]:
    return [f.alias or name for name, f in model.model_fields.items()]


def mutated(base: st.SearchStrategy, fields: list[str]) -> st.SearchStrategy:
    """A valid-looking body with up to three breakages: a field set to a bad value, an unknown
    field, a field removed, or the whole body replaced by a non-object."""
    mutation = st.one_of(
        st.tuples(st.just("set"), st.sampled_from(fields), bad_values),
        st.tuples(
            st.just("set"),
            st.text(min_size=1, max_size=20) | st.sampled_from(SURROGATES),
            json_values,
        ),
        st.tuples(st.just("del"), st.sampled_from(fields), st.none()),
        st.tuples(st.just("replace"), st.none(), json_values | deep_values | big_values),
    )

    def apply(args: tuple[dict[str, Any], list[tuple[str, Any, Any]]]) -> Any:
        body: Any = dict(args[0])
        for op, key, value in args[1]:
            if op == "replace":
                body = value
            elif isinstance(body, dict) and op == "set":
                body[key] = value
            elif isinstance(body, dict):
                body.pop(key, None)
        return body

    return st.tuples(base, st.lists(mutation, max_size=3)).map(apply)


RAW_BODIES = [
    b"",
    b" ",
    b"\xff\xfe",
    b"\xc3\x28",
    b"{",
    b'{"prompt": "x",',
    b"null",
    b"1",
    b'"s"',
    b"[]",
    b"{}",
    b"[" * 100_000,
    b'{"prompt": NaN}',
    b'{"prompt": "ab", "max_tokens": 1e999}',
    b'{"prompt": "ab", "prompt": "cd"}',
    b'\xef\xbb\xbf{"prompt": "ab"}',
    '{"prompt": "ab"}'.encode("utf-16"),
    b'{"prompt": "\\ud800"}',
    b'{"prompt": "ab"}\x00',
    b"x" * (DEFAULT_MAX_BODY_BYTES + 1),
]
raw_bodies = st.sampled_from(RAW_BODIES) | st.binary(max_size=64)

BAD_HEADERS = [
    {**AUTH, "Content-Type": "text/plain"},
    {**AUTH, "Content-Type": "application/x-www-form-urlencoded"},
    {**AUTH, "Content-Type": "multipart/form-data; boundary=x"},
    {**AUTH, "Content-Type": "application/jsonx"},
    {**AUTH, "Content-Type": ""},
    AUTH,
    {"Content-Type": "application/json"},
    {"Content-Type": "application/json", "Authorization": "Bearer nope"},
    {"Content-Type": "application/json", "Authorization": f"Basic {API_KEY}"},
]
# Mostly well-formed headers (three branches in four), so most inputs reach the body's checks.
headers = st.one_of(
    st.just(JSON_HEADERS),
    st.just(JSON_HEADERS),
    st.just({**AUTH, "Content-Type": "application/json; charset=utf-8"}),
    st.sampled_from(BAD_HEADERS),
)


def http_cases(path: str, base: st.SearchStrategy, fields: list[str]) -> st.SearchStrategy:
    """(headers, body bytes): a mutated body as JSON, or raw bytes, with one of the header sets."""
    bodies = mutated(base, fields).map(to_json_bytes) | raw_bodies
    return st.tuples(headers, bodies)


completion_base = st.fixed_dictionaries(
    {
        "prompt": st.sampled_from(["ab", "hello", "x"])
        | st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=4),
        "max_tokens": st.integers(1, 8),
    },
    optional={
        **sampling_fields(),
        "logprobs": st.integers(0, 5),
        "echo": st.booleans(),
        "best_of": st.integers(1, 3),
    },
)
chat_base = st.fixed_dictionaries(
    {
        "messages": st.just([{"role": "user", "content": "hi"}]) | messages,
        "max_tokens": st.integers(1, 8),
    },
    optional={
        **sampling_fields(),
        "logprobs": st.booleans(),
        "top_logprobs": st.integers(0, 5),
        "tools": tool_lists,
        "tool_choice": st.sampled_from(["auto", "none", "required"]),
        "parallel_tool_calls": st.booleans(),
        "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
    },
)
stream_base = st.one_of(
    st.fixed_dictionaries(
        {"prompt": st.sampled_from(["ab", "hello"]), "max_tokens": st.integers(1, 8)},
        optional={**sampling_fields(), "logprobs": st.integers(0, 5)},
    ),
    st.fixed_dictionaries(
        {
            "messages": st.just([{"role": "user", "content": "hi"}]) | messages,
            "max_tokens": st.integers(1, 8),
        },
        optional={"temperature": st.floats(0, 2)},
    ),
)


# ---------------------------------------------------------------------- the fuzz tests


def fuzz_http(
    live: LiveServer,
    tally: Tally,
    path: str,
    case: tuple[dict[str, str], bytes],
    problems: list[str],
) -> None:
    """Send one fuzz case; a wrong answer (or none) is added to `problems`."""
    headers, body = case
    key = f"http {path} {sorted(headers.items())}"
    try:
        r = httpx.post(
            f"{live.url}{path}", content=body, headers=headers, timeout=REQUEST_TIMEOUT_S
        )
        problem, answer = http_problem(r), str(r.status_code)
    except httpx.HTTPError as e:
        problem, answer = f"no answer: {type(e).__name__}: {e}", "none"
    tally.record(key, body, answer)
    if problem is not None:
        problems.append(
            f"POST {path} headers={headers} body={body[:300]!r}{'...' if len(body) > 300 else ''}\n"
            f"    -> {problem}"
        )


# Always tried first (Hypothesis' explicit examples): inputs that once broke the server.
KNOWN_BAD = {
    COMPLETIONS: b'{"prompt": "\\ud800", "max_tokens": 2}',
    CHAT: to_json_bytes(
        {"messages": [{"role": "user", "content": "hi"}], "tools": minimal_tools(300)}
    ),
    "ws": b'{"prompt": "\\ud800", "max_tokens": 2}',
}


def report(problems: list[str]) -> str:
    distinct = list(dict.fromkeys(problems))
    return f"{len(distinct)} bad answers:\n" + "\n".join(distinct[:25])


@pytest.mark.parametrize(
    "path, base, model",
    [
        (COMPLETIONS, completion_base, CompletionRequest),
        (CHAT, chat_base, ChatCompletionRequest),
    ],
    ids=["completions", "chat"],
)
def test_http_fuzz_gets_json_4xx_or_valid_200_while_good_streams_complete(
    live, good, tally, path, base, model
):
    before, problems = good.snapshot(), []

    @FUZZ_SETTINGS
    @given(case=http_cases(path, base, field_names(model)))
    @example(case=(JSON_HEADERS, KNOWN_BAD[path]))
    def run(case):
        fuzz_http(live, tally, path, case, problems)

    run()
    assert not problems, report(problems)
    good.check_since(before)


def ws_frames() -> st.SearchStrategy:
    """A text frame (a mutated request, as JSON) or bytes for a binary frame."""
    text = mutated(stream_base, field_names(StreamRequest)).map(
        lambda v: to_json_bytes(v).decode("ascii")
    )
    return text | raw_bodies.filter(lambda b: len(b) <= DEFAULT_MAX_BODY_BYTES)


def test_websocket_fuzz_gets_error_messages_or_valid_streams_while_good_streams_complete(
    live, good, tally
):
    before, problems = good.snapshot(), []
    sockets: list[ClientConnection] = []

    def socket() -> ClientConnection:
        if not sockets:
            sockets.append(connect(live.ws_url, additional_headers=AUTH, max_size=None))
        return sockets[0]

    @FUZZ_SETTINGS
    @given(frame=ws_frames())
    @example(frame=KNOWN_BAD["ws"].decode("ascii"))
    def run(frame):
        data = frame.encode("ascii") if isinstance(frame, str) else frame
        if data.strip() == b'{"type": "cancel"}':
            return  # a cancel with nothing running is answered by silence
        try:
            ws = socket()
            ws.send(frame)
            answer, problem = ws_problem(ws)
        except (ConnectionClosed, TimeoutError, OSError, ValueError) as e:
            sockets.clear()  # the next example opens a new socket
            answer, problem = "none", f"socket lost: {type(e).__name__}: {e}"
        tally.record(f"ws {'text' if isinstance(frame, str) else 'binary'}", data, answer)
        if problem is not None:
            problems.append(f"WS frame={data[:300]!r}\n    -> {problem}")

    try:
        run()
    finally:
        for ws in sockets:
            ws.close()
    assert not problems, report(problems)
    good.check_since(before)


# ---------------------------------------------------------------------- what issue 33 names, exactly

OUT_OF_RANGE = [
    (COMPLETIONS, "top_k", 2**31),
    (COMPLETIONS, "top_k", 2**32),
    (COMPLETIONS, "top_k", 2**63),
    (COMPLETIONS, "seed", 2**63),
    (COMPLETIONS, "seed", 2**64),
    (COMPLETIONS, "seed", -(2**63)),
    (COMPLETIONS, "n", 2**32),
    (COMPLETIONS, "logprobs", 2**32),
    (COMPLETIONS, "logprobs", -(2**63)),
    (COMPLETIONS, "max_tokens", 2**63),
    (COMPLETIONS, "max_tokens", -(2**63)),
    (COMPLETIONS, "presence_penalty", 1e308),
    (COMPLETIONS, "frequency_penalty", -1e308),
    (COMPLETIONS, "stop_token_ids", [2**63]),
    (COMPLETIONS, "stop_token_ids", [2**64]),
    (COMPLETIONS, "logit_bias", {"1": 1e308}),
    (CHAT, "top_k", 2**32),
    (CHAT, "seed", 2**63),
    (CHAT, "top_logprobs", 2**32),
    (CHAT, "max_completion_tokens", 2**63),
    (CHAT, "n", 2**63),
]


def body_for(path: str, **fields: Any) -> dict[str, Any]:
    base = (
        {"prompt": "ab"}
        if path == COMPLETIONS
        else {"messages": [{"role": "user", "content": "hi"}]}
    )
    if path == CHAT and "top_logprobs" in fields:
        base["logprobs"] = True
    return {**base, "max_tokens": 4, **fields}


def assert_400_naming(r: httpx.Response, *params: str) -> None:
    """A 400 in OpenAI's error shape whose `param` is (an item of) one of `params`."""
    assert r.status_code == 400, f"{r.status_code}: {r.text[:300]}"
    err = r.json()["error"]
    assert error_shape_problem(err) is None and (err["param"] or "").split(".")[0] in params, err


OUT_OF_RANGE_IDS = [f"{'chat' if p == CHAT else 'completions'}-{f}={v}" for p, f, v in OUT_OF_RANGE]


@pytest.mark.parametrize("path, field, value", OUT_OF_RANGE, ids=OUT_OF_RANGE_IDS)
def test_out_of_range_numbers_are_400_naming_the_field(live, good, tally, path, field, value):
    before = good.snapshot()
    body = to_json_bytes(body_for(path, **{field: value}))
    r = httpx.post(
        f"{live.url}{path}", content=body, headers=JSON_HEADERS, timeout=REQUEST_TIMEOUT_S
    )
    tally.record(f"http {path} strict", body, str(r.status_code))
    assert_400_naming(
        r, field, *(["max_tokens"] if field == "max_completion_tokens" else [])
    )  # its older name
    good.check_since(before)


@pytest.mark.parametrize("value", [-(2**63), 2**32])
def test_out_of_range_top_k_on_the_websocket_is_an_error_naming_it(live, good, tally, value):
    before = good.snapshot()
    with connect(live.ws_url, additional_headers=AUTH) as ws:
        frame = json.dumps({"prompt": "ab", "max_tokens": 4, "top_k": value})
        ws.send(frame)
        msg = json.loads(ws.recv(timeout=REQUEST_TIMEOUT_S))
    tally.record("ws strict", frame.encode(), str(msg.get("status", "200")))
    assert msg["type"] == "error" and msg["status"] == 400 and msg["param"] == "top_k", msg
    good.check_since(before)


@pytest.mark.parametrize("prompt", [[VOCAB], [2**31], [2**63], [-1], [1, -(2**63)]], ids=str)
def test_token_id_prompts_out_of_the_vocabulary_are_400(live, good, tally, prompt):
    before = good.snapshot()
    body = to_json_bytes({"prompt": prompt, "max_tokens": 2})
    r = httpx.post(
        f"{live.url}{COMPLETIONS}", content=body, headers=JSON_HEADERS, timeout=REQUEST_TIMEOUT_S
    )
    tally.record("http strict", body, str(r.status_code))
    assert_400_naming(r, "prompt")
    good.check_since(before)


def test_too_many_tools_is_400(live, good, tally):
    body = to_json_bytes(body_for(CHAT, tools=minimal_tools(MAX_TOOLS + 1)))
    r = httpx.post(
        f"{live.url}{CHAT}", content=body, headers=JSON_HEADERS, timeout=REQUEST_TIMEOUT_S
    )
    tally.record("http strict", body, str(r.status_code))
    assert_400_naming(r, "tools")


def test_tool_bomb_is_400_while_health_keeps_answering(live, good, tally):
    """15,000 minimal tools (about 800 KB, under the body limit) is refused by its count, and the
    event loop never stalls: /health, polled throughout, answers well under a second."""
    before = good.snapshot()
    body = to_json_bytes(body_for(CHAT, tools=minimal_tools(TOOL_BOMB_TOOLS)))
    assert 700_000 < len(body) < DEFAULT_MAX_BODY_BYTES
    answer: dict[str, httpx.Response] = {}

    def bomb() -> None:
        answer["r"] = httpx.post(
            f"{live.url}{CHAT}", content=body, headers=JSON_HEADERS, timeout=60
        )

    thread = threading.Thread(target=bomb)
    health = []
    with httpx.Client(base_url=live.url, timeout=60) as client:
        thread.start()
        while thread.is_alive():
            start = time.perf_counter()
            assert client.get("/health").status_code == 200
            health.append(time.perf_counter() - start)
        thread.join()
    tally.record("http strict", body, str(answer["r"].status_code))
    assert_400_naming(answer["r"], "tools")
    assert max(health) < HEALTH_WORST_BOUND_S, (
        f"/health took up to {max(health):.2f} s during a tool bomb"
    )
    good.check_since(before)


@pytest.mark.parametrize(
    "path, body, param",
    [
        (COMPLETIONS, {"prompt": "\ud800", "max_tokens": 2}, "prompt"),
        (COMPLETIONS, {"prompt": ["a\udfffb"], "max_tokens": 2}, "prompt"),
        (
            CHAT,
            {"messages": [{"role": "user", "content": "x\udc00y"}], "max_tokens": 2},
            "messages",
        ),
    ],
    ids=["prompt", "prompt-list", "chat"],
)
def test_text_with_lone_surrogates_is_400(live, good, tally, path, body, param):
    """A lone UTF-16 half is a legal JSON escape but not Unicode text: tokenizers refuse it, and
    the client hears why (a 400), not a 500."""
    before = good.snapshot()
    raw = to_json_bytes(body)
    r = httpx.post(
        f"{live.url}{path}", content=raw, headers=JSON_HEADERS, timeout=REQUEST_TIMEOUT_S
    )
    tally.record("http strict", raw, str(r.status_code))
    assert_400_naming(r, param)
    good.check_since(before)
