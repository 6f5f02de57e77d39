"""OpenAI request schemas (pydantic, strict) and the mapping to `SamplingParams`.

Types and ranges are checked here (strict: no "10" for 10, no NaN or infinity anywhere in a
body, every number inside the range `SamplingParams` declares), and so are the sizes of lists
(tools, messages, choices, schemas) before their items are validated, so a body of any shape
costs work in proportion to what the server accepts; every error names its `param`.
Fields OpenAI clients send that do not change the output (`user`, `metadata`, ...) are accepted
and ignored; fields that would change it but are unsupported must keep their neutral value.
Output constraints (`response_format`, vLLM's `structured_outputs` and older `guided_*` fields)
become one `StructuredOutputsParams`, checked here for shape and compiled by the server before
the request reaches the engine; chat `tools` / `tool_choice` become a `ToolPlan`
(`server/tool_calls.py`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import types
import typing
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    create_model,
    model_validator,
)

from minivllm_jax.engine.decoding.beam_search import BeamSearchParams
from minivllm_jax.engine.kv.pages import MAX_CACHE_SALT_CHARS
from minivllm_jax.sampling_params import (
    RANGES,
    ContextLengthError,
    ParamError,
    Range,
    SamplingParams,
    StructuredOutputsParams,
)
from server.tool_calls import ToolPlan

MAX_N = 16  # choices per request: each one is a sequence in the engine
# Every stop string is searched for in the new text after each token, so both are bounded.
MAX_STOPS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
# Lists whose items each cost validation, template and compile work. Their lengths are checked
# on the raw JSON before any item is validated.
MAX_TOOLS = 128  # OpenAI's limit
# Every message adds at least its role's template tokens (a few), so a conversation of more
# messages than this cannot fit any context this server runs; a bound on the template's work.
MAX_MESSAGES = 2048
MAX_TOOL_CALLS_PER_MESSAGE = 128  # as many as there can be tools to call
MAX_CHOICES = 256  # guided_choice / structured_outputs.choice entries: one grammar alternative each
MAX_CHOICE_CHARS = 1024
# JSON schemas (response_format, guided_json, structured_outputs.json and every tool's
# parameters) are compiled to grammars before admission; their size bounds that work.
MAX_SCHEMA_DEPTH = 64  # nested objects/arrays in one schema
MAX_SCHEMA_NODES = 16384  # JSON values in one field's schemas together (all of `tools` together)
MAX_ABS_LENGTH_PENALTY = (
    10.0  # beam scores divide by length ** length_penalty (a float overflow past it)
)
# A response holds n x (top logprobs + 1) x max_tokens token entries at most (each one a JSON
# object of ~50-100 bytes with logprobs): about 25-50 MB of JSON at this bound.
MAX_RESPONSE_TOKEN_ENTRIES = 1 << 19
# With use_beam_search these would be silently ignored (the search ranks by the model's own
# log-probs and answers one JSON body), so only their neutral value is accepted.
_BEAM_SEARCH_NEUTRAL = (
    "top_p",
    "top_k",
    "min_p",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "stop_token_ids",
    "skip_special_tokens",
    "stream",
    "logprobs",
    "top_logprobs",
    "kv_compression",
)


class APIError(Exception):
    """An error the client caused (or may retry): rendered as OpenAI's `{"error": {...}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type,
            param,
            code,
        )
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class JSONSchemaFormat(_Strict):
    """OpenAI's `response_format.json_schema`. The schema is always enforced, so `strict` changes
    nothing here."""

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _bounded_schema(self) -> JSONSchemaFormat:
        check_schema_size("schema", [self.schema_])
        return self


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise _FieldError(
                "json_schema", 'json_schema is required with type "json_schema", and only with it'
            )
        return self


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs`: exactly one of the constraints."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None  # JSON without free whitespace (default true here)

    @model_validator(mode="before")
    @classmethod
    def _bounded_lists(cls, data: Any) -> Any:
        return _check_raw_lengths(data, {"choice": MAX_CHOICES})

    @model_validator(mode="after")
    def _bounded_choice(self) -> StructuredOutputs:
        _check_choice("choice", self.choice)
        return self

    def params(self) -> dict[str, Any]:
        kw = {
            "json": self.json_,
            "regex": self.regex,
            "choice": self.choice,
            "grammar": self.grammar,
            "json_object": bool(self.json_object),
        }
        if self.disable_any_whitespace is not None:
            kw["disable_any_whitespace"] = self.disable_any_whitespace
        return kw


# ---------------------------------------------------------------------- fields from SamplingParams

_SAMPLING_HINTS = typing.get_type_hints(SamplingParams)
# The JSON form of fields whose Python type also takes objects: the KV compression policy as
# its config's fields, e.g. {"policy": "sink_window", "window_tokens": 512}.
_JSON_FORMS: dict[str, Any] = {"kv_compression": dict[str, Any] | None}
# SamplingParams' fields every request model takes as they are (names, types, defaults and
# ranges all SamplingParams'): OpenAI's and vLLM's (top_k, min_p, repetition_penalty,
# ignore_eos, stop_token_ids, skip_special_tokens, kv_compression). max_tokens and logprobs
# differ by endpoint (defaults, chat's renames); output constraints have their own models.
SAMPLING_FIELDS = tuple(
    f.name
    for f in dataclasses.fields(SamplingParams)
    if f.name not in ("max_tokens", "logprobs", "structured_outputs")
)


def _bounds(allowed: Range, high: float | None) -> dict[str, float]:
    """A `Range` as pydantic bounds (`high` lowers the top: a server limit). A value that turns
    the field off (top_k's -1) widens the bottom to it; SamplingParams refuses what lies between."""
    low = allowed.low if allowed.off is None else min(allowed.low, allowed.off)
    bounds = {"gt" if allowed.low_open and allowed.off is None else "ge": low}
    return {**bounds, "le": allowed.high if high is None else high}


def _bounded(hint: Any, allowed: Range, high: float | None) -> Any:
    """`hint` with each of its numbers (a list's items too) bounded by `allowed`."""
    if hint in (int, float):
        return Annotated[hint, Field(**_bounds(allowed, high))]
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return typing.Union[tuple(_bounded(a, allowed, high) for a in args)]  # noqa: UP007
    if origin is list:
        return list[_bounded(args[0], allowed, high)]
    return hint


def sampling_type(name: str, high: float | None = None) -> Any:
    """The request type of SamplingParams' field `name`: its type (or JSON form), each number
    in it bounded by the field's `RANGES` entry (`high`: a lower top, the server's limit)."""
    hint = _JSON_FORMS.get(name, _SAMPLING_HINTS[name])
    return hint if name not in RANGES else _bounded(hint, RANGES[name], high)


def _sampling_default(name: str) -> Any:
    return next(f.default for f in dataclasses.fields(SamplingParams) if f.name == name)


# Per-endpoint forms of max_tokens and logprobs (chat's max_completion_tokens, top_logprobs).
MaxTokens = sampling_type("max_tokens")
Logprobs = sampling_type("logprobs")

# Each value fits the engine's int32/float32 per-row arrays; `n` is capped lower here (MAX_N).
_SamplingFields = create_model(
    "_SamplingFields",
    __base__=_Strict,
    **{
        name: (sampling_type(name, MAX_N if name == "n" else None), _sampling_default(name))
        for name in SAMPLING_FIELDS
        if name != "stop_token_ids"
    },
    stop_token_ids=(
        sampling_type("stop_token_ids"),
        Field(_sampling_default("stop_token_ids"), max_length=MAX_STOP_TOKEN_IDS),
    ),
)


class _Sampling(_SamplingFields):
    """Fields shared by every generation request (OpenAI names, vLLM extensions): those of
    `SamplingParams` (`SAMPLING_FIELDS`, from `_SamplingFields`) and the server's own."""

    model: str | None = None
    # vLLM extension: prefix-cache pages are shared only between requests of the same salt (and,
    # with several --api-key values, of the same key).
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Accepted and ignored: they never change the output.
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # Would change the output; only the neutral value is accepted.
    logit_bias: dict[str, float] | None = None
    # vLLM extension: beam search, `n` being the beam width (HTTP only, non-streaming).
    use_beam_search: bool = False
    length_penalty: float = Field(1.0, ge=-MAX_ABS_LENGTH_PENALTY, le=MAX_ABS_LENGTH_PENALTY)
    early_stopping: bool | Literal["never"] = False
    # Output constraints: at most one of these per request.
    _constraint: tuple[str, StructuredOutputsParams] | None = PrivateAttr(None)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM
    guided_json: dict[str, Any] | str | None = None  # vLLM's older names
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _bounded_lists(cls, data: Any) -> Any:
        """List lengths on the raw JSON, before their items are validated (the work a body can
        cost is then bounded by what is accepted, not by what was sent)."""
        return _check_raw_lengths(
            data,
            {
                "stop": MAX_STOPS,
                "stop_token_ids": MAX_STOP_TOKEN_IDS,
                "guided_choice": MAX_CHOICES,
                "messages": MAX_MESSAGES,
                "tools": MAX_TOOLS,
            },
        )

    @model_validator(mode="after")
    def _neutral(self) -> _Sampling:
        if self.logit_bias:
            raise _unsupported("logit_bias")
        if self.stream_options is not None and not self.stream:
            raise _FieldError(
                "stream_options", "stream_options is only allowed when stream is true"
            )
        _check_choice("guided_choice", self.guided_choice)
        schemas = [("guided_json", self.guided_json)]
        if self.structured_outputs is not None:
            schemas.append(("structured_outputs.json", self.structured_outputs.json_))
        for param, schema in schemas:
            if isinstance(
                schema, str
            ):  # schema text: StructuredOutputsParams parses it (and says if it can't)
                try:
                    schema = _loads_finite(schema)
                except _NonFinite:
                    raise _FieldError(
                        param, f"{param}: NaN and infinities are not allowed in a schema"
                    ) from None
                except ValueError:
                    continue
                except RecursionError:
                    raise _FieldError(
                        param, f"{param}: the JSON schema is nested too deeply"
                    ) from None
            check_schema_size(param, [schema])
        return self

    @model_validator(mode="after")
    def _one_constraint(self) -> _Sampling:
        found = []
        if self.response_format is not None and self.response_format.type != "text":
            fmt = self.response_format
            spec = (
                {"json": fmt.json_schema.schema_}
                if fmt.json_schema is not None
                else {"json_object": True}
            )
            found.append(("response_format", spec))
        if self.structured_outputs is not None:
            found.append(("structured_outputs", self.structured_outputs.params()))
        for name in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{name}")
            if value is not None:
                found.append((f"guided_{name}", {name: value}))
        if len(found) > 1:
            names = " and ".join(param for param, _ in found)
            raise _FieldError(found[1][0], f"only one output constraint per request; got {names}")
        self._constraint = None
        if found:
            param, spec = found[0]
            try:
                self._constraint = (param, StructuredOutputsParams(**spec))
            except ValueError as e:
                raise _FieldError(param, f"{param}: {_constraint_message(e)}") from None
            if self.use_beam_search:
                raise _unsupported(param, f"{param} is not supported with use_beam_search")
        return self

    def output_constraint(self) -> tuple[str, StructuredOutputsParams] | None:
        """(the field it came from, the constraint) for the output, if the request has one."""
        return self._constraint

    def constraints_to_check(self) -> list[tuple[str, StructuredOutputsParams]]:
        """Every constraint the server compiles before admitting the request (a bad one is a 400
        naming its field)."""
        constraint = self.output_constraint()
        return [constraint] if constraint else []

    @model_validator(mode="after")
    def _bounded_stop(self) -> _Sampling:
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stops) > MAX_STOPS:
            raise _FieldError("stop", f"stop: at most {MAX_STOPS} strings, got {len(stops)}")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise _FieldError(
                "stop", f"stop: each string must be at most {MAX_STOP_CHARS} characters"
            )
        return self

    @model_validator(mode="after")
    def _beam_search_fields(self) -> _Sampling:
        if not self.use_beam_search:
            if self.length_penalty != 1.0 or self.early_stopping is not False:
                param = "length_penalty" if self.length_penalty != 1.0 else "early_stopping"
                raise _FieldError(param, f"{param} only applies with use_beam_search: true")
            return self
        if self.temperature not in (0.0, 1.0):  # vLLM takes it but ranks by raw log-probs too
            raise _FieldError(
                "temperature",
                "with use_beam_search, temperature must be 0 or 1 (the search ranks "
                "by the model's own log-probs)",
            )
        fields = type(self).model_fields
        for name in _BEAM_SEARCH_NEUTRAL:
            if name in fields and getattr(self, name) not in (fields[name].default, None, []):
                raise _unsupported(name, f"{name} is not supported with use_beam_search")
        return self

    def _beam_search_params(
        self, max_tokens: int | None, default_max_tokens: int
    ) -> BeamSearchParams:
        """vLLM's mapping: `n` is the beam width; no max_tokens means `default_max_tokens`."""
        max_tokens = default_max_tokens if max_tokens is None else max_tokens
        try:
            return BeamSearchParams(
                self.n, max_tokens, self.length_penalty, self.early_stopping, self.ignore_eos
            )
        except ValueError as e:
            raise beam_search_error(e) from None

    def sampling_kwargs(self) -> dict[str, Any]:
        """SamplingParams' arguments but max_tokens and logprobs (each endpoint has its own)."""
        constraint = self.output_constraint()
        return {
            **{name: getattr(self, name) for name in SAMPLING_FIELDS},
            "structured_outputs": constraint[1] if constraint else None,
        }

    def field_names(self) -> dict[str, str]:
        """Our parameter names -> the fields this request sent them as (errors name the latter);
        none differ here."""
        return {}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    """`POST /v1/completions`: one prompt (text or token ids) per request."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: MaxTokens = 16
    logprobs: Logprobs = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def _supported(self) -> CompletionRequest:
        if self.echo:
            raise _unsupported("echo")
        if self.suffix:
            raise _unsupported("suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise _unsupported("best_of", "best_of must equal n (no server-side ranking)")
        return self

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and not isinstance(p[0], int):
            if len(p) != 1:
                raise invalid(
                    "batched prompts are not supported; send one prompt per request", "prompt"
                )
            p = p[0]
        if not p:
            raise invalid("prompt must not be empty", "prompt")
        return p

    def sampling_params(self) -> SamplingParams:
        return make_sampling_params(
            self.sampling_kwargs(), max_tokens=self.max_tokens, logprobs=self.logprobs
        )

    def beam_search_params(self, default_max_tokens: int) -> BeamSearchParams:
        return self._beam_search_params(self.max_tokens, default_max_tokens)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Strict):
    """A call in an assistant message of the conversation (one the model made earlier)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = (
        None  # None only for an assistant message with tool_calls
    )
    name: str | None = None  # accepted, ignored (the chat template has no slot for it)
    tool_calls: list[ToolCall] | None = None  # assistant only
    tool_call_id: str | None = None  # tool only: the call this message answers

    @model_validator(mode="before")
    @classmethod
    def _bounded_lists(cls, data: Any) -> Any:
        return _check_raw_lengths(data, {"tool_calls": MAX_TOOL_CALLS_PER_MESSAGE})

    @model_validator(mode="after")
    def _tool_fields(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise _FieldError(
                "content",
                "content is required (only an assistant message with tool_calls may omit it)",
            )
        if self.tool_calls is not None and self.role != "assistant":
            raise _FieldError("tool_calls", "tool_calls is only allowed in assistant messages")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise _FieldError(
                "tool_call_id",
                'a "tool" message needs tool_call_id (and only a tool message has it)',
            )
        for i, call in enumerate(self.tool_calls or []):
            try:
                json.loads(call.function.arguments)
            except ValueError:
                raise _FieldError(
                    f"tool_calls.{i}.function.arguments", "arguments must be JSON text"
                ) from None
        return self

    def as_template_dict(self) -> dict[str, Any]:
        """The message as chat templates take it: text content, calls with their arguments parsed
        (templates write them with `tojson`)."""
        content = (
            self.content
            if not isinstance(self.content, list)
            else "".join(p.text for p in self.content)
        )
        message: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": content,
        }
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {
                        "name": c.function.name,
                        "arguments": json.loads(c.function.arguments),
                    },
                }
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments; none: no arguments
    strict: bool | None = None  # arguments always follow the schema when a call is forced


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Sampling):
    """`POST /v1/chat/completions`: the tokenizer's chat template turns messages into a prompt."""

    messages: list[ChatMessage]
    max_tokens: MaxTokens = None
    max_completion_tokens: MaxTokens = None  # OpenAI's newer name of max_tokens
    logprobs: bool = False
    top_logprobs: Logprobs = None  # our logprobs (how many top candidates per token)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = (
        None  # default: auto with tools
    )
    parallel_tool_calls: bool | None = None  # false: at most one call

    @model_validator(mode="after")
    def _supported(self) -> ChatCompletionRequest:
        if not self.messages:
            raise _FieldError("messages", "messages must not be empty")
        if self.top_logprobs is not None and not self.logprobs:
            raise _FieldError("top_logprobs", "top_logprobs needs logprobs: true")
        return self

    @model_validator(mode="after")
    def _tools(self) -> ChatCompletionRequest:
        names: set[str] = set()
        for tool in self.tools or []:
            if tool.function.name in names:
                raise _FieldError(
                    "tools",
                    f"tools: the function name {tool.function.name!r} is used more than once",
                )
            names.add(tool.function.name)
        check_schema_size(
            "tools", [t.function.parameters for t in self.tools or [] if t.function.parameters]
        )
        choice = self.tool_choice
        if choice not in (None, "none") and not names:
            raise _FieldError("tool_choice", "tool_choice needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            listed = ", ".join(t.function.name for t in self.tools or [])
            raise _FieldError(
                "tool_choice",
                f"tool_choice names the function {choice.function.name!r}, which is "
                f"not in tools ({listed})",
            )
        plan = self.tool_plan()
        if plan is not None and self.use_beam_search:
            raise _unsupported("tools", "tools are not supported with use_beam_search")
        constraint = self._constraint
        if plan is not None and plan.mode != "auto" and constraint is not None:
            raise _FieldError(
                constraint[0],
                f"{constraint[0]} cannot be combined with a forced tool_choice "
                "(the call's arguments already follow the tool's schema)",
            )
        return self

    def tool_plan(self) -> ToolPlan | None:
        """How tools are used; None when none are offered (no tools, or tool_choice "none")."""
        if not self.tools or self.tool_choice == "none":
            return None
        tools = tuple(t.model_dump(exclude_none=True) for t in self.tools)
        parallel = self.parallel_tool_calls is not False
        if isinstance(self.tool_choice, NamedToolChoice):
            return ToolPlan("named", tools, self.tool_choice.function.name, parallel)
        return ToolPlan(self.tool_choice or "auto", tools, None, parallel)  # type: ignore[arg-type]

    def parsed_tool_plan(self) -> ToolPlan | None:
        """The plan the output is parsed with: none when an "auto" request also sets an output
        constraint (the output then follows that format and is returned as content)."""
        plan = self.tool_plan()
        return (
            None
            if plan is not None and plan.mode == "auto" and self._constraint is not None
            else plan
        )

    def output_constraint(self) -> tuple[str, StructuredOutputsParams] | None:
        """A forced tool_choice constrains the output to the call's schema (`ToolPlan`)."""
        plan = self.tool_plan()
        schema = plan.forced_schema() if plan is not None else None
        if schema is None:
            return self._constraint
        return "tools", StructuredOutputsParams(json=schema)

    def constraints_to_check(self) -> list[tuple[str, StructuredOutputsParams]]:
        """Every offered tool's parameters schema is compiled, even when calls are not forced, so
        a schema the server could not enforce is refused up front, by name (a named call reuses
        its tool's compile from the cache)."""
        plan = self.tool_plan()
        checks = (
            [
                (
                    f"tools.{i}.function.parameters",
                    StructuredOutputsParams(json=plan.parameters(name)),
                )
                for i, name in enumerate(plan.names)
            ]
            if plan is not None
            else []
        )
        return checks + super().constraints_to_check()

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.as_template_dict() for m in self.messages]

    def offered_tools(self) -> list[dict[str, Any]] | None:
        """The tools the prompt lists (none with tool_choice "none")."""
        plan = self.tool_plan()
        return list(plan.tools) if plan is not None else None

    def _max_tokens(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )

    def field_names(self) -> dict[str, str]:
        """Our parameter names -> the fields this request sent them as (errors name the latter)."""
        names = {"logprobs": "top_logprobs"}
        if self.max_completion_tokens is not None:
            names["max_tokens"] = "max_completion_tokens"
        return names

    def sampling_params(self) -> SamplingParams:
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return make_sampling_params(
            self.sampling_kwargs(),
            max_tokens=self._max_tokens(),
            logprobs=logprobs,
            renames=self.field_names(),
        )

    def beam_search_params(self, default_max_tokens: int) -> BeamSearchParams:
        return self._beam_search_params(self._max_tokens(), default_max_tokens)


class StreamRequest(_Sampling):
    """One request on `WS /v1/stream`: exactly one of `prompt` / `messages`, plus sampling fields.
    `max_tokens` defaults like the matching HTTP endpoint (16 for a prompt, the rest of the
    context for messages); `logprobs: k` adds per-token logprobs to each token message."""

    type: Literal["request"] = "request"
    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = None
    max_tokens: MaxTokens = None
    logprobs: Logprobs = None

    @model_validator(mode="after")
    def _one_input(self) -> StreamRequest:
        if (self.prompt is None) == (self.messages is None):
            raise _FieldError("prompt", "send exactly one of 'prompt' or 'messages'")
        if self.messages is not None and not self.messages:
            raise _FieldError("messages", "messages must not be empty")
        if self.prompt is not None and not self.prompt:
            raise _FieldError("prompt", "prompt must not be empty")
        if self.stream_options is not None:
            raise _unsupported(
                "stream_options",
                "stream_options is not used on the WebSocket (usage is always sent)",
            )
        if self.use_beam_search:
            raise _unsupported(
                "use_beam_search", "use_beam_search is served over HTTP only (it does not stream)"
            )
        return self

    def sampling_params(self) -> SamplingParams:
        max_tokens = (
            self.max_tokens if self.max_tokens is not None or self.messages is not None else 16
        )
        return make_sampling_params(
            self.sampling_kwargs(), max_tokens=max_tokens, logprobs=self.logprobs
        )


# ---------------------------------------------------------------------- parsing and errors


class _FieldError(ValueError):
    """Raised inside validators so the error names its field (pydantic keeps the message)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _unsupported(param: str, message: str | None = None) -> _FieldError:
    return _FieldError(param, message or f"{param} is not supported by this server")


def _check_raw_lengths(data: Any, limits: dict[str, int]) -> Any:
    """Refuse a raw (not yet validated) list field longer than its limit, naming it."""
    if isinstance(data, dict):
        for name, limit in limits.items():
            value = data.get(name)
            if isinstance(value, list) and len(value) > limit:
                raise _FieldError(name, f"{name}: at most {limit} items, got {len(value)}")
    return data


def _check_choice(param: str, choice: list[str] | None) -> None:
    if choice is not None and any(len(c) > MAX_CHOICE_CHARS for c in choice):
        raise _FieldError(
            param, f"{param}: each choice must be at most {MAX_CHOICE_CHARS} characters"
        )


def check_schema_size(param: str, schemas: list[Any]) -> None:
    """Refuse schemas nested deeper than MAX_SCHEMA_DEPTH or holding more than MAX_SCHEMA_NODES
    JSON values together; one pass that stops at the first limit crossed."""
    nodes, stack = 0, [(schema, 1) for schema in schemas]
    while stack:
        value, depth = stack.pop()
        nodes += 1
        if nodes > MAX_SCHEMA_NODES:
            raise _FieldError(
                param,
                f"{param}: the JSON schemas hold more than {MAX_SCHEMA_NODES} values together",
            )
        if isinstance(value, (dict, list)):
            if depth > MAX_SCHEMA_DEPTH:
                raise _FieldError(
                    param,
                    f"{param}: a JSON schema is nested more than {MAX_SCHEMA_DEPTH} levels deep",
                )
            children = value.values() if isinstance(value, dict) else value
            stack.extend((child, depth + 1) for child in children)


def check_response_size(
    n: int,
    logprobs: int | None,
    max_tokens: int,
    max_tokens_set: bool,
    renames: dict[str, str] | None = None,
) -> None:
    """Refuse a request whose response could hold more than MAX_RESPONSE_TOKEN_ENTRIES token
    entries (n x (top logprobs + 1) x max_tokens); `max_tokens` is the effective one (the rest
    of the context when the request left it unset)."""
    entries = n * ((logprobs or 0) + 1) * max_tokens
    if entries <= MAX_RESPONSE_TOKEN_ENTRIES:
        return
    name = (renames or {}).get("logprobs", "logprobs")
    tokens = (renames or {}).get("max_tokens", "max_tokens")
    limit = (
        f"{tokens} ({max_tokens})"
        if max_tokens_set
        else f"{tokens} (unset: the rest of the context, {max_tokens})"
    )
    raise invalid(
        f"the response could hold n ({n}) x ({name} ({logprobs or 0}) + 1) x {limit} = {entries} tokens, over the "
        f"limit of {MAX_RESPONSE_TOKEN_ENTRIES}; lower {tokens}, n or {name}",
        tokens,
        "response_too_large",
    )


class _NumberCheck:
    """`json.loads` hooks that keep NaN, Infinity and overflowing numbers (1e999) as the float
    they read as, noting that one was seen; only then is the body walked to name where."""

    def __init__(self) -> None:
        self.seen = False

    def constant(self, name: str) -> float:
        self.seen = True
        return float(name)

    def number(self, text: str) -> float:
        value = float(text)
        self.seen = self.seen or not math.isfinite(value)
        return value


def _non_finite_path(value: Any) -> str | None:
    """The dotted path of the first NaN or infinity in decoded JSON."""
    return _first_path(value, lambda v: isinstance(v, float) and not math.isfinite(v))


# A lone surrogate is legal in JSON (`"\ud800"`) but is no Unicode text: tokenizers raise on it
# and a response echoing it cannot be encoded. It can only come from such an escape (the body
# was decoded as strict UTF-8), so the body is walked only when one appears.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89abcdefABCDEF][0-9a-fA-F]{2}")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _surrogate_path(value: Any) -> str | None:
    """The dotted path of the first string (or key) in decoded JSON holding a lone surrogate."""
    return _first_path(
        value, lambda v: isinstance(v, str) and _SURROGATE.search(v) is not None, keys=True
    )


def _first_path(value: Any, bad: Any, keys: bool = False) -> str | None:
    """The dotted path of the first value (or, with `keys`, key) for which `bad` holds in decoded
    JSON (iterative: any depth)."""
    stack: list[tuple[Any, tuple[str, ...]]] = [(value, ())]
    while stack:
        value, path = stack.pop()
        if bad(value):
            return ".".join(path)
        if isinstance(value, dict):
            for k in value if keys else ():
                if bad(k):
                    return ".".join((*path, _SURROGATE.sub("?", k)))
            stack.extend((v, (*path, str(k))) for k, v in reversed(value.items()))
        elif isinstance(value, list):
            stack.extend((v, (*path, str(i))) for i, v in reversed(list(enumerate(value))))
    return None


# Arrays of a body's top level that are decoded item by item and refused past their cap, before
# the rest of the array is even parsed (`_loads_capped`).
_CAPPED_ARRAYS = {
    "tools": MAX_TOOLS,
    "messages": MAX_MESSAGES,
    "guided_choice": MAX_CHOICES,
    "stop": MAX_STOPS,
    "stop_token_ids": MAX_STOP_TOKEN_IDS,
}
_WHITESPACE = re.compile(r"[ \t\n\r]*")


class _TooMany(ValueError):
    def __init__(self, key: str, limit: int) -> None:
        super().__init__(f"{key}: at most {limit} items, got more")
        self.key = key


def _loads_capped(text: str, decoder: json.JSONDecoder, caps: dict[str, int]) -> Any:
    """`decoder.decode(text)`, except that the arrays of a top-level object named in `caps` are
    decoded one item at a time and refused (`_TooMany`) at the first item past their cap. So a
    body holding a huge list costs O(cap) items of work, and other threads (the event loop) get
    the GIL between items: one `json.loads` of a whole body holds it throughout (~25 ms per
    800 KB of small objects, 10x that on a loaded machine)."""

    def skip(i: int) -> int:
        return _WHITESPACE.match(text, i).end()  # type: ignore[union-attr]

    def expect(i: int, what: str) -> None:
        raise json.JSONDecodeError(f"Expecting {what}", text, i)

    i = skip(0)
    if not text.startswith("{", i):
        return decoder.decode(text)
    out: dict[str, Any] = {}
    i = skip(i + 1)
    empty = text.startswith("}", i)
    while not empty:
        if not text.startswith('"', i):
            expect(i, "property name enclosed in double quotes")
        key, i = json.decoder.scanstring(text, i + 1)  # type: ignore[attr-defined]
        i = skip(i)
        if not text.startswith(":", i):
            expect(i, "':' delimiter")
        i = skip(i + 1)
        if key in caps and text.startswith("[", i):
            out[key], i = _capped_array(text, i, decoder, key, caps[key], skip, expect)
        else:
            out[key], i = decoder.raw_decode(text, i)
        i = skip(i)
        if text.startswith(",", i):
            i = skip(i + 1)
        elif text.startswith("}", i):
            break
        else:
            expect(i, "',' delimiter")
    end = skip(i + 1)
    if end != len(text):
        raise json.JSONDecodeError("Extra data", text, end)
    return out


def _capped_array(
    text: str, i: int, decoder: json.JSONDecoder, key: str, limit: int, skip: Any, expect: Any
) -> tuple[list[Any], int]:
    items: list[Any] = []
    i = skip(i + 1)
    if text.startswith("]", i):
        return items, i + 1
    while True:
        if len(items) == limit:
            raise _TooMany(key, limit)
        item, i = decoder.raw_decode(text, i)
        items.append(item)
        i = skip(i)
        if text.startswith("]", i):
            return items, i + 1
        if not text.startswith(",", i):
            expect(i, "',' delimiter")
        i = skip(i + 1)


def _loads_finite(text: str, caps: dict[str, int] | None = None) -> Any:
    """`json.loads`, refusing NaN and infinities (a ValueError naming where one is), with the
    top-level arrays in `caps` capped (`_loads_capped`)."""
    check = _NumberCheck()
    decoder = json.JSONDecoder(parse_constant=check.constant, parse_float=check.number)
    data = _loads_capped(text, decoder, caps) if caps else decoder.decode(text)
    if check.seen:
        path = _non_finite_path(data)
        if path is not None:
            raise _NonFinite(path)
    if _SURROGATE_ESCAPE.search(text):
        path = _surrogate_path(data)
        if path is not None:
            raise _LoneSurrogate(path)
    return data


class _LoneSurrogate(ValueError):
    def __init__(self, path: str) -> None:
        super().__init__(
            f"{path or 'the body'}: a lone UTF-16 surrogate (\\ud800-\\udfff without its pair) is not "
            "Unicode text"
        )
        self.path = path


class _NonFinite(ValueError):
    def __init__(self, path: str) -> None:
        super().__init__(
            f"{path or 'the body'}: NaN and infinities (and numbers too large for a float) are not "
            "allowed"
        )
        self.path = path


def parse_json(raw: bytes) -> Any:
    """Strict UTF-8 JSON, with a message for each way a body can be broken. NaN, Infinity and
    numbers too large for a float (1e999) are refused anywhere in the body, nested ones too,
    naming the field where they are."""
    if not raw.strip():
        raise invalid("request body is empty; send a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise invalid(f"request body is not valid UTF-8 (byte {e.start})") from None
    try:
        return _loads_finite(text, _CAPPED_ARRAYS)
    except _TooMany as e:
        raise invalid(str(e), e.key) from None
    except (_NonFinite, _LoneSurrogate) as e:
        raise invalid(str(e), e.path or None) from None
    except RecursionError:
        raise invalid("request body JSON is nested too deeply") from None
    except ValueError as e:
        raise invalid(f"request body is not valid JSON: {e}") from None


def parse_request(model: type[_Strict], data: Any) -> Any:
    """Validate decoded JSON against a request model; the first error becomes an `APIError`."""
    if not isinstance(data, dict):
        raise invalid(f"request body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise _from_validation_error(e) from None


def _from_validation_error(e: ValidationError) -> APIError:
    errors = e.errors(include_url=False)
    # For a union, the deepest error names the branch the client was most likely aiming at
    # (a list of message parts with an image part, not "should be a string").
    err = max(errors, key=lambda x: len(x["loc"]))
    cause = err.get("ctx", {}).get("error")
    # Union members add their type name to loc ("prompt", "str", ...): keep the data path.
    loc = [str(x) for x in err["loc"] if isinstance(x, int) or not _is_type_name(x)]
    if isinstance(cause, _FieldError):  # raised by a validator of the model at `loc`
        param = ".".join([*loc, cause.param])
        text = str(cause)
        return invalid(f"{param}: {text.removeprefix(cause.param + ': ')}" if loc else text, param)
    param = ".".join(loc) or None
    if err["type"] == "extra_forbidden":
        return invalid(f"unknown field {param!r}", param, "unknown_field")
    if err["type"] == "missing":
        return invalid(f"missing required field {param!r}", param)
    return invalid(f"{param}: {err['msg']}" if param else err["msg"], param)


def _is_type_name(part: Any) -> bool:
    return isinstance(part, str) and bool(
        re.search(r"[\[\]]|^(str|int|float|bool|TextPart|NamedToolChoice)$", part)
    )


def _constraint_message(e: ValueError) -> str:
    """`StructuredOutputsParams` names its own fields ("structured_outputs.regex must ..."); the
    request's field is named by the caller, so keep only what is wrong."""
    return re.sub(r"^(invalid )?structured_outputs\.?", "", str(e)).strip() or str(e)


def constraint_error(param: str, e: ValueError) -> APIError:
    """A constraint that did not compile (bad schema, regex or grammar) as a 400 naming its field
    (the compiler's "invalid structured_outputs.json: ..." names its own)."""
    reason = re.sub(r"^invalid structured_outputs\.[a-z_]+: ", "", str(e))
    return invalid(f"invalid {param}: {reason}", param)


def param_error(e: ParamError, renames: dict[str, str] | None = None) -> APIError:
    """A `ParamError` (SamplingParams, the engine, the prompt) as the 400 naming its field as the
    request spelled it (`renames`: our names -> the request's); a prompt or output that cannot
    fit is `context_length_exceeded`."""
    code = "context_length_exceeded" if isinstance(e, ContextLengthError) else None
    return invalid(str(e), (renames or {}).get(e.field, e.field), code)


def make_sampling_params(
    kwargs: dict[str, Any],
    *,
    max_tokens: int | None,
    logprobs: int | None,
    renames: dict[str, str] | None = None,
) -> SamplingParams:
    """Build `SamplingParams`; its `ParamError` becomes the 400 naming the field."""
    try:
        return SamplingParams(**kwargs, max_tokens=max_tokens, logprobs=logprobs)
    except ParamError as e:
        raise param_error(e, renames) from None


def beam_search_error(e: ValueError) -> APIError:
    """A beam search's ValueError (its params, or the search refusing the prompt) as a 400 naming
    the request's field: `beam_width` is the request's `n`; an error naming no field, `prompt`."""
    if not isinstance(e, ParamError):
        return invalid(str(e), "prompt")
    message = str(e).replace("beam_width", "n")
    if e.field == "beam_width":
        message += " (with use_beam_search, n is the beam width)"
    return param_error(type(e)(e.field, message), {"beam_width": "n"})
