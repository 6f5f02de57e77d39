"""Tool calling in `/v1/chat/completions` (`server/tool_calls.py` and its wiring).

- The parser on canned outputs (Hermes tags, bare JSON, the forced "required" array, named
  calls), fed whole and in every split, so streaming and non-streaming answers agree.
- The prompt: templates that take `tools=` get them; others (SmolLM2's) get the Hermes-style
  system instruction, and the conversation's calls and tool results are written out as text.
- With the `openai` client against the real app: forced calls (named and "required", streaming
  and not) on a tiny random model, whose arguments the grammar makes valid against the tool's
  schema; a conversation with a tool result; "auto" on a stand-in engine that writes canned
  replies, so the parse of a known output is checked end to end.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from minivllm_jax.outputs import CompletionOutput, RequestMetrics, RequestOutput
from server.preprocess import Preprocessor
from server.protocol import APIError, ChatCompletionRequest, parse_request
from server.tool_calls import (
    CALL_OPEN,
    CallArguments,
    CallStart,
    Content,
    ToolCallParser,
    ToolPlan,
    closed_objects,
    delta_messages,
    message_parts,
    messages_without_tool_support,
)
from tests.conftest import requires_smollm2
from tests.test_server_structured import (
    CHAT_TEMPLATE,
    MODEL,
    USER,
    WEATHER,
    LiveServer,
    save_byte_tokenizer,
    tiny_byte_llm,
    wait_idle,
)
from tests.test_server_units import FakeEngine, FakeTokenizer

ADD = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 99},
        "b": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": WEATHER,
        },
    },
    {
        "type": "function",
        "function": {"name": "add", "description": "Add two numbers", "parameters": ADD},
    },
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
AUTO = ToolPlan("auto", tuple(TOOLS))


def parse(plan: ToolPlan, text: str, step: int | None = None, reason: str = "stop"):
    """Feed `text` whole (step None) or in pieces of `step` characters; (content, calls, finish)."""
    parser = ToolCallParser(plan)
    step = step or max(len(text), 1)
    events = [
        e for i in range(0, len(text), step) for e in parser.feed(text[i : i + step])
    ] + parser.finish()
    content, calls = message_parts(events)
    return (
        content,
        [(c["function"]["name"], c["function"]["arguments"]) for c in calls],
        parser.finish_reason(reason),
    )


# ---------------------------------------------------------------------- the parser ("auto")

CANNED = [  # (output, content, calls)
    ("The weather is fine.", "The weather is fine.", []),
    (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 1, "unit": "celsius"}}'
        "\n</tool_call>\n",
        "Let me check.",
        [("get_weather", {"city": "Paris", "days": 1, "unit": "celsius"})],
    ),
    (
        '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n<tool_call>{"name": "add", '
        '"arguments": "{\\"a\\": 3, \\"b\\": 4}"}</tool_call>',
        "",
        [("add", {"a": 1, "b": 2}), ("add", {"a": 3, "b": 4})],
    ),
    ('{"name": "add", "arguments": {"a": 5, "b": 6}}', "", [("add", {"a": 5, "b": 6})]),
    (
        '  [{"name": "add", "parameters": {"a": 7, "b": 8}}, {"name": "get_weather", "arguments": {"city": "Oslo"}}]',
        "",
        [("add", {"a": 7, "b": 8}), ("get_weather", {"city": "Oslo"})],
    ),
    (
        'Sure: <tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}',
        "Sure:",
        [("add", {"a": 1, "b": 1})],
    ),  # unclosed
    (
        'Before <tool_call>{"name": "add", "arguments": {"a": 2, "b": 2}}</tool_call> after',
        "Before after",
        [("add", {"a": 2, "b": 2})],
    ),
    ("a < b and <tool", "a < b and <tool", []),  # looks like a tag, never becomes one
    (
        'Use <tool_call>{"name": "delete_all", "arguments": {}}</tool_call> no',
        'Use <tool_call>{"name": "delete_all", "arguments": {}}</tool_call> no',
        [],
    ),  # unknown function: not a call
    ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
    ('{"city": "Paris"}', '{"city": "Paris"}', []),  # JSON, but no call
    ("\n\n", "\n\n", []),
]


@pytest.mark.parametrize("output, content, calls", CANNED)
def test_auto_parses_canned_outputs_whole_and_in_every_split(output, content, calls):
    for step in [None, *range(1, 12)]:
        got_content, got_calls, reason = parse(AUTO, output, step)
        assert got_content == content, (step, got_content)
        assert [(n, json.loads(a)) for n, a in got_calls] == calls, step
        assert reason == ("tool_calls" if calls else "stop")
    assert parse(AUTO, output, 1, reason="length")[2] == "length"  # cut off: not "tool_calls"


def test_streamed_content_never_shows_call_markup():
    output = 'Checking.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    for step in range(1, 8):
        parser = ToolCallParser(AUTO)
        pieces = [parser.feed(output[i : i + step]) for i in range(0, len(output), step)] + [
            parser.finish()
        ]
        texts = [e.text for events in pieces for e in events if isinstance(e, Content)]
        assert "".join(texts) == "Checking." and not any("<" in t for t in texts)
        kinds = [type(e) for events in pieces for e in events if not isinstance(e, Content)]
        assert kinds == [CallStart, CallArguments]


def test_delta_messages_are_openai_chunks():
    events = [
        Content("Hi"),
        CallStart(0, "call_x", "add"),
        CallArguments(0, '{"a": '),
        CallArguments(0, "1}"),
    ]
    header = {
        "index": 0,
        "id": "call_x",
        "type": "function",
        "function": {"name": "add", "arguments": ""},
    }
    assert delta_messages(events) == [
        {"content": "Hi"},
        {"tool_calls": [header]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": '}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]},
    ]


# ---------------------------------------------------------------------- forced calls


def test_required_array_streams_arguments_as_they_come():
    plan = ToolPlan("required", tuple(TOOLS))
    args0 = '{"city":"Pa\\"ris}","days":3,"unit":"celsius"}'
    output = f'[{{"name":"get_weather","parameters":{args0}}}, {{"parameters": {{"a": 1, "b": [2]}}, "name": "add"}}]'
    for step in [None, 1, 2, 3, 5, 8]:
        content, calls, reason = parse(plan, output, step)
        assert content == "" and reason == "tool_calls"
        assert calls == [("get_weather", args0), ("add", '{"a": 1, "b": [2]}')], step
    parser = ToolCallParser(plan)
    events = [e for ch in output for e in parser.feed(ch)]
    first_args = [e.text for e in events if isinstance(e, CallArguments) and e.index == 0]
    assert len(first_args) == len(
        args0
    )  # one piece per character fed: streamed, not held to the end
    assert (
        isinstance(events[0], CallStart)
        and events[0].id.startswith("call_")
        and events[0].name == "get_weather"
    )
    head = '[{"name":"get_weather","parameters":'
    _, calls, reason = parse(
        plan, output[: len(head) + 10], 1, reason="length"
    )  # cut off inside the arguments
    assert calls == [("get_weather", args0[:10])] and reason == "length"


def test_named_call_output_is_the_arguments():
    plan = ToolPlan("named", tuple(TOOLS), "add")
    assert parse(plan, '{"a": 4, "b": 5}', 3) == ("", [("add", '{"a": 4, "b": 5}')], "tool_calls")
    assert parse(plan, "", None)[1] == [("add", "")]  # the header still goes out


def test_forced_schemas():
    required = ToolPlan("required", tuple(TOOLS)).forced_schema()
    good = [
        {"name": "add", "parameters": {"a": 1, "b": 2}},
        {"name": "get_weather", "parameters": {"city": "Rome", "days": 2, "unit": "celsius"}},
    ]
    jsonschema.validate(good, required)
    for bad in (
        [],
        [{"name": "add", "parameters": {"city": "Rome", "days": 2, "unit": "celsius"}}],
        [{"name": "nope", "parameters": {}}],
        [{**good[0], "extra": 1}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, required)
    single = ToolPlan("required", tuple(TOOLS), parallel=False).forced_schema()
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good, single)
    assert ToolPlan("named", tuple(TOOLS), "add").forced_schema() == closed_objects(ADD)
    no_params = ToolPlan("named", ({"type": "function", "function": {"name": "ping"}},), "ping")
    assert no_params.forced_schema() == {
        "type": "object",
        "properties": {},
        "additionalProperties": False,
    }
    assert AUTO.forced_schema() is None


# ---------------------------------------------------------------------- requests


def chat(**body) -> ChatCompletionRequest:
    return parse_request(ChatCompletionRequest, {"messages": USER, **body})


def test_tool_choice_maps_to_a_plan_and_a_constraint():
    assert (
        chat(tools=TOOLS).tool_plan().mode == "auto"
        and chat(tools=TOOLS).output_constraint() is None
    )
    none = chat(tools=TOOLS, tool_choice="none")
    assert none.tool_plan() is None and none.offered_tools() is None
    named = chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}})
    assert (named.tool_plan().mode, named.tool_plan().name) == ("named", "add")
    param, spec = named.output_constraint()
    assert (
        param == "tools" and spec.json == ADD and named.sampling_params().structured_outputs == spec
    )
    required = chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert required.output_constraint()[1].json == required.tool_plan().calls_schema()
    assert required.output_constraint()[1].json["maxItems"] == 1
    checked = [p for p, _ in required.constraints_to_check()]
    assert checked == ["tools.0.function.parameters", "tools.1.function.parameters", "tools"]
    # auto + a format: the format wins and the output is not parsed for calls
    fmt = chat(tools=TOOLS, response_format={"type": "json_object"})
    assert fmt.output_constraint()[0] == "response_format" and fmt.parsed_tool_plan() is None


@pytest.mark.parametrize(
    "body, param",
    [
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": TOOLS + TOOLS[:1]}, "tools"),
        (
            {"tools": [{"type": "function", "function": {"name": "has space"}}]},
            "tools.0.function.name",
        ),
        ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
        (
            {"tools": TOOLS, "tool_choice": "required", "guided_json": {"type": "object"}},
            "guided_json",
        ),
        ({"tools": TOOLS, "use_beam_search": True, "n": 2}, "tools"),
        ({"messages": [{"role": "tool", "content": "3"}]}, "messages.0.tool_call_id"),
        (
            {"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]},
            "messages.0.tool_call_id",
        ),
        ({"messages": [{"role": "user", "tool_calls": []}]}, "messages.0.content"),
        (
            {"messages": [{"role": "user", "content": "x", "tool_calls": []}]},
            "messages.0.tool_calls",
        ),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": "c",
                                "type": "function",
                                "function": {"name": "add", "arguments": "{oops"},
                            }
                        ],
                    }
                ]
            },
            "messages.0.tool_calls.0.function.arguments",
        ),
    ],
)
def test_bad_tool_requests_name_the_field(body, param):
    with pytest.raises(APIError) as e:
        parse_request(ChatCompletionRequest, {"messages": USER, **body})
    assert e.value.status == 400 and e.value.param == param, e.value.message


# ---------------------------------------------------------------------- the prompt

HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and 2+3?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            },
            {
                "id": "call_2",
                "type": "function",
                "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "5"},
]


def test_conversation_for_a_template_without_tools():
    req = parse_request(ChatCompletionRequest, {"messages": HISTORY, "tools": TOOLS})
    out = messages_without_tool_support(req.template_messages(), req.offered_tools())
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\n") and "<tools>" in out[0]["content"]
    assert all(json.dumps(t) in out[0]["content"] for t in TOOLS) and CALL_OPEN in out[0]["content"]
    assert out[2]["content"] == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    )
    assert (
        out[3]["content"]
        == "<tool_response>\n18 C, sunny\n</tool_response>\n<tool_response>\n5\n</tool_response>"
    )
    # The assistant's own calls, written this way, parse back to the same calls.
    _, calls, _ = parse(AUTO, out[2]["content"])
    assert calls == [("get_weather", '{"city": "Paris"}'), ("add", '{"a": 2, "b": 3}')]
    no_system = messages_without_tool_support(HISTORY[1:2], TOOLS, parallel=False)
    assert (
        no_system[0]["role"] == "system"
        and "one <tool_call></tool_call> block" in no_system[0]["content"]
    )


TOOLS_TEMPLATE = (  # a template that takes tools= (as Hermes/Qwen ones do), in a few lines
    "{% if tools %}<|tools|>{% for t in tools %}{{ t['function']['name'] }};{% endfor %}{{ '\\n' }}{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{% if m.get('tool_calls') %}{% for c in m['tool_calls'] %}"
    "CALL {{ c['function']['name'] }} {{ c['function']['arguments'] | tojson }}{% endfor %}"
    "{% else %}{{ m['content'] }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def prompt_text(template: str, tmp_path, messages, tools) -> tuple[str, Preprocessor]:
    import asyncio

    from transformers import AutoTokenizer

    save_byte_tokenizer(tmp_path, template)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    pre = Preprocessor(tok, 4096, 4)
    try:
        ids = asyncio.run(pre.chat(messages, tools))
    finally:
        pre.close()
    return tok.decode(ids), pre


def test_template_that_takes_tools_gets_them(tmp_path):
    messages = parse_request(ChatCompletionRequest, {"messages": HISTORY}).template_messages()
    text, pre = prompt_text(TOOLS_TEMPLATE, tmp_path, messages, TOOLS)
    assert (
        pre._takes_tools()
        and text.startswith("<|tools|>get_weather;add;\n")
        and "<tools>" not in text
    )
    assert (
        'CALL get_weather {"city": "Paris"}CALL add {"a": 2, "b": 3}' in text
    )  # arguments as objects
    assert "<|tool|>18 C, sunny\n<|tool|>5\n" in text


def test_template_without_tools_gets_the_instruction(tmp_path):
    messages = parse_request(ChatCompletionRequest, {"messages": HISTORY}).template_messages()
    text, pre = prompt_text(CHAT_TEMPLATE, tmp_path, messages, TOOLS)
    assert not pre._takes_tools()
    expected = (
        "".join(
            f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
            for m in messages_without_tool_support(messages, TOOLS)
        )
        + "<|im_start|>assistant\n"
    )
    assert text == expected
    plain, _ = prompt_text(
        CHAT_TEMPLATE, tmp_path, USER, None
    )  # no tools anywhere: the plain template
    assert plain == f"<|im_start|>user\n{USER[0]['content']}<|im_end|>\n<|im_start|>assistant\n"


@requires_smollm2
def test_smollm2_template_ignores_tools_so_the_instruction_is_used():
    import asyncio

    from transformers import AutoTokenizer

    from minivllm_jax.loading.aliases import alias_source

    path = alias_source("smollm2-135m")
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    pre = Preprocessor(tok, 2048, 16)
    try:
        ids = asyncio.run(pre.chat(USER, TOOLS))
    finally:
        pre.close()
    assert not pre._takes_tools()
    text = tok.decode(ids)
    assert (
        text.startswith("<|im_start|>system\nYou may call functions")
        and json.dumps(TOOLS[0]) in text
    )
    assert "SmolLM" not in text  # our system turn replaces the template's default one


# ---------------------------------------------------------------------- forced calls with the openai client


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    server = LiveServer(tiny_byte_llm(tmp_path_factory.mktemp("tools") / "tiny"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(live):
    return live.client()


def assemble(chunks) -> tuple[str, list[dict], list[str]]:
    """Streamed chunks -> (content, calls, finish reasons), checking each call's first delta
    carries its id, type and name and the later ones only argument pieces."""
    content, calls, reasons = "", {}, []
    for chunk in chunks:
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for tc in choice.delta.tool_calls or []:
            if tc.index not in calls:
                assert tc.id.startswith("call_") and tc.type == "function" and tc.function.name
                calls[tc.index] = {
                    "id": tc.id,
                    "name": tc.function.name,
                    "arguments": tc.function.arguments or "",
                }
            else:
                assert tc.id is None and tc.function.name is None
                calls[tc.index]["arguments"] += tc.function.arguments
        if choice.finish_reason:
            reasons.append(choice.finish_reason)
    return content, [calls[i] for i in sorted(calls)], reasons


def check_calls(message_calls, plain: bool = True) -> None:
    for call in message_calls:
        name, args = (
            (call.function.name, call.function.arguments)
            if plain
            else (call["name"], call["arguments"])
        )
        jsonschema.validate(json.loads(args), SCHEMAS[name])


@pytest.mark.parametrize(
    "tool_choice",
    [{"type": "function", "function": {"name": "get_weather"}}, "required"],
    ids=["named", "required"],
)
def test_forced_call_streaming_and_not(client, tool_choice):
    kw = dict(
        model=MODEL,
        messages=USER,
        tools=TOOLS,
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        max_tokens=300,
        temperature=0,
    )
    full = client.chat.completions.create(**kw)
    choice = full.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    if isinstance(tool_choice, dict):
        assert call.function.name == "get_weather"
    check_calls(choice.message.tool_calls)
    content, calls, reasons = assemble(client.chat.completions.create(**kw, stream=True))
    assert content == "" and reasons == ["tool_calls"]
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (call.function.name, call.function.arguments)
    ]


def test_forced_calls_hold_for_sampled_choices(client):
    out = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        tools=TOOLS,
        tool_choice="required",
        n=3,
        parallel_tool_calls=False,
        max_tokens=300,
        temperature=1.0,
        seed=11,
    )
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        check_calls(choice.message.tool_calls)


def test_conversation_with_a_tool_result(live, client):
    named = {"type": "function", "function": {"name": "add"}}
    first = client.chat.completions.create(
        model=MODEL, messages=USER, tools=TOOLS, tool_choice=named, max_tokens=100, temperature=0
    )
    call = first.choices[0].message.tool_calls[0]
    result = str(sum(json.loads(call.function.arguments).values()))
    messages = [
        *USER,
        first.choices[0].message,
        {"role": "tool", "tool_call_id": call.id, "content": result},
    ]
    second = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=5, temperature=0
    )
    assert (
        second.choices[0].finish_reason in ("stop", "length")
        and not second.choices[0].message.tool_calls
    )
    # The prompt was the conversation written out for this template: the call, then the result.
    tok = live.llm.tokenizer
    function = {"name": "add", "arguments": json.loads(call.function.arguments)}
    as_dicts = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": call.id, "type": "function", "function": function}],
        },
        {"role": "tool", "tool_call_id": call.id, "content": result},
    ]
    expected = tok.apply_chat_template(
        messages_without_tool_support(as_dicts, None), add_generation_prompt=True, tokenize=True
    )
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert second.usage.prompt_tokens == len(expected)
    again = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=300,
        temperature=0,
    )
    check_calls(again.choices[0].message.tool_calls)
    wait_idle(live)


# ---------------------------------------------------------------------- "auto" end to end, on canned replies


class CannedEngine(FakeEngine):
    """Answers each request with the reply whose key appears in its prompt, one character per
    step, then stops as at EOS; records the prompts it got."""

    def __init__(self, replies: dict[str, str]) -> None:
        super().__init__(max_model_len=4096, pages=64, step_seconds=0.0)
        self.replies, self.prompts = replies, []

    def add_request(self, ids, params, *, request_id):
        self.prompts.append("".join(map(chr, ids)))
        return super().add_request(ids, params, request_id=request_id)

    def step(self):
        outputs = []
        for rid, (ids, params, outs) in list(self.requests.items()):
            prompt = "".join(map(chr, ids))
            reply = next(r for key, r in self.replies.items() if key in prompt)
            for out in outs:
                out.append(ord(reply[len(out)]))
            n = len(outs[0])
            reason = "stop" if n == len(reply) else "length" if n >= params.max_tokens else None
            choices = [
                CompletionOutput(i, "".join(map(chr, o)), list(o), 0.0, None, reason)
                for i, o in enumerate(outs)
            ]
            outputs.append(
                RequestOutput(rid, None, ids, choices, reason is not None, RequestMetrics(0.0))
            )
            if reason is not None:
                del self.requests[rid]
        self._sync()
        return outputs


REPLIES = {
    "case:call": 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2, '
    '"unit": "celsius"}}\n</tool_call>',
    "case:two": '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n'
    '<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call>',
    "case:bare": '{"name": "add", "arguments": {"a": 5, "b": 6}}',
    "case:text": "It is sunny <b>today</b>.",
}


@pytest.fixture(scope="module")
def canned():
    from types import SimpleNamespace

    server = LiveServer(SimpleNamespace(engine=CannedEngine(REPLIES), tokenizer=FakeTokenizer()))
    yield server
    server.stop()


@pytest.mark.parametrize(
    "case, content, calls",
    [
        (
            "case:call",
            "Let me check.",
            [("get_weather", {"city": "Paris", "days": 2, "unit": "celsius"})],
        ),
        ("case:two", None, [("add", {"a": 1, "b": 2}), ("add", {"a": 3, "b": 4})]),
        ("case:bare", None, [("add", {"a": 5, "b": 6})]),
        ("case:text", REPLIES["case:text"], []),
    ],
)
def test_auto_through_the_app(canned, case, content, calls):
    client = canned.client()
    kw = dict(
        model=MODEL, messages=[{"role": "user", "content": case}], tools=TOOLS, max_tokens=200
    )
    out = client.chat.completions.create(**kw)
    message, reason = out.choices[0].message, out.choices[0].finish_reason
    assert message.content == content and reason == ("tool_calls" if calls else "stop")
    got = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]
    assert got == calls and len({c.id for c in message.tool_calls or []}) == len(calls)
    streamed, stream_calls, reasons = assemble(client.chat.completions.create(**kw, stream=True))
    assert streamed == (content or "") and "<tool_call>" not in streamed and reasons == [reason]
    assert [(c["name"], json.loads(c["arguments"])) for c in stream_calls] == calls
    prompt = canned.app.state.minivllm.llm.engine.prompts[-1]
    assert prompt.startswith("system: You may call functions") and '"name": "get_weather"' in prompt


def test_tool_choice_none_offers_no_tools_and_parses_nothing(canned):
    client = canned.client()
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "case:call"}],
        tools=TOOLS,
        tool_choice="none",
        max_tokens=200,
    )
    assert (
        out.choices[0].message.content == REPLIES["case:call"]
        and not out.choices[0].message.tool_calls
    )
    assert out.choices[0].finish_reason == "stop"
    assert canned.app.state.minivllm.llm.engine.prompts[-1] == "user: case:call\nassistant: "


def test_forced_calls_close_open_objects():
    """A forced call's arguments take no unlisted keys unless the tool's schema allows them."""
    params = {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "where": {"type": "object", "properties": {"lat": {"type": "number"}}},
            "tags": {
                "type": "array",
                "items": {"type": "object", "properties": {"k": {"type": "string"}}},
            },
            "extra": {"type": "object", "additionalProperties": True},
        },
    }
    closed = closed_objects(params)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["where"]["additionalProperties"] is False
    assert closed["properties"]["tags"]["items"]["additionalProperties"] is False
    assert closed["properties"]["extra"]["additionalProperties"] is True  # said explicitly: kept
    assert "additionalProperties" not in params  # the tool's own schema is not changed
    plan = ToolPlan(
        "named", ({"type": "function", "function": {"name": "f", "parameters": params}},), name="f"
    )
    assert plan.forced_schema() == closed
    required = ToolPlan("required", plan.tools).forced_schema()
    assert required["items"]["anyOf"][0]["properties"]["parameters"] == closed
