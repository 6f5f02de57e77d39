"""`SamplingParams`: how one request samples, validated on construction (vLLM names and meanings)."""

from __future__ import annotations

import dataclasses

from minivllm_jax.kv_compression import KVCompressionConfig
from minivllm_jax.structured_output import StructuredOutputsParams, as_structured_outputs

MAX_LOGPROBS = 20  # top-k logprobs are computed for this many candidates on device, every step


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings; `temperature=0` means greedy.

    On device these values become per-row arrays of the batch, so mixing them never recompiles.
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
    # fields); None: the engine's `kv_compression`, if any (`minivllm_jax.kv_compression`).
    kv_compression: KVCompressionConfig | dict | None = None
    # Constrain the output to a JSON schema, regex, choice or grammar (a dict is read as the
    # params' fields; `minivllm_jax.structured_output`).
    structured_outputs: StructuredOutputsParams | dict | None = None

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(msg)

        if not isinstance(self.n, int) or self.n < 1:
            bad(f"n must be an integer >= 1, got {self.n!r}")
        if not self.temperature >= 0.0:  # also rejects NaN
            bad(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k == 0 or self.top_k < -1:
            bad(f"top_k must be -1 (disabled) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad(f"max_tokens must be a positive integer or None, got {self.max_tokens!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            bad(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty!r}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty!r}")
        if not self.repetition_penalty > 0.0:
            bad(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**63):
            bad(f"seed must be a non-negative integer, got {self.seed!r}")
        if self.n > 1 and self.temperature == 0.0:
            bad("n > 1 needs temperature > 0 (greedy samples would all be identical)")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in stops):
            bad(f"stop must be a non-empty string or a list of non-empty strings, got {self.stop!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids or []):
            bad(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        if isinstance(self.kv_compression, dict):
            try:
                object.__setattr__(self, "kv_compression", KVCompressionConfig.from_dict(self.kv_compression))
            except (TypeError, ValueError) as e:
                bad(f"kv_compression: {e}")
        elif self.kv_compression is not None and not isinstance(self.kv_compression, KVCompressionConfig):
            bad(f"kv_compression must be a KVCompressionConfig, a dict or None, got {type(self.kv_compression).__name__}")
        try:
            object.__setattr__(self, "structured_outputs", as_structured_outputs(self.structured_outputs))
        except (TypeError, ValueError) as e:
            bad(str(e) if str(e).startswith("structured_outputs") else f"structured_outputs: {e}")
        object.__setattr__(self, "stop", stops)
        object.__setattr__(self, "stop_token_ids", list(self.stop_token_ids or []))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
