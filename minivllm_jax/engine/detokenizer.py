"""Incremental detokenization that never splits a UTF-8 character and never leaks a stop string.

Decoding the whole output every step is O(n) per token; instead we decode a small window (the
tokens since the start of the previous emission) and emit what it adds beyond its already
emitted head: vLLM's prefix/read offsets, with the window trimmed so prefix_offset stays 0.
Byte-level BPE tokens can end inside a character (the decode then ends in U+FFFD), so we wait
for the next token. Text that may still turn out to start a stop string is held back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

INITIAL_CONTEXT = 5  # prompt tokens decoded before the first output token (for spacing rules)
REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns a stream of token ids into stable text deltas, cut before the first stop string.

    `text` is everything returned by `add` and `flush` so far; text held back because it may
    begin a stop string (or still ends in a partial character) appears only once it is known
    safe, or on `flush()`, which the caller invokes when the sequence ends for another reason.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop: str | Sequence[str] = (),
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = [s for s in ([stop] if isinstance(stop, str) else stop) if s]
        self.finished = False
        self.stop_reason: str | None = None
        self._ids = list(prompt_ids[-INITIAL_CONTEXT:])  # the decode window
        self._read = len(self._ids)  # _ids[:_read] decodes to _prefix_text, already emitted
        self._prefix_text = self._decode(self._ids)
        if self._prefix_text.endswith(REPLACEMENT):  # the prompt ends mid-character: no context
            self._ids, self._read, self._prefix_text = [], 0, ""
        self._text = ""  # stable output text (may include held-back characters)
        self._emitted = 0  # characters of `_text` already returned

    @property
    def text(self) -> str:
        """The output text returned so far (all of it after `flush()`), cut before a stop string."""
        return self._text[: self._emitted]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: Sequence[int]) -> str:
        """Feed new output tokens; return the text that became stable and safe to show."""
        if self.finished:
            return ""
        self._ids.extend(token_ids)
        window = self._decode(self._ids)
        if len(window) <= len(self._prefix_text) or window.endswith(REPLACEMENT):
            return ""  # nothing new, or a character is still incomplete
        new = window[len(self._prefix_text) :]
        del self._ids[: self._read]  # the next window starts where this one's new part began
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        return self._append(new)

    def flush(self) -> str:
        """Return everything still held back (call when the sequence ends for another reason)."""
        if self.finished:
            return ""
        window = self._decode(self._ids)
        out = self._append(window[len(self._prefix_text) :])  # a trailing partial char, if any
        self._ids, self._read, self._prefix_text = [], 0, ""
        out += self._text[self._emitted :]
        self._emitted = len(self._text)
        return out

    def _append(self, new: str) -> str:
        """Add stable text, stop at the earliest stop string, and emit what cannot start one."""
        start = max(0, len(self._text) - max((len(s) for s in self.stop), default=0) + 1)
        self._text += new
        hits = [(i, n, s) for n, s in enumerate(self.stop) if (i := self._text.find(s, start)) >= 0]
        if hits:
            cut, _, self.stop_reason = min(hits)  # earliest position; the first listed on a tie
            self._text, self.finished = self._text[:cut], True
            safe = cut
        else:
            safe = self._held_from()
        out = self._text[self._emitted : safe]
        self._emitted = max(self._emitted, safe)
        return out

    def _held_from(self) -> int:
        """Start of the longest tail that could still grow into a stop string (else the end)."""
        n = len(self._text)
        longest = max((len(s) for s in self.stop), default=1)
        for i in range(max(self._emitted, n - longest + 1), n):
            tail = self._text[i:]
            if any(s.startswith(tail) for s in self.stop):
                return i
        return n
