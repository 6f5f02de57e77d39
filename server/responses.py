"""OpenAI response bodies built from the engine's cumulative `RequestOutput`s.

`ChoiceTracker` turns cumulative outputs into per-choice deltas (the text only grows), which
the completions/chat formatters render as JSON bodies or SSE chunks and the WebSocket handler
as token messages.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from typing import Any

from minivllm_jax.engine.decoding.beam_search import BeamSearchOutput
from minivllm_jax.outputs import CompletionOutput, RequestMetrics, RequestOutput
from server.preprocess import TokenTable
from server.tool_calls import ToolCallParser, ToolPlan, delta_messages, message_parts

MIN_LOGPROB = -9999.0  # JSON has no -Infinity


@dataclasses.dataclass
class Delta:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None


class ChoiceTracker:
    """Remembers what was already sent for each choice."""

    def __init__(self, n: int) -> None:
        self.chars = [0] * n
        self.tokens = [0] * n
        self.done = [False] * n

    def deltas(self, out: RequestOutput) -> list[Delta]:
        result = []
        for c in out.outputs:
            i = c.index
            if self.done[i]:
                continue
            text, ids = c.text[self.chars[i] :], c.token_ids[self.tokens[i] :]
            logprobs = c.logprobs[self.tokens[i] :] if c.logprobs is not None else None
            self.chars[i], self.tokens[i] = len(c.text), len(c.token_ids)
            self.done[i] = c.finish_reason is not None
            if text or ids or c.finish_reason:
                result.append(Delta(i, text, ids, logprobs, c.finish_reason))
        return result


def beam_search_output(
    request_id: str, prompt_ids: list[int], out: BeamSearchOutput
) -> RequestOutput:
    """A beam search's hypotheses as one finished output, choice i the i-th best, for the
    formatters; each choice's token_ids are its generated tokens (the EOS that ended it included)."""
    n = len(prompt_ids)
    choices = [
        CompletionOutput(i, s.text, s.tokens[n:], s.cum_logprob, None, s.finish_reason)
        for i, s in enumerate(out.sequences)
    ]
    return RequestOutput(
        request_id, None, list(prompt_ids), choices, True, RequestMetrics(time.monotonic())
    )


def usage(out: RequestOutput | None, prompt_tokens: int) -> dict[str, int]:
    completion = sum(len(c.token_ids) for c in out.outputs) if out is not None else 0
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
    }


def _finite(lp: float) -> float:
    return lp if math.isfinite(lp) else MIN_LOGPROB


def _top(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    """The engine's entry holds the sampled token plus the top-k; keep the k most likely."""
    return sorted(entry.items(), key=lambda kv: -kv[1])[:k]


def completion_logprobs(
    table: TokenTable, ids: list[int], entries: list[dict[int, float]], k: int, offset: int
) -> dict[str, Any]:
    """Legacy completions format; `offset` is where these tokens start in the choice's text."""
    tokens = [table.text(t) for t in ids]
    offsets = []
    for tok in tokens:
        offsets.append(offset)
        offset += len(tok)
    return {
        "tokens": tokens,
        "token_logprobs": [_finite(e.get(t, -math.inf)) for t, e in zip(ids, entries)],
        "top_logprobs": [{table.text(i): _finite(lp) for i, lp in _top(e, k)} for e in entries],
        "text_offset": offsets,
    }


def chat_logprobs(
    table: TokenTable, ids: list[int], entries: list[dict[int, float]], k: int
) -> list[dict[str, Any]]:
    """Chat format: one entry per token with its bytes and its top-k alternatives."""

    def item(t: int, lp: float) -> dict[str, Any]:
        return {"token": table.text(t), "logprob": _finite(lp), "bytes": table.bytes(t)}

    return [
        {**item(t, e.get(t, -math.inf)), "top_logprobs": [item(i, lp) for i, lp in _top(e, k)]}
        for t, e in zip(ids, entries)
    ]


def sse(data: dict[str, Any] | str) -> str:
    body = (
        data
        if isinstance(data, str)
        else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    )
    return f"data: {body}\n\n"


class _Formatter:
    object_name = ""
    chunk_object_name = ""

    def __init__(
        self,
        request_id: str,
        model: str,
        created: int,
        table: TokenTable,
        top_k: int | None,
        n: int,
        include_usage: bool = False,
    ) -> None:
        self.id, self.model, self.created, self.table = request_id, model, created, table
        self.top_k = top_k  # None: no logprobs requested
        self.tracker = ChoiceTracker(n)
        self.include_usage = include_usage
        self._offsets = [0] * n

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        body = {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if obj == self.chunk_object_name and self.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, out: RequestOutput | None, prompt_tokens: int) -> dict[str, Any]:
        body = self._envelope(self.chunk_object_name, [])
        body["usage"] = usage(out, prompt_tokens)
        return body


class CompletionFormatter(_Formatter):
    object_name, chunk_object_name = "text_completion", "text_completion"

    def _logprobs(self, d: Delta) -> dict[str, Any] | None:
        if self.top_k is None or d.logprobs is None:
            return None
        lp = completion_logprobs(
            self.table, d.token_ids, d.logprobs, self.top_k, self._offsets[d.index]
        )
        self._offsets[d.index] += sum(len(t) for t in lp["tokens"])
        return lp

    def response(self, out: RequestOutput, prompt_tokens: int) -> dict[str, Any]:
        choices = []
        for d in self.tracker.deltas(out):
            logprobs = self._logprobs(d)
            choices.append(
                {
                    "index": d.index,
                    "text": d.text,
                    "logprobs": logprobs,
                    "finish_reason": d.finish_reason,
                }
            )
        body = self._envelope(self.object_name, sorted(choices, key=lambda c: c["index"]))
        body["usage"] = usage(out, prompt_tokens)
        return body

    def start_chunks(self) -> list[dict[str, Any]]:
        return []

    def chunks(self, out: RequestOutput) -> list[dict[str, Any]]:
        result = []
        for d in self.tracker.deltas(out):
            logprobs = self._logprobs(d)
            if d.text or logprobs:
                choice = {
                    "index": d.index,
                    "text": d.text,
                    "logprobs": logprobs,
                    "finish_reason": None,
                }
                result.append(self._envelope(self.chunk_object_name, [choice]))
            if d.finish_reason:
                choice = {
                    "index": d.index,
                    "text": "",
                    "logprobs": None,
                    "finish_reason": d.finish_reason,
                }
                result.append(self._envelope(self.chunk_object_name, [choice]))
        return result


class ChatFormatter(_Formatter):
    """With a `tool_plan`, each choice's text goes through a `ToolCallParser`: calls come out as
    `tool_calls` (streamed as `delta.tool_calls`), the rest as content."""

    object_name, chunk_object_name = "chat.completion", "chat.completion.chunk"

    def __init__(self, *args: Any, tool_plan: ToolPlan | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        n = len(self.tracker.done)
        self.parsers = (
            [ToolCallParser(tool_plan) for _ in range(n)] if tool_plan is not None else None
        )

    def _message(self, d: Delta) -> tuple[dict[str, Any], str | None]:
        if self.parsers is None:
            return {"role": "assistant", "content": d.text}, d.finish_reason
        parser = self.parsers[d.index]
        content, calls = message_parts(parser.feed(d.text) + parser.finish())
        message: dict[str, Any] = {
            "role": "assistant",
            "content": content or (None if calls else ""),
        }
        if calls:
            message["tool_calls"] = calls
        return message, parser.finish_reason(d.finish_reason)

    def _logprobs(self, d: Delta) -> dict[str, Any] | None:
        if self.top_k is None or d.logprobs is None:
            return None
        return {"content": chat_logprobs(self.table, d.token_ids, d.logprobs, self.top_k)}

    def response(self, out: RequestOutput, prompt_tokens: int) -> dict[str, Any]:
        choices = []
        for d in self.tracker.deltas(out):
            message, finish_reason = self._message(d)
            lp = self._logprobs(d)
            choices.append(
                {
                    "index": d.index,
                    "message": message,
                    "logprobs": lp,
                    "finish_reason": finish_reason,
                }
            )
        body = self._envelope(self.object_name, sorted(choices, key=lambda c: c["index"]))
        body["usage"] = usage(out, prompt_tokens)
        return body

    def start_chunks(self) -> list[dict[str, Any]]:
        """OpenAI streams open each choice with a role-only delta."""
        return [
            self._envelope(
                self.chunk_object_name,
                [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
            )
            for i in range(len(self.tracker.done))
        ]

    def chunks(self, out: RequestOutput) -> list[dict[str, Any]]:
        result = []
        for d in self.tracker.deltas(out):
            logprobs = self._logprobs(d)
            deltas, finish_reason = (
                [{"content": d.text}] if d.text or logprobs else [],
                d.finish_reason,
            )
            if self.parsers is not None:
                parser = self.parsers[d.index]
                deltas = delta_messages(
                    parser.feed(d.text) + (parser.finish() if d.finish_reason else [])
                )
                finish_reason = parser.finish_reason(d.finish_reason)
                if logprobs and not deltas:  # the text is held back (it may open a tool call)
                    deltas = [{}]
            for i, delta in enumerate(deltas):
                choice = {
                    "index": d.index,
                    "delta": delta,
                    "logprobs": logprobs if i == 0 else None,
                    "finish_reason": None,
                }
                result.append(self._envelope(self.chunk_object_name, [choice]))
            if finish_reason:
                choice = {
                    "index": d.index,
                    "delta": {},
                    "logprobs": None,
                    "finish_reason": finish_reason,
                }
                result.append(self._envelope(self.chunk_object_name, [choice]))
        return result
