"""Tool calling for `/v1/chat/completions`: the prompt for templates that ignore `tools=`, the
JSON schema that forces a call, and the parser that turns model output into OpenAI `tool_calls`.

One parser serves both answers: `ToolCallParser` reads the output as it grows and emits events
(content pieces, a call's header, pieces of its arguments), which the streaming formatter sends
as `delta` chunks and the JSON formatter joins into one message. So a streamed answer and a
non-streamed one always carry the same calls and arguments.

Modes (`ToolPlan.mode`), from `tool_choice`:
- "auto": the model may answer in text or call tools in Hermes form
  (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, as Hermes/Qwen templates teach);
  an output that is only a JSON object or list of calls ("bare JSON") is read as calls too.
  With `parallel_tool_calls: false` only the first call is returned (the rest are dropped).
- "named": structured output forces the function's `parameters` schema, so the whole output is
  the arguments of that one call.
- "required": structured output forces vLLM's schema, a JSON array (at least one item) of
  `{"name": <one of the tools>, "parameters": <that tool's schema>}`. Chosen over a Lark grammar
  of Hermes tags because every structured-output backend takes a JSON schema, `anyOf` ties each
  name to its own parameters schema, and the array is read with a small JSON scanner.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import uuid
from collections.abc import Collection
from typing import Any, Literal

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}

# ---------------------------------------------------------------------- the plan and the forced schema


@dataclasses.dataclass(frozen=True)
class ToolPlan:
    """How one request uses its tools: `tools` are OpenAI tool dicts (`{"type": "function",
    "function": {...}}`), `name` the function a named `tool_choice` forces."""

    mode: Literal["auto", "named", "required"]
    tools: tuple[dict[str, Any], ...]
    name: str | None = None
    parallel: bool = True

    @functools.cached_property
    def functions(self) -> dict[str, dict[str, Any]]:
        """Each tool's function by name (built once: lookups by name are O(1))."""
        return {t["function"]["name"]: t["function"] for t in self.tools}

    @property
    def names(self) -> list[str]:
        return list(self.functions)

    def parameters(self, name: str) -> dict[str, Any]:
        return self.functions[name].get("parameters") or EMPTY_PARAMETERS

    def forced_parameters(self, name: str) -> dict[str, Any]:
        """The arguments schema a forced call follows: the tool's, with OpenAI strict mode's rule
        that an object takes no properties it does not list (`closed_objects`)."""
        return closed_objects(self.parameters(name))

    def calls_schema(self) -> dict[str, Any]:
        """vLLM's schema for `tool_choice: "required"`: a non-empty array of calls, each naming a
        tool and carrying arguments that follow that tool's schema (one call without `parallel`).
        Unlike vLLM's, a call has no other keys: without that a model may write more keys of any
        length after the arguments."""
        items = [
            {
                "properties": {
                    "name": {"type": "string", "enum": [n]},
                    "parameters": self.forced_parameters(n),
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for n in self.names
        ]
        schema: dict[str, Any] = {
            "type": "array",
            "minItems": 1,
            "items": {"type": "object", "anyOf": items},
        }
        if not self.parallel:
            schema["maxItems"] = 1
        return schema

    def forced_schema(self) -> dict[str, Any] | None:
        """The JSON schema the output must follow, or None when the model chooses (auto)."""
        if self.mode == "named":
            assert self.name is not None
            return self.forced_parameters(self.name)
        if self.mode == "required":
            return self.calls_schema()
        return None


def closed_objects(schema: Any) -> Any:
    """`schema` with `"additionalProperties": false` on every object schema that does not say
    (nested ones too). JSON schema allows any extra key by default, and a small model forced into
    an open object writes extra keys (of any length) until `max_tokens`, as seen on SmolLM2."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed_objects(v) if k in _SUBSCHEMAS else v for k, v in schema.items()}
    if "properties" in out:
        out["properties"] = {k: closed_objects(v) for k, v in out["properties"].items()}
    for key in ("$defs", "definitions"):
        if isinstance(out.get(key), dict):
            out[key] = {k: closed_objects(v) for k, v in out[key].items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


_SUBSCHEMAS = ("items", "anyOf", "oneOf", "allOf", "not", "prefixItems")


# ---------------------------------------------------------------------- prompts for templates without tools


def tools_instruction(tools: list[dict[str, Any]], parallel: bool = True) -> str:
    """A Hermes-style system prompt listing the tools and the call format, for chat templates that
    ignore `tools=` (SmolLM2's does)."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    how_many = (
        "one or more <tool_call></tool_call> blocks"
        if parallel
        else "one <tool_call></tool_call> block"
    )
    return (
        "You may call functions to answer the user. The functions are listed, as JSON, inside "
        f"<tools></tools>:\n<tools>\n{listed}\n</tools>\n"
        f"To call a function, reply with {how_many}, each holding a JSON object with the function's "
        f'name and arguments:\n{CALL_OPEN}\n{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}\n'
        f"{CALL_CLOSE}\nFunction results come back inside <tool_response></tool_response>. "
        "If no function fits, answer in plain text."
    )


def format_call(name: str, arguments: Any) -> str:
    """One call in the Hermes form the instruction asks for."""
    return f"{CALL_OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{CALL_CLOSE}"


def messages_without_tool_support(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, parallel: bool = True
) -> list[dict[str, Any]]:
    """Rewrite a conversation for a template that knows only text: the tools instruction goes into
    the system prompt, an assistant's `tool_calls` become Hermes `<tool_call>` text, and tool
    results become a user turn of `<tool_response>` blocks (consecutive results share one turn,
    so templates that insist on alternating roles still accept it)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role = m["role"]
        if role == "assistant" and m.get("tool_calls"):
            calls = [
                format_call(c["function"]["name"], c["function"]["arguments"])
                for c in m["tool_calls"]
            ]
            text = "\n".join(([m["content"]] if m.get("content") else []) + calls)
            out.append({"role": "assistant", "content": text})
        elif role == "tool":
            block = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if out and out[-1].get("tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "tool_results": True})
        else:
            out.append({"role": role, "content": m.get("content") or ""})
    if tools:
        instruction = tools_instruction(tools, parallel)
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{instruction}"
        else:
            out.insert(0, {"role": "system", "content": instruction})
    return [{"role": m["role"], "content": m["content"]} for m in out]


# ---------------------------------------------------------------------- the parser


@dataclasses.dataclass(frozen=True)
class Content:
    text: str


@dataclasses.dataclass(frozen=True)
class CallStart:
    index: int  # the call's position among this choice's calls
    id: str
    name: str


@dataclasses.dataclass(frozen=True)
class CallArguments:
    index: int
    text: str  # the next piece of the call's JSON arguments


Event = Content | CallStart | CallArguments


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_call(body: str, names: Collection[str]) -> tuple[str, str] | None:
    """One Hermes call body -> (name, arguments as a JSON string), or None when it is not a call
    to a known tool. `arguments` may be an object or a JSON string; `parameters` is accepted too."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if (
        not isinstance(obj, dict)
        or not isinstance(obj.get("name"), str)
        or obj["name"] not in names
    ):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


def parse_bare_calls(text: str, names: Collection[str]) -> list[tuple[str, str]] | None:
    """An output that is nothing but a call object or a list of them (what small models often
    write instead of tags), or None."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    items = obj if isinstance(obj, list) else [obj]
    calls = [parse_call(json.dumps(item), names) for item in items]
    if not calls or any(c is None for c in calls):
        return None
    return calls  # type: ignore[return-value]


class ToolCallParser:
    """Reads one choice's output as it grows (`feed`), then `finish`es it; both return events.

    In "auto" mode, text outside the tags streams as content, except what could still become a
    tag (a partial `<tool_call>` and whitespace just before one), which is held back; a call is
    emitted once its closing tag arrives. A block that is not a valid call to a known tool is
    returned as the text it was. An output that starts with `{` or `[` is held to the end and
    read as bare JSON calls, else as content. With no calls, the content is the output exactly;
    with calls, whitespace next to a call is dropped unless it separates two pieces of text.
    """

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.num_calls = 0
        self._state = "start"  # auto: start | text | call | bare | after
        self._held = ""  # auto: text not yet sent; inside a call, the call's body
        self._space = ""  # auto: the whitespace just before the open tag
        self._wrote_text = False  # auto: some content went out
        self._scanner = _CallsScanner(self) if plan.mode == "required" else None

    def feed(self, text: str) -> list[Event]:
        if self.plan.mode == "named":
            events: list[Event] = []
            if self.num_calls == 0:
                events.append(self._start(self.plan.name or ""))
            if text:
                events.append(CallArguments(0, text))
            return events
        if self._scanner is not None:
            return self._scanner.feed(text)
        return self._feed_auto(text)

    def finish(self) -> list[Event]:
        """Flush what was held back at the end of the output."""
        if self.plan.mode == "named":
            return self.feed("") if self.num_calls == 0 else []
        if self._scanner is not None:
            return self._scanner.finish()
        held, self._held = self._held, ""
        if self._state == "bare":
            calls = parse_bare_calls(held, self.plan.functions)
            if calls is not None:
                return [e for name, args in calls for e in self._call(name, args)]
        if self._state == "call":  # unclosed: the model stopped right after the call
            call = parse_call(held, self.plan.functions)
            return self._call(*call) if call else [Content(self._space + CALL_OPEN + held)]
        return [Content(held)] if held and self._state != "after" else []

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's "tool_calls" when the output ended by itself after calling tools."""
        return "tool_calls" if reason == "stop" and self.num_calls else reason

    # ------------------------------------------------------------------ internals

    def _start(self, name: str) -> CallStart:
        self.num_calls += 1
        return CallStart(self.num_calls - 1, new_call_id(), name)

    def _call(self, name: str, arguments: str) -> list[Event]:
        if (
            not self.plan.parallel and self.num_calls
        ):  # parallel_tool_calls: false: the first call only
            return []
        start = self._start(name)
        return [start, CallArguments(start.index, arguments)]

    def _text(self, events: list[Event], text: str) -> None:
        if text:
            events.append(Content(text))
            self._wrote_text = True

    def _feed_auto(self, text: str) -> list[Event]:
        events: list[Event] = []
        self._held += text
        while self._held:
            if self._state == "start":
                stripped = self._held.lstrip()
                if not stripped:
                    break
                self._state = "bare" if stripped[0] in "{[" else "text"
            elif self._state == "bare":
                break
            elif self._state == "after":  # whitespace after a call: kept only between two texts
                if not self._held.strip():
                    break
                self._held = self._held if self._wrote_text else self._held.lstrip()
                self._state = "text"
            elif self._state == "call":
                end = self._held.find(CALL_CLOSE)
                if end < 0:
                    break
                body, self._held = self._held[:end], self._held[end + len(CALL_CLOSE) :]
                call = parse_call(body, self.plan.functions)
                if call:
                    events += self._call(*call)
                    self._state = "after"
                else:
                    self._text(events, self._space + CALL_OPEN + body + CALL_CLOSE)
                    self._state = "text"
            else:  # text
                start = self._held.find(CALL_OPEN)
                if start >= 0:
                    before_tag = self._held[:start].rstrip()
                    self._text(events, before_tag)
                    # Whitespace before a call is dropped, unless the block turns out not to be a call.
                    self._space = self._held[len(before_tag) : start]
                    self._held, self._state = self._held[start + len(CALL_OPEN) :], "call"
                    continue
                keep = _held_back(self._held)
                if keep < len(self._held):
                    self._text(events, self._held[: len(self._held) - keep])
                    self._held = self._held[len(self._held) - keep :]
                break
        return _merge(events)


def _held_back(text: str) -> int:
    """How many trailing characters of `text` could still be whitespace before a call or the
    start of `<tool_call>`."""
    for k in range(min(len(CALL_OPEN) - 1, len(text)), 0, -1):
        if CALL_OPEN.startswith(text[-k:]):
            return k + len(text[:-k]) - len(text[:-k].rstrip())
    return len(text) - len(text.rstrip())


def _merge(events: list[Event]) -> list[Event]:
    """Join neighbouring content pieces (one chunk each, not one per rule above)."""
    out: list[Event] = []
    for e in events:
        if isinstance(e, Content) and out and isinstance(out[-1], Content):
            out[-1] = Content(out[-1].text + e.text)
        elif not (isinstance(e, Content) and not e.text):
            out.append(e)
    return out


def message_parts(events: list[Event]) -> tuple[str, list[dict[str, Any]]]:
    """All of one choice's events -> (content, OpenAI `tool_calls`) for a JSON response."""
    content, calls = "", []
    for e in events:
        if isinstance(e, Content):
            content += e.text
        elif isinstance(e, CallStart):
            calls.append(
                {"id": e.id, "type": "function", "function": {"name": e.name, "arguments": ""}}
            )
        else:
            calls[e.index]["function"]["arguments"] += e.text
    return content, calls


def delta_messages(events: list[Event]) -> list[dict[str, Any]]:
    """Events -> OpenAI stream `delta`s: content pieces as `{"content": ...}`; a call as
    `{"tool_calls": [{index, id, type, function: {name, arguments: ""}}]}` followed by
    `{"tool_calls": [{index, function: {arguments: piece}}]}` deltas."""
    deltas: list[dict[str, Any]] = []
    for e in events:
        if isinstance(e, Content):
            deltas.append({"content": e.text})
        elif isinstance(e, CallStart):
            function = {"name": e.name, "arguments": ""}
            deltas.append(
                {
                    "tool_calls": [
                        {"index": e.index, "id": e.id, "type": "function", "function": function}
                    ]
                }
            )
        else:
            deltas.append({"tool_calls": [{"index": e.index, "function": {"arguments": e.text}}]})
    return deltas


class _CallsScanner:
    """Incremental reader of the "required" output, `[{"name": "f", "parameters": {...}}, ...]`:
    a call's header goes out once its name is complete, its arguments as the parameters value
    streams (held until the name is known, should the keys come the other way round)."""

    def __init__(self, parser: ToolCallParser) -> None:
        self.parser = parser
        self.depth = 0  # nesting depth: 1 inside the array, 2 inside a call object
        self.in_string = self.escape = False
        self.string = ""  # the string being read at call-object level (a key or the name)
        self.key: str | None = None  # the last key read in the call object
        self.expect_value = False  # after a key's ':' at call-object level
        self.value_key: str | None = None  # the key whose value is being read
        self.name: str | None = None
        self.args = ""  # arguments not yet sent
        self.args_depth = 0
        self.index: int | None = None  # the call being read, once its header is out
        self.scalar = False  # a parameters value that is not an object/array/string
        self.early_args = ""  # a whole parameters value read before the call's name
        self.value_started = False  # inside the parameters value (its first character was read)

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        for ch in text:
            self._char(ch, events)
        if (
            self.index is not None
            and self.args
            and self.value_key == "parameters"
            and not self.scalar
        ):
            events.append(CallArguments(self.index, self.args))
            self.args = ""
        return _merge(events)

    def finish(self) -> list[Event]:
        events: list[Event] = []
        if self.value_key == "parameters":  # cut off inside the arguments
            self._end_value(events)
        return events

    def _char(self, ch: str, events: list[Event]) -> None:
        if self.value_key == "parameters":
            self._parameters_char(ch, events)
            return
        if self.in_string:
            if self._closes_string(ch):
                try:
                    value = json.loads(f'"{self.string}"')
                except ValueError:  # the grammar writes valid JSON; anything else names no tool
                    value = ""
                self._string_done(value, events)
                return
            self.string += ch
            return
        if ch.isspace():
            return
        if self.depth == 0:
            self.depth = 1 if ch == "[" else 0
        elif self.depth == 1:
            if ch == "{":
                self.depth, self.key, self.name, self.index, self.early_args = (
                    2,
                    None,
                    None,
                    None,
                    "",
                )
            elif ch == "]":
                self.depth = 0
        elif self.expect_value and self.key == "parameters":
            self.expect_value, self.value_key = False, "parameters"
            self._parameters_char(ch, events)
        elif ch == '"':
            self.in_string, self.string = True, ""
        elif ch == ":":
            self.expect_value = True
        elif ch == "}":
            self.depth = 1

    def _closes_string(self, ch: str) -> bool:
        """Inside a JSON string: whether `ch` ends it (a quote not escaped)."""
        if self.escape:
            self.escape = False
        elif ch == "\\":
            self.escape = True
        elif ch == '"':
            self.in_string = False
            return True
        return False

    def _string_done(self, value: str, events: list[Event]) -> None:
        if not self.expect_value:
            self.key = value
            return
        self.expect_value = False
        if self.key == "name":
            self.name = value
            self._header(events)

    def _header(self, events: list[Event]) -> None:
        if self.index is None and self.name is not None:
            start = self.parser._start(self.name)
            self.index = start.index
            events.append(start)
            if self.early_args:
                events.append(CallArguments(start.index, self.early_args))
                self.early_args = ""

    def _parameters_char(self, ch: str, events: list[Event]) -> None:
        if not self.value_started:
            self.value_started, self.scalar = True, ch not in '{["'
            self.in_string = self.escape = False
        if self.scalar:
            if ch in ",}" or ch.isspace():
                self._end_value(events)
                self._char(ch, events)
                return
            self.args += ch
            return
        self.args += ch
        if self.in_string:
            if self._closes_string(ch) and self.args_depth == 0:
                self._end_value(events)
        elif ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.args_depth += 1
        elif ch in "}]":
            self.args_depth -= 1
            if self.args_depth == 0:
                self._end_value(events)

    def _end_value(self, events: list[Event]) -> None:
        self.value_key, self.key, self.in_string, self.value_started = None, None, False, False
        pending, self.args, self.args_depth, self.scalar = self.args, "", 0, False
        if self.name is None:  # parameters came first: wait for the name
            self.early_args = pending
            return
        self._header(events)
        if pending and self.index is not None:
            events.append(CallArguments(self.index, pending))
