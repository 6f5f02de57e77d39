"""Frozen, hashable configs: `ModelConfig` (the math) built purely from an HF config dict."""

from __future__ import annotations

import dataclasses
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture or one of its options is not implemented."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Everything the model math needs; hashable so it can be a static jit argument."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    # ("llama3", (("factor", 8.0), ...)) — a sorted tuple of items keeps the config hashable.
    rope_scaling: tuple[str, tuple[tuple[str, float], ...]] | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def rope_scaling_dict(self) -> dict[str, float]:
        return dict(self.rope_scaling[1]) if self.rope_scaling else {}

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Build from a `config.json` dict (transformers 4.x or 5.x layout)."""
        archs = tuple(hf.get("architectures") or ())
        model_type = hf.get("model_type")
        if not (set(archs) & set(SUPPORTED_ARCHITECTURES)) and model_type != "llama":
            raise UnsupportedModelError(
                f"unsupported architecture {archs or model_type!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)} (model_type 'llama')"
            )
        if hf.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"unsupported hidden_act {hf['hidden_act']!r}; only 'silu'")
        num_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads

        # transformers 5 moved rope_theta (and the scaling dict) into `rope_parameters`.
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        rope_theta = float(rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))
        rope_type = rope.pop("rope_type", rope.pop("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        rope_scaling = None
        if rope_type != "default":
            items = tuple(sorted((k, float(v)) for k, v in rope.items() if isinstance(v, (int, float))))
            rope_scaling = (rope_type, items)

        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            rope_scaling=rope_scaling,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


def _doubling(start: int, stop: int) -> tuple[int, ...]:
    """start, 2*start, ... capped by stop, always ending exactly at stop."""
    out, x = [], start
    while x < stop:
        out.append(x)
        x *= 2
    return tuple(out) + (stop,)


def _ladder(start: int, stop: int) -> tuple[int, ...]:
    """start, 1.5*start, 2*start, 3*start, ... capped by stop, ending exactly at stop.

    Half-octave steps where padding costs memory traffic that no matmul amortizes (decode
    page lists): a value pads by at most 50% instead of 100%, for about twice the programs."""
    octaves = _doubling(start, stop)
    return tuple(sorted({x for o in octaves for x in (o, o * 3 // 2) if x <= stop}))


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Engine knobs (separate from the model math). Every step shape comes from the buckets here."""

    max_num_seqs: int = 64  # rows in a decode step
    max_model_len: int = 2048  # prompt + output tokens of one sequence
    page_size: int = 16
    num_pages: int = 1024  # including the scratch page
    max_num_batched_tokens: int = 512  # padded tokens in one prefill step (also the chunk size)
    max_prefill_rows: int = 4
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_model_len", "page_size", "max_num_batched_tokens", "max_prefill_rows"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is the scratch page), got {self.num_pages}")
        if self.max_num_batched_tokens < 16:
            raise ValueError(f"max_num_batched_tokens must be >= 16, got {self.max_num_batched_tokens}")

    @property
    def max_pages_per_seq(self) -> int:
        return -(-self.max_model_len // self.page_size)

    @property
    def decode_batch_buckets(self) -> tuple[int, ...]:
        return _doubling(1, self.max_num_seqs)

    def page_list_buckets(self, rows: int) -> tuple[int, ...]:
        """Lengths of the flat page list of a decode step with `rows` rows (a `_ladder` from 16).

        A batch in this rows bucket has more than rows/2 sequences, each with at least one
        cached page, so shorter lists are never needed."""
        cap = rows * self.max_pages_per_seq
        return tuple(n for n in _ladder(min(16, cap), cap) if n > rows // 2)

    @property
    def prefill_page_buckets(self) -> tuple[int, ...]:
        """Prefill rows mostly have no cached past (width 1: only the scratch page); a chunk
        continuation or a prefix-cache hit takes the full width. Two widths keep warm-up short."""
        return (1, self.max_pages_per_seq) if self.max_pages_per_seq > 1 else (1,)

    @property
    def prefill_token_buckets(self) -> tuple[int, ...]:
        return _doubling(min(16, self.max_num_batched_tokens), self.max_num_batched_tokens)

    def prefill_row_buckets(self, tokens: int) -> tuple[int, ...]:
        """Rows of a prefill step of `tokens` columns: 1, or several short prompts together."""
        rows = _doubling(1, self.max_prefill_rows)
        return tuple(r for r in rows if r == 1 or r * tokens <= self.max_num_batched_tokens)

    def prefill_shapes(self) -> list[tuple[int, int, int, int]]:
        """(rows, tokens, block-table width, page-list length) of every prefill program."""
        return [
            (rows, tokens, pages, 0)
            for tokens in self.prefill_token_buckets
            for rows in self.prefill_row_buckets(tokens)
            for pages in self.prefill_page_buckets
        ]

    def decode_shapes(self) -> list[tuple[int, int, int, int]]:
        """Decode programs: no block table, a flat page list instead (see `StepBatch`)."""
        return [(rows, 1, 0, n) for rows in self.decode_batch_buckets for n in self.page_list_buckets(rows)]


def bucket_for(value: int, buckets: tuple[int, ...]) -> int:
    """Smallest bucket >= value (buckets ascending)."""
    for b in buckets:
        if value <= b:
            return b
    raise ValueError(f"{value} exceeds the largest bucket {buckets[-1]}")
