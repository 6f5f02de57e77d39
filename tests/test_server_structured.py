"""Structured output over HTTP and the WebSocket: OpenAI's `response_format`, vLLM's
`structured_outputs` and `guided_*` fields, driven with the `openai` client against the real app
(uvicorn on a free loopback port) serving a tiny random model. The grammar guarantees the shape of
what a random model writes, so every output is checked against its schema with `jsonschema`.
Bad constraints are 400s naming the field, compiled before the engine sees the request.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time

import httpx
import jsonschema
import openai
import pytest

from tests.conftest import make_tiny_llama

MODEL = "tiny"
CHAT_TEMPLATE = (  # a ChatML template that, like SmolLM2's, ignores `tools=`
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
USER = [{"role": "user", "content": "What is the weather like in Paris?"}]
# Bounded so a random model's output always ends well inside max_tokens.
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "days", "unit"],
    "additionalProperties": False,
}


def save_byte_tokenizer(path, chat_template: str = CHAT_TEMPLATE) -> int:
    """A byte-level BPE tokenizer without merges (one token per byte, so any text, JSON included,
    can be written); returns its vocabulary size. `</s>` (id 2) is EOS, as in the tiny model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for ch in sorted(ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.chat_template = chat_template
    fast.save_pretrained(path)
    return len(vocab)


def tiny_byte_llm(path):
    from minivllm_jax import LLM

    vocab = save_byte_tokenizer(path)
    # A few ids the tokenizer lacks (never allowed by a grammar); positions for long tool prompts.
    make_tiny_llama(path, vocab_size=vocab + 5, max_position_embeddings=2048)
    # One byte a token: a prompt with the tools instruction is about 1,300 tokens.
    return LLM(
        str(path),
        max_num_seqs=4,
        max_model_len=2048,
        page_size=16,
        num_pages=400,
        enable_prefix_caching=False,
        warmup=False,
        use_tqdm=False,
    )


class LiveServer:
    """The app on uvicorn in a background thread, on a free loopback port."""

    def __init__(self, llm) -> None:
        import uvicorn

        from server.app import create_app

        self.llm = llm
        self.app = create_app(llm, model_name=MODEL)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self._server = uvicorn.Server(
            uvicorn.Config(self.app, host="127.0.0.1", port=port, log_level="warning")
        )
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self._server.started:
            assert self._thread.is_alive() and time.monotonic() < deadline, (
                "the server did not start"
            )
            time.sleep(0.05)

    @property
    def state(self):
        return self.app.state.minivllm

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=120
        )

    def post(self, path: str, body: dict) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", json=body, timeout=120)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(30)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    server = LiveServer(tiny_byte_llm(tmp_path_factory.mktemp("structured") / "tiny"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(live):
    return live.client()


def wait_idle(live: LiveServer) -> None:
    """Every request finished and its pages came back."""
    deadline = time.monotonic() + 30
    bm = live.llm.engine.page_manager
    while live.state.engine.num_in_flight or bm.num_free_pages != bm.num_usable_pages:
        assert time.monotonic() < deadline, "requests still in flight"
        time.sleep(0.05)


# ---------------------------------------------------------------------- response_format


def test_response_format_json_schema_validates_streaming_and_not(client):
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "weather", "schema": WEATHER, "strict": True},
    }
    full = client.chat.completions.create(
        model=MODEL, messages=USER, response_format=fmt, max_tokens=200, temperature=0
    )
    choice = full.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    jsonschema.validate(json.loads(choice.message.content), WEATHER)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=USER,
            response_format=fmt,
            max_tokens=200,
            temperature=0,
            stream=True,
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["stop"]
    sampled = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        response_format=fmt,
        max_tokens=200,
        temperature=1.0,
        n=3,
        seed=7,
    )
    for c in sampled.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), WEATHER)


def test_response_format_json_object_and_text(client):
    # Greedy, so that it ends: sampling, a random model writes an object of random keys until max_tokens.
    out = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        response_format={"type": "json_object"},
        max_tokens=100,
        temperature=0,
    )
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(out.choices[0].message.content), dict)
    plain = client.chat.completions.create(
        model=MODEL, messages=USER, response_format={"type": "text"}, max_tokens=8, temperature=0
    )
    same = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=8, temperature=0)
    assert plain.choices[0].message.content == same.choices[0].message.content


# ---------------------------------------------------------------------- vLLM's fields, both endpoints


def test_completions_take_vllm_constraints_and_response_format(client):
    choices = ["sunny", "rainy", "cloudy"]
    out = client.completions.create(
        model=MODEL,
        prompt="The weather:",
        max_tokens=20,
        temperature=1.0,
        n=4,
        seed=1,
        extra_body={"guided_choice": choices},
    )
    assert all(c.text in choices and c.finish_reason == "stop" for c in out.choices)
    out = client.completions.create(
        model=MODEL,
        prompt="Call me at",
        max_tokens=30,
        temperature=0,
        extra_body={"structured_outputs": {"regex": r"\+33 [1-9]( \d\d){4}"}},
    )
    assert re.fullmatch(r"\+33 [1-9]( \d\d){4}", out.choices[0].text), out.choices[0].text
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}
    out = client.completions.create(
        model=MODEL,
        prompt="Weather as JSON:",
        max_tokens=200,
        temperature=0,
        extra_body={"response_format": fmt},
    )
    jsonschema.validate(json.loads(out.choices[0].text), WEATHER)
    grammar = 'start: "The answer is " NUMBER "."\nNUMBER: /[0-9]{1,3}/'
    out = client.completions.create(
        model=MODEL,
        prompt="Q:",
        max_tokens=30,
        temperature=0,
        extra_body={"guided_grammar": grammar},
    )
    assert re.fullmatch(r"The answer is [0-9]{1,3}\.", out.choices[0].text), out.choices[0].text
    chat = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        max_tokens=200,
        temperature=0,
        extra_body={"guided_json": WEATHER},
    )
    jsonschema.validate(json.loads(chat.choices[0].message.content), WEATHER)


def test_websocket_request_takes_a_constraint(live):
    import websockets

    async def main():
        async with websockets.connect(live.url.replace("http", "ws") + "/v1/stream") as ws:
            await ws.send(
                json.dumps({"messages": USER, "max_tokens": 20, "guided_choice": ["yes", "no"]})
            )
            text, msg = "", json.loads(await ws.recv())
            while msg["type"] == "token":
                text += msg["text"]
                msg = json.loads(await ws.recv())
            await ws.send(json.dumps({"prompt": "x", "guided_regex": "a(b"}))
            return text, msg, json.loads(await ws.recv())

    text, done, error = asyncio.run(asyncio.wait_for(main(), 120))
    assert text in ("yes", "no") and done["type"] == "done" and done["finish_reason"] == "stop"
    assert error["type"] == "error" and error["status"] == 400 and error["param"] == "guided_regex"


def test_a_constraint_compiles_once_before_the_engine_gets_it(live, client):
    compiler = live.llm.engine.grammar_compiler
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["n"],
        "additionalProperties": False,
    }
    before = compiler.num_compiled
    for _ in range(2):
        out = client.chat.completions.create(
            model=MODEL,
            messages=USER,
            max_tokens=20,
            temperature=0,
            extra_body={"guided_json": schema},
        )
        jsonschema.validate(json.loads(out.choices[0].message.content), schema)
    assert (
        compiler.num_compiled == before + 1
    )  # the server's compile; the engine and the repeat hit the cache


# ---------------------------------------------------------------------- errors


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}
BAD_CONSTRAINTS = [
    (
        "bad json schema",
        {
            "messages": USER,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "foo"}},
            },
        },
        "response_format",
    ),
    ("schema ref to nowhere", {"messages": USER, "guided_json": {"$ref": "#/nope"}}, "guided_json"),
    ("bad regex", {"messages": USER, "structured_outputs": {"regex": "a(b"}}, "structured_outputs"),
    (
        "bad grammar",
        {"messages": USER, "guided_grammar": "start: undefined_rule"},
        "guided_grammar",
    ),
    (
        "json_schema without schema",
        {"messages": USER, "response_format": {"type": "json_schema"}},
        "response_format.json_schema",
    ),
    (
        "two constraints",
        {"messages": USER, "response_format": {"type": "json_object"}, "guided_choice": ["a"]},
        "guided_choice",
    ),
    (
        "two kinds in structured_outputs",
        {"messages": USER, "structured_outputs": {"regex": "a", "choice": ["a"]}},
        "structured_outputs",
    ),
    ("empty choice", {"messages": USER, "guided_choice": []}, "guided_choice"),
    (
        "unknown tool name",
        {
            "messages": USER,
            "tools": [TOOL],
            "tool_choice": {"type": "function", "function": {"name": "get_time"}},
        },
        "tool_choice",
    ),
    (
        "tool with a bad schema",
        {
            "messages": USER,
            "tools": [
                TOOL,
                {
                    "type": "function",
                    "function": {
                        "name": "broken",
                        "parameters": {"type": "object", "properties": {"a": {"type": "nope"}}},
                    },
                },
            ],
        },
        "tools.1.function.parameters",
    ),
    ("tool_choice without tools", {"messages": USER, "tool_choice": "required"}, "tool_choice"),
    (
        "forced call and a format",
        {
            "messages": USER,
            "tools": [TOOL],
            "tool_choice": "required",
            "response_format": {"type": "json_object"},
        },
        "response_format",
    ),
    (
        "beam search with a format",
        {"messages": USER, "use_beam_search": True, "n": 2, "guided_regex": "a"},
        "guided_regex",
    ),
]


@pytest.mark.parametrize("name, body, param", BAD_CONSTRAINTS, ids=[c[0] for c in BAD_CONSTRAINTS])
def test_bad_constraints_are_400_naming_the_field(live, name, body, param):
    r = live.post("/v1/chat/completions", body)
    err = r.json()["error"]
    assert (
        r.status_code == 400 and err["param"] == param and err["type"] == "invalid_request_error"
    ), r.text
    assert err["message"]
    wait_idle(live)  # refused before the engine: nothing admitted, nothing leaked


def test_openai_client_sees_the_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(
            model=MODEL, prompt="x", max_tokens=5, extra_body={"guided_regex": "(("}
        )
    assert e.value.status_code == 400 and e.value.body["param"] == "guided_regex"
    assert "regex" in e.value.body["message"]
