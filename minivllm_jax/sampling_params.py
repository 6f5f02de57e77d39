"""`SamplingParams`: how one request samples, validated on construction (vLLM names and meanings)."""

from __future__ import annotations

import dataclasses
import json
import math
import numbers

from minivllm_jax.config import KVCompressionConfig

MAX_LOGPROBS = 20  # top-k logprobs are computed for this many candidates on device, every step

# The ranges of the numeric fields. Each value becomes an int32/float32 device array entry (the
# seed: two uint32 words), so every bound keeps it representable there; a value outside is a
# ValueError naming the field (the server's 400), never an error inside a step.
INT32_MAX = 2**31 - 1
MAX_N = 128  # samples of one request (OpenAI's limit for `n`)
MAX_TOP_K = INT32_MAX  # any k >= the vocabulary keeps every token
MAX_TOKENS_LIMIT = (
    INT32_MAX  # max_tokens (max_model_len bounds it further when the request is added)
)
MAX_SEED = 2**63 - 1  # seeds are int64 in the OpenAI API; the sampler keys on all 64 bits
MAX_TEMPERATURE = 100.0  # beyond it every row samples uniformly in float32 anyway
MAX_REPETITION_PENALTY = 100.0
MAX_PENALTY = (
    2.0  # presence_penalty and frequency_penalty lie in [-MAX_PENALTY, MAX_PENALTY] (OpenAI)
)
MAX_TOKEN_ID = INT32_MAX  # stop_token_ids


class ParamError(ValueError):
    """A bad value of one request parameter; `field` names it (the server's 400 names it as its
    `param`, in the request's own spelling)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field

    def __reduce__(self) -> tuple:  # pickles with its field (errors cross process boundaries)
        return type(self), (self.field, str(self))


class ContextLengthError(ParamError):
    """The prompt, or the prompt and the output it asks for, cannot fit in `max_model_len`."""


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    """A finite real number (NaN and infinities are refused everywhere)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


@dataclasses.dataclass(frozen=True)
class Range:
    """The values a numeric field (or each item of a list field) may take: [low, high], `low`
    excluded when `low_open`; `off` is one more value outside it that turns the field off
    (top_k's -1). `integer`: only integers (else finite reals)."""

    low: float
    high: float
    integer: bool = False
    low_open: bool = False
    off: int | None = None

    def contains(self, value: object) -> bool:
        if not (_is_int(value) if self.integer else _is_number(value)):
            return False
        if self.off is not None and value == self.off:
            return True
        return self.low <= value <= self.high and not (self.low_open and value == self.low)  # type: ignore[operator]

    def describe(self) -> str:
        """'an integer in [1, 128]', 'a finite number in (0, 1]', ..."""
        if self.integer:
            span = f"an integer in [{self.low}, {self.high}]"
            return span if self.off is None else f"{self.off} (disabled) or {span}"
        return f"a finite number in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}]"


# The ranges of SamplingParams' numeric fields, declared once: SamplingParams checks them, and
# the server's request models take them as their bounds (`server/protocol.py`).
RANGES: dict[str, Range] = {
    "n": Range(1, MAX_N, integer=True),
    "temperature": Range(0.0, MAX_TEMPERATURE),
    "top_p": Range(0.0, 1.0, low_open=True),
    "top_k": Range(1, MAX_TOP_K, integer=True, off=-1),
    "min_p": Range(0.0, 1.0),
    "max_tokens": Range(1, MAX_TOKENS_LIMIT, integer=True),
    "logprobs": Range(0, MAX_LOGPROBS, integer=True),
    "presence_penalty": Range(-MAX_PENALTY, MAX_PENALTY),
    "frequency_penalty": Range(-MAX_PENALTY, MAX_PENALTY),
    "repetition_penalty": Range(0.0, MAX_REPETITION_PENALTY, low_open=True),
    "seed": Range(0, MAX_SEED, integer=True),
    "stop_token_ids": Range(0, MAX_TOKEN_ID, integer=True),  # each id
}
# Fields that may be None (the engine's default then applies).
OPTIONAL = ("max_tokens", "logprobs", "seed")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings; `temperature=0` means greedy.

    On device these values become per-row arrays of the batch, so mixing them never recompiles.
    A bad value raises `ParamError` naming its field.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: int | None = 16
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    # Drop this request's KV pages by a policy as it grows (a dict is read as the config's
    # fields); None: the engine's `kv_compression`, if any (`minivllm_jax.engine.kv.compression`).
    kv_compression: KVCompressionConfig | dict | None = None
    # Constrain the output to a JSON schema, regex, choice or grammar (a dict is read as the
    # params' fields; `minivllm_jax.engine.decoding.structured_output`).
    structured_outputs: StructuredOutputsParams | dict | None = None

    def __post_init__(self) -> None:
        for name, allowed in RANGES.items():
            value = getattr(self, name)
            if name == "stop_token_ids" or (value is None and name in OPTIONAL):
                continue
            if not allowed.contains(value):
                what = allowed.describe() + (" or None" if name in OPTIONAL else "")
                raise ParamError(name, f"{name} must be {what}, got {value!r}")
        if self.n > 1 and self.temperature == 0.0:
            raise ParamError(
                "n", "n > 1 needs temperature > 0 (greedy samples would all be identical)"
            )
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in stops):
            raise ParamError(
                "stop",
                f"stop must be a non-empty string or a list of non-empty strings, got {self.stop!r}",
            )
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple)):
            raise ParamError(
                "stop_token_ids",
                f"stop_token_ids must be a list of integers, got {type(self.stop_token_ids).__name__}",
            )
        token_id = RANGES["stop_token_ids"]
        if not all(token_id.contains(t) for t in self.stop_token_ids or []):
            raise ParamError(
                "stop_token_ids",
                f"stop_token_ids must be integers in [0, {MAX_TOKEN_ID}], got {self.stop_token_ids!r}",
            )
        if isinstance(self.kv_compression, dict):
            try:
                object.__setattr__(
                    self, "kv_compression", KVCompressionConfig.from_dict(self.kv_compression)
                )
            except (TypeError, ValueError) as e:
                raise ParamError("kv_compression", f"kv_compression: {e}") from None
        elif self.kv_compression is not None and not isinstance(
            self.kv_compression, KVCompressionConfig
        ):
            raise ParamError(
                "kv_compression",
                f"kv_compression must be a KVCompressionConfig, a dict or None, got {type(self.kv_compression).__name__}",
            )
        try:
            object.__setattr__(
                self, "structured_outputs", as_structured_outputs(self.structured_outputs)
            )
        except (TypeError, ValueError) as e:
            message = (
                str(e) if str(e).startswith("structured_outputs") else f"structured_outputs: {e}"
            )
            raise ParamError("structured_outputs", message) from None
        object.__setattr__(self, "stop", stops)
        object.__setattr__(self, "stop_token_ids", list(self.stop_token_ids or []))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


# Structured output (engine/decoding/structured_output.py compiles and applies it).
KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """What a request's output must match; exactly one of the constraints is set (vLLM's shape).

    - `json`: a JSON schema (a dict, or its JSON text);
    - `regex`: a regular expression the whole output matches;
    - `choice`: the output is exactly one of these strings;
    - `grammar`: a Lark grammar (llguidance's dialect) or a llama.cpp GBNF grammar;
    - `json_object`: any JSON object (OpenAI's `response_format: {"type": "json_object"}`).

    `disable_any_whitespace` (default True, unlike vLLM): JSON is generated compact, without
    free whitespace between tokens. A small model given free whitespace can emit newlines until
    `max_tokens` and never close the object.
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = True

    def __post_init__(self) -> None:
        chosen = [
            k for k in KINDS if (getattr(self, k) is not None and getattr(self, k) is not False)
        ]
        if len(chosen) != 1:
            raise ValueError(
                f"structured_outputs needs exactly one of {', '.join(KINDS)}; got "
                f"{', '.join(chosen) if chosen else 'none'}"
            )
        if isinstance(self.json, str):
            try:
                schema = json.loads(self.json)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            object.__setattr__(self, "json", schema)
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise ValueError(
                f"structured_outputs.json must be a JSON schema object, got {type(self.json).__name__}"
            )
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ValueError("structured_outputs.regex must be a non-empty string")
        if self.grammar is not None and (
            not isinstance(self.grammar, str) or not self.grammar.strip()
        ):
            raise ValueError("structured_outputs.grammar must be a non-empty string")
        if self.choice is not None:
            if (
                not isinstance(self.choice, (list, tuple))
                or not self.choice
                or not all(isinstance(c, str) and c for c in self.choice)
            ):
                raise ValueError(
                    "structured_outputs.choice must be a non-empty list of non-empty strings"
                )
            object.__setattr__(self, "choice", list(self.choice))
        if not isinstance(self.json_object, bool):
            raise ValueError("structured_outputs.json_object must be a boolean")

    @property
    def kind(self) -> str:
        return next(
            k for k in KINDS if getattr(self, k) is not None and getattr(self, k) is not False
        )

    @property
    def key(self) -> str:
        """The cache key: the constraint in a canonical text form."""
        value = {
            "json": self.json,
            "regex": self.regex,
            "choice": self.choice,
            "grammar": self.grammar,
            "json_object": True,
        }[self.kind]
        return json.dumps([self.kind, value, self.disable_any_whitespace], sort_keys=True)

    def llguidance_grammar(self) -> str:
        """The constraint as an llguidance grammar (not yet checked: `GrammarCompiler` does)."""
        import llguidance

        options = {"whitespace_flexible": not self.disable_any_whitespace}
        kind = self.kind
        if kind in ("json", "json_object"):
            schema = {"type": "object"} if kind == "json_object" else self.json
            try:
                return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
            except ValueError as e:
                raise ValueError(f"invalid structured_outputs.json: {e}") from None
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.regex)
        if kind == "choice":
            return llguidance.grammar_from("choice", json.dumps(self.choice))
        try:
            return llguidance.grammar_from(
                "grammar", self.grammar
            )  # Lark, or GBNF converted to Lark
        except Exception as e:  # the GBNF converter raises its own error types
            raise ValueError(f"invalid structured_outputs.grammar: {e}") from None


def as_structured_outputs(
    value: StructuredOutputsParams | dict | None,
) -> StructuredOutputsParams | None:
    """`SamplingParams.structured_outputs` given as a dict (an HTTP body) or the params."""
    if value is None or isinstance(value, StructuredOutputsParams):
        return value
    if isinstance(value, dict):
        unknown = set(value) - {f.name for f in dataclasses.fields(StructuredOutputsParams)}
        if unknown:
            raise ValueError(f"structured_outputs: unknown field(s) {', '.join(sorted(unknown))}")
        return StructuredOutputsParams(**value)
    raise ValueError(
        f"structured_outputs must be a StructuredOutputsParams, a dict or None, got {type(value).__name__}"
    )
