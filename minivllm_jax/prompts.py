"""Prompts -> token ids: the one place the library (`LLM`, `LLMEngine`), the server and the CLI
tokenize text and apply chat templates, so the same prompt gives the same ids everywhere.

- Text is encoded with the tokenizer's own special-token rule (BOS where the tokenizer adds
  one, as HF and vLLM do).
- A conversation is rendered by the tokenizer's chat template with the generation prompt, then
  encoded without special tokens (the template writes them), as HF's
  `apply_chat_template(tokenize=True)` does.
- Token ids are taken as given, once checked against the vocabulary.

With a `limit` (the server passes max_model_len), long text is tokenized in growing prefixes
first, so text far too long to fit is refused after tokenizer work in proportion to the limit,
not to the text. Bad input raises `ParamError` naming the field (`ContextLengthError` when it
cannot fit); the tokenizer is any HF-like object with `encode` and `apply_chat_template`.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

from minivllm_jax.sampling_params import ContextLengthError, ParamError

# Long text is tokenized in prefixes: the first one this many characters per `limit` token
# (about what English takes), each next one this many times longer.
PROBE_CHARS_PER_TOKEN = 4
PROBE_GROWTH = 4
# A prefix cut at whitespace tokenizes as the full text does up to the cut (pre-tokenizers split
# there); this margin covers a cut inside a word, whose last piece may split into a few more.
PROBE_MARGIN_TOKENS = 16

Message = dict[str, Any]


def encode_text(
    tokenizer: Any,
    text: str,
    *,
    special_tokens: bool = True,
    limit: int | None = None,
    max_chars: int | None = None,
    field: str = "prompt",
) -> list[int]:
    """`text` -> token ids (`special_tokens`: the tokenizer's BOS rule; off for rendered chats).
    With `limit`, text longer than `max_chars` (if given: more characters than `limit` tokens
    can hold) is refused before any tokenizer work, and text whose prefix is already more than
    `limit` tokens before it is tokenized whole."""
    if not text:
        raise ParamError(field, f"{field} must not be empty")
    if limit is not None:
        check_chars(len(text), limit, max_chars, field)
        _refuse_long_prefix(tokenizer, text, special_tokens, limit, field)
    ids = list(tokenizer.encode(text, add_special_tokens=special_tokens))
    if not ids:
        raise ParamError(field, f"{field} encodes to no tokens")
    return ids


def check_chars(chars: int, limit: int, max_chars: int | None, field: str) -> None:
    """Refuse `chars` characters of text when more than `max_chars` (None: no bound), the most
    that `limit` tokens can hold."""
    if max_chars is not None and chars > max_chars:
        raise ContextLengthError(
            field,
            f"{field} is too long: {chars} characters cannot fit in max_model_len ({limit}) tokens",
        )


def _refuse_long_prefix(
    tokenizer: Any, text: str, special_tokens: bool, limit: int, field: str
) -> None:
    """Tokenize growing prefixes of long text: once one has more than `limit` tokens the text is
    refused, after work in proportion to `limit`."""
    probe = PROBE_CHARS_PER_TOKEN * limit
    while probe < len(text):
        space = text.rfind(" ", probe // 2, probe)
        cut = space if space > 0 else probe
        count = len(tokenizer.encode(text[:cut], add_special_tokens=special_tokens))
        if count > limit + PROBE_MARGIN_TOKENS:
            raise ContextLengthError(
                field,
                f"{field} is too long: its first {cut} characters are already {count} tokens, "
                f"more than max_model_len ({limit})",
            )
        probe *= PROBE_GROWTH


def check_messages(messages: Sequence[Message]) -> None:
    """A conversation: a non-empty list of dicts with a string 'role' and a string 'content'
    (an assistant message with 'tool_calls' may have none)."""
    if not messages:
        raise ParamError("messages", "messages must not be empty")
    for m in messages:
        if (
            not isinstance(m, dict)
            or not isinstance(m.get("role"), str)
            or not (
                isinstance(m.get("content"), str)
                or (m.get("content") is None and m.get("tool_calls"))
            )
        ):
            raise ParamError(
                "messages", "each message must be a dict with string 'role' and 'content'"
            )


def render_chat(
    tokenizer: Any, messages: Sequence[Message], tools: list[dict[str, Any]] | None = None
) -> str | list[int]:
    """The chat template applied with the generation prompt (and `tools=` when given), as text;
    a stand-in tokenizer (tests) may answer token ids directly."""
    kwargs = {"tools": tools} if tools else {}
    return tokenizer.apply_chat_template(
        list(messages), add_generation_prompt=True, tokenize=False, **kwargs
    )


def chat_ids(
    tokenizer: Any,
    messages: Sequence[Message],
    *,
    tools: list[dict[str, Any]] | None = None,
    limit: int | None = None,
    max_chars: int | None = None,
) -> list[int]:
    """A conversation -> the prompt's token ids (`render_chat`, then `encode_text` without special
    tokens: the template writes any BOS itself). Template errors (e.g. jinja's raise_exception on
    the role order) are a ParamError naming `messages`."""
    check_messages(messages)
    try:
        text = render_chat(tokenizer, messages, tools)
    except Exception as e:  # the template's own errors, whatever their type
        raise ParamError(
            "messages", f"messages could not be formatted with the chat template: {e}"
        ) from None
    if not isinstance(text, str):
        return list(text["input_ids"] if hasattr(text, "keys") else text)
    return encode_text(
        tokenizer, text, special_tokens=False, limit=limit, max_chars=max_chars, field="messages"
    )


def template_renders_tools(tokenizer: Any) -> bool:
    """Whether the chat template renders `tools=` (it changes the prompt); many, SmolLM2's among
    them, silently ignore it."""
    probe = [{"role": "user", "content": "ping"}]
    tool = {
        "type": "function",
        "function": {"name": "probe_tool", "description": "probe", "parameters": {}},
    }
    try:
        return render_chat(tokenizer, probe) != render_chat(tokenizer, probe, [tool])
    except Exception:  # a template (or tokenizer) without the tools argument
        return False


def check_token_ids(
    ids: Sequence[int], vocab_size: int, *, limit: int | None = None, field: str = "prompt"
) -> list[int]:
    """A token-id prompt, copied: not empty, at most `limit` ids (checked first, in O(1)), each
    an integer in [0, vocab_size)."""
    if limit is not None and len(ids) > limit:
        raise ContextLengthError(
            field, f"{field} has {len(ids)} tokens, more than max_model_len ({limit})"
        )
    ids = list(ids)
    if not ids:
        raise ParamError(field, f"{field} token ids must not be empty")
    for t in ids:
        if not isinstance(t, numbers.Integral) or isinstance(t, bool) or not 0 <= t < vocab_size:
            raise ParamError(
                field,
                f"{field} holds {t!r}: token ids must be integers in [0, {vocab_size})",
            )
    return ids


def prompt_ids(tokenizer: Any, prompt: str | Sequence[int], vocab_size: int) -> list[int]:
    """A prompt given as text (`encode_text`) or as token ids (`check_token_ids`) -> its ids."""
    if isinstance(prompt, str):
        return encode_text(tokenizer, prompt)
    return check_token_ids(prompt, vocab_size)
