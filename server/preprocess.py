"""Tokenizing off the engine thread, and token ids -> strings/bytes for logprobs.

Tokenizing a long prompt takes about 1 s per MB of text here; done on the engine thread it
would stall every stream. So prompts are tokenized on one worker thread with its own copy of
the tokenizer (HF tokenizers are not safe to share across threads), and the engine receives
token ids. The tokenizing itself is the library's (`minivllm_jax.prompts`), bounded by
max_model_len: prompts far too long to fit are rejected from their length alone, before any
work, and the rest are tokenized in growing prefixes, so a prompt too long to fit is refused
after O(max_model_len) tokenizer work, not after tokenizing all of it. Token-id prompts are
checked (length, then range) before they are copied.
Output constraints are compiled here too (on the engine's grammar compiler, which caches them),
so a bad schema is a 400 and the engine finds the request's grammar already compiled.
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from minivllm_jax import prompts
from minivllm_jax.prompts import PROBE_CHARS_PER_TOKEN, PROBE_MARGIN_TOKENS
from minivllm_jax.sampling_params import ParamError, StructuredOutputsParams
from server.protocol import APIError, constraint_error, invalid, param_error
from server.tool_calls import messages_without_tool_support

__all__ = ["PROBE_CHARS_PER_TOKEN", "PROBE_MARGIN_TOKENS", "Preprocessor", "TokenTable"]

T = TypeVar("T")
# A normalizer could shrink text before tokenizing (NFC, ...); this margin keeps the
# characters-only length check conservative.
_NORMALIZE_MARGIN = 4


class TokenTable:
    """Every token's bytes and display string, computed once at start-up (no tokenizer calls
    from request handlers)."""

    def __init__(self, tokenizer: Any) -> None:
        size = len(tokenizer)
        pieces = tokenizer.convert_ids_to_tokens(list(range(size)))
        decoder = _byte_decoder() if _is_byte_level(tokenizer) else None
        self._bytes: list[bytes] = []
        for i, piece in enumerate(pieces):
            if piece is None:
                self._bytes.append(b"")
            elif decoder is not None and all(ch in decoder for ch in piece):
                self._bytes.append(bytes(decoder[ch] for ch in piece))
            elif decoder is not None:  # added/special tokens are stored as plain text
                self._bytes.append(piece.encode("utf-8"))
            else:
                self._bytes.append(tokenizer.decode([i]).encode("utf-8"))
        self.max_token_bytes = max((len(b) for b in self._bytes), default=1) or 1

    def bytes(self, token_id: int) -> list[int]:
        return list(self._bytes[token_id]) if 0 <= token_id < len(self._bytes) else []

    def text(self, token_id: int) -> str:
        if not 0 <= token_id < len(self._bytes):
            return ""
        return self._bytes[token_id].decode("utf-8", errors="replace")


class Preprocessor:
    """Prompt -> token ids (text or chat messages, `minivllm_jax.prompts`) on a single worker
    thread; output constraints -> compiled grammars on `compiler` (the engine's
    `GrammarCompiler`; None: not checked)."""

    def __init__(
        self, tokenizer: Any, max_model_len: int, max_token_bytes: int, compiler: Any = None
    ) -> None:
        self._tokenizer = copy.deepcopy(tokenizer)
        self._compiler = compiler
        self._template_takes_tools: bool | None = None  # probed on first use
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")
        self.max_model_len = max_model_len
        self.vocab_size = len(tokenizer)
        # A token covers at most max_token_bytes bytes, so more characters than this can
        # never fit in max_model_len tokens.
        self.max_prompt_chars = _NORMALIZE_MARGIN * max_token_bytes * max_model_len

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _check_chars(self, chars: int, param: str) -> None:
        """Refuse text of more characters than max_model_len tokens can hold, before any work."""
        try:
            prompts.check_chars(chars, self.max_model_len, self.max_prompt_chars, param)
        except ParamError as e:
            raise param_error(e) from None

    def check_ids(self, ids: list[int], param: str = "prompt") -> list[int]:
        """A token-id prompt, copied: at most max_model_len ids (checked first, in O(1)), each in
        the tokenizer's vocabulary."""
        try:
            return prompts.check_token_ids(
                ids, self.vocab_size, limit=self.max_model_len, field=param
            )
        except ParamError as e:
            raise param_error(e) from None

    async def encode(self, prompt: str | list[int]) -> list[int]:
        """Text -> ids with the tokenizer's special-token rule (BOS where it adds one, as
        `LLMEngine` does); ids are checked (`check_ids`), then copied."""
        if not isinstance(prompt, str):
            return self.check_ids(prompt)
        if not prompt:
            raise invalid("prompt must not be empty", "prompt")
        self._check_chars(len(prompt), "prompt")
        bounds = {"limit": self.max_model_len, "max_chars": self.max_prompt_chars}
        return await self._run(lambda: prompts.encode_text(self._tokenizer, prompt, **bounds))

    async def chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        parallel_tool_calls: bool = True,
    ) -> list[int]:
        """The chat template with the generation prompt (`prompts.chat_ids`, as `LLM.chat`); the
        template writes any BOS itself, so none is added on top. `tools` go to the template
        (`tools=`), or, when it ignores them, into a system prompt (`server/tool_calls.py`)."""
        if not messages:
            raise invalid("messages must not be empty", "messages")
        chars = sum(
            len(m.get("content") or "") + len(json.dumps(m.get("tool_calls") or ""))
            for m in messages
        )
        self._check_chars(chars + len(json.dumps(tools or "")), "messages")
        uses_tools = bool(tools) or any(
            m.get("tool_calls") or m["role"] == "tool" for m in messages
        )

        def apply() -> list[int]:
            conversation, template_tools = messages, None
            if uses_tools and self._takes_tools():
                template_tools = tools
            elif uses_tools:
                conversation = messages_without_tool_support(messages, tools, parallel_tool_calls)
            return prompts.chat_ids(
                self._tokenizer,
                conversation,
                tools=template_tools,
                limit=self.max_model_len,
                max_chars=self.max_prompt_chars,
            )

        try:
            return await self._run(apply)
        except APIError:
            raise
        except Exception as e:  # a tool-call rewrite the template could not take
            raise invalid(
                f"messages could not be formatted with the chat template: {e}", "messages"
            ) from None

    def _takes_tools(self) -> bool:
        """Whether the chat template renders `tools=` (`prompts.template_renders_tools`); probed
        once, on the worker thread."""
        if self._template_takes_tools is None:
            self._template_takes_tools = prompts.template_renders_tools(self._tokenizer)
        return self._template_takes_tools

    async def compile(self, constraints: Sequence[tuple[str, StructuredOutputsParams]]) -> None:
        """Compile each (field, constraint) on the engine's compiler, whose cache the engine then
        hits; a bad one is a 400 naming its field. Nothing waits on the engine thread."""
        if self._compiler is None:
            return
        seen = set()
        for param, spec in constraints:
            if spec.key in seen:
                continue
            seen.add(spec.key)
            try:
                await asyncio.wrap_future(self._compiler.submit(spec))
            except ValueError as e:
                raise constraint_error(param, e) from None

    async def _run(self, fn: Callable[[], T]) -> T:
        """`fn()` on the tokenizer thread; a `ParamError` becomes the 400 naming its field."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn)
        except ParamError as e:
            raise param_error(e) from None


def _is_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend is not None and type(backend.decoder).__name__ == "ByteLevel"


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte <-> printable-character table, inverted (char -> byte)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars
