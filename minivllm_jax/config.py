"""Frozen, hashable configs: `ModelConfig` (the math; `minivllm_jax.models.hf_config` builds it
from an HF config dict)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

PREEMPTION_MODES = ("recompute", "swap", "auto")


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
    # What other families change in the one decoder (`models/decoder.py`). The defaults are Llama's,
    # and the decoder branches on them in Python: a feature that is off adds nothing to the program.
    family: str = "llama"  # the family's name in `models/registry.py`
    qkv_bias: bool = (
        False  # bias on q/k/v but not o_proj (Qwen2); `attention_bias` puts one on all four
    )
    qk_norm: bool = False  # RMSNorm over head_dim on each q and k head before RoPE (Qwen3, Gemma 3)
    norm_weight_offset: float = 0.0  # RMSNorm scales by (offset + w) in float32 (Gemma: 1.0)
    embedding_scale: float | None = (
        None  # embeddings times this, in the model dtype (Gemma: sqrt(hidden))
    )
    hidden_act: str = "silu"  # the MLP's gate activation: "silu" or "gelu_pytorch_tanh"
    sandwich_norms: bool = (
        False  # attention and MLP outputs normed too, and the MLP input by its own norm (Gemma)
    )
    attn_logit_softcap: float | None = None  # attention scores -> c * tanh(scores / c) (Gemma 2)
    final_logit_softcap: float | None = None  # logits -> c * tanh(logits / c) (Gemma 2)
    query_pre_attn_scalar: float | None = (
        None  # attention scale is its -1/2 power (Gemma); None: head_dim's
    )
    # Per layer: the sliding window w (a token at position p sees keys at positions > p - w) or 0 for
    # full attention; () when every layer is full.
    layer_windows: tuple[int, ...] = ()
    local_rope_theta: float | None = (
        None  # RoPE base of the sliding-window layers, unscaled (Gemma 3)
    )

    @property
    def rope_scaling_dict(self) -> dict[str, float]:
        return dict(self.rope_scaling[1]) if self.rope_scaling else {}

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def has_sliding_window(self) -> bool:
        """Some layer attends through a sliding window."""
        return any(self.layer_windows)

    @property
    def attention_extras(self) -> tuple[str, ...]:
        """What this model's attention adds to the plain causal softmax at scale head_dim ** -0.5
        (empty for Llama): only the reference attention implements these."""
        extras = ("a sliding window",) if self.has_sliding_window else ()
        extras += ("attention logit soft-capping",) if self.attn_logit_softcap is not None else ()
        return extras + (
            ("a non-default attention scale",)
            if self.attention_scale != self.head_dim**-0.5
            else ()
        )


RopeScaling = tuple[str, tuple[tuple[str, float], ...]]  # ModelConfig.rope_scaling


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


SMALL_SEQ_BUCKET = (
    16  # steps of many tokens but few sequences (one long prompt chunk and a few decodes)
)


KV_CACHE_DTYPES = ("auto", "int8")  # "auto": the model's dtype; "int8": see kv_cache.py


def check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")


def _check_at_least(config: Any, minimum: int, *names: str) -> None:
    for name in names:
        if getattr(config, name) < minimum:
            raise ValueError(f"{name} must be >= {minimum}, got {getattr(config, name)}")


# The engine's knobs, grouped as vLLM groups them. Each field's default and meaning are declared
# once, in `minivllm_jax.args.EngineArgs`, which builds these (`EngineArgs.create_engine_config`);
# the groups hold the values, check them, and derive what follows from them (buckets, shapes).


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """Where KV pages live: the page pool, its dtype, the prefix cache and the tiers under it
    (a host pool for swapped-out pages, a disk tier for evicted cached pages)."""

    page_size: int
    num_pages: int  # including the scratch page
    kv_cache_dtype: str
    enable_prefix_caching: bool
    swap_space_gb: float
    kv_disk_dir: str | None
    kv_disk_gb: float

    def __post_init__(self) -> None:
        _check_at_least(self, 1, "page_size")
        if self.num_pages < 2:
            raise ValueError(
                f"num_pages must be >= 2 (page 0 is the scratch page), got {self.num_pages}"
            )
        check_kv_cache_dtype(self.kv_cache_dtype)
        if self.kv_disk_dir is not None:
            if not self.kv_disk_gb > 0:
                raise ValueError(f"kv_disk_gb must be > 0, got {self.kv_disk_gb}")
            if not self.enable_prefix_caching:
                raise ValueError(
                    "kv_disk_dir is a tier of the prefix cache: it needs enable_prefix_caching=True"
                )


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """What one step may hold and how steps are chosen; every step shape comes from the buckets
    here (see the README's "Scheduling" section for the benchmark behind each policy)."""

    max_num_seqs: int  # sequences in one step (and running at once)
    max_num_batched_tokens: int  # tokens in one step: decodes first, then prompt chunks
    target_tpot_ms: float | None
    target_ttft_ms: float | None
    max_batch_wait_ms: float
    async_scheduling: bool
    num_scheduler_steps: int  # decode steps per program when only decodes run (1: off)
    preemption_mode: str

    def __post_init__(self) -> None:
        _check_at_least(self, 1, "max_num_seqs", "num_scheduler_steps")
        _check_at_least(self, 16, "max_num_batched_tokens")
        for name in ("target_tpot_ms", "target_ttft_ms"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 or None, got {value}")
        if not self.max_batch_wait_ms >= 0:
            raise ValueError(f"max_batch_wait_ms must be >= 0, got {self.max_batch_wait_ms}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}"
            )

    @property
    def token_buckets(self) -> tuple[int, ...]:
        """Token counts of a step. 1, 2, 4, then up to `max_num_seqs` (where decode-only steps
        live) half-octave steps, so a decode batch pads by at most 50%; above it doublings, since those steps carry
        prompt work and the scheduler fills their bucket with prompt tokens. Each bucket is a
        compiled program, so fewer is a faster start-up."""
        decode_cap = min(self.max_num_seqs, self.max_num_batched_tokens)
        small = _doubling(1, min(4, decode_cap))  # 3 rows cost what 4 do: matvecs are memory bound
        buckets = (
            set(small)
            | set(_ladder(small[-1], decode_cap))
            | set(_doubling(decode_cap, self.max_num_batched_tokens))
        )
        return tuple(sorted(b for b in buckets if b <= self.max_num_batched_tokens))

    def seq_buckets(self, num_tokens: int) -> tuple[int, ...]:
        """Sequence counts of a step of `num_tokens` tokens: as many as fit, and a small one
        (the LM head and the sampler run per sequence, so a long chunk with a few decodes
        should not pay for 64 rows)."""
        full = min(num_tokens, self.max_num_seqs)
        return tuple(sorted({full, min(full, SMALL_SEQ_BUCKET)}))

    def step_shapes(self) -> list[tuple[int, int]]:
        """(tokens, sequences) of every step program."""
        return [(t, s) for t in self.token_buckets for s in self.seq_buckets(t)]

    def multi_step_shapes(self) -> list[tuple[int, int]]:
        """(tokens, sequences) of the multi-step decode programs: the decode-only buckets."""
        if self.num_scheduler_steps == 1:
            return []
        return [
            (t, s)
            for t, s in self.step_shapes()
            if t <= min(self.max_num_seqs, self.max_num_batched_tokens)
        ]


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """How many devices serve the model: tensor parallel within a replica, data-parallel replicas."""

    tensor_parallel_size: int
    data_parallel_size: int

    def __post_init__(self) -> None:
        _check_at_least(self, 1, "tensor_parallel_size", "data_parallel_size")


GROUPS = ("cache", "scheduler", "parallel")  # EngineConfig's fields that are knob groups


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Engine knobs (separate from the model math), grouped: `cache`, `scheduler`, `parallel`,
    plus the sequence length, the attention implementation, speculative decoding and KV
    compression. Built by `minivllm_jax.args.EngineArgs.create_engine_config`, where each knob's
    default and meaning are declared.

    `attention` is resolved by the runner (`resolve_attention`); `speculative` and
    `kv_compression` are None when off; `allow_request_kv_compression` compiles the page-score
    programs at warm-up so that a request may bring its own policy."""

    max_model_len: int  # prompt + output tokens of one sequence
    attention: str
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    speculative: SpeculativeConfig | None
    kv_compression: KVCompressionConfig | None
    allow_request_kv_compression: bool

    def __post_init__(self) -> None:
        _check_at_least(self, 1, "max_model_len")
        if self.kv_compression is not None:
            self.kv_compression.check_page_size(self.cache.page_size)
        mode = self.scheduler.preemption_mode
        if mode != "recompute" and not self.cache.swap_space_gb > 0:
            raise ValueError(
                f"preemption_mode={mode!r} needs swap_space_gb > 0, got {self.cache.swap_space_gb}"
            )

    def check_model(self, model_config: Any) -> None:
        """Raise ValueError unless an engine with this config can serve `model_config`: one
        max_model_len sequence must fit in the pages, and a KV compression policy must suit it."""
        if self.cache.num_pages - 1 < self.max_pages_per_seq:
            raise ValueError(
                f"num_pages={self.cache.num_pages} cannot hold one max_model_len={self.max_model_len} sequence "
                f"({self.max_pages_per_seq} pages of {self.cache.page_size} + the scratch page)"
            )
        if self.kv_compression is not None:
            self.kv_compression.check_model(model_config)

    def replace(self, **knobs: Any) -> EngineConfig:
        """A copy with some knobs changed, each named as `EngineArgs` names it (`page_size=8`,
        `async_scheduling=False`) whichever group holds it; the groups check the new values."""
        changes: dict[str, Any] = {}
        for name in GROUPS:
            group = getattr(self, name)
            mine = {f.name for f in dataclasses.fields(group)} & set(knobs)
            if mine:
                changes[name] = dataclasses.replace(group, **{k: knobs.pop(k) for k in mine})
        return dataclasses.replace(self, **changes, **knobs)

    def knobs(self) -> dict[str, Any]:
        """Every knob by its `EngineArgs` name, the groups flattened, as plain data (for a
        results file)."""
        flat = dataclasses.asdict(self)
        for name in GROUPS:
            flat.update(flat.pop(name))
        return flat

    @property
    def max_pages_per_seq(self) -> int:
        return -(-self.max_model_len // self.cache.page_size)

    def num_listed_pages(self, num_seqs: int) -> int:
        """Length of the flat page list of a step of `num_seqs` sequences: room for all of
        their pages. Work follows the real count (see `minivllm_jax.ops.attention`), not this."""
        return num_seqs * self.max_pages_per_seq

    def verify_rows(self, num_tokens: int, num_seqs: int) -> int:
        """Sampled rows of a verify program: each sequence's last token and its draft tokens."""
        return min(num_tokens, num_seqs * (1 + self.speculative.num_speculative_tokens))

    def verify_shapes(self) -> list[tuple[int, int]]:
        """(tokens, sequences) of the verify programs: every step bucket, when speculating."""
        return self.scheduler.step_shapes() if self.speculative is not None else []


# Auto TPOT target: 2x a decode-only step is the ceiling; aim lower, since step times are
# estimates and a stream sees the slowest of its steps.
AUTO_TPOT_FACTOR = 1.5


def bucket_for(value: int, buckets: tuple[int, ...]) -> int:
    """Smallest bucket >= value (buckets ascending)."""
    for b in buckets:
        if value <= b:
            return b
    raise ValueError(f"{value} exceeds the largest bucket {buckets[-1]}")


# KV compression (engine/kv/compression.py applies it): what to keep of a long sequence's cache.
POLICIES = ("sink_window", "page_scores")


@dataclasses.dataclass(frozen=True)
class KVCompressionConfig:
    """What to keep of a long sequence's KV cache. Hashable: it may sit in a static config."""

    policy: str  # "sink_window" | "page_scores"
    sink_tokens: int = 4  # attention sinks: the first pages covering these tokens are always kept
    window_tokens: int = 256  # the most recent (full-page) tokens always kept
    budget_tokens: int | None = (
        None  # page_scores: tokens kept in all (sinks + window + best-scored pages)
    )

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(
                f"unknown KV compression policy {self.policy!r}; available: {', '.join(POLICIES)}"
            )
        for name in ("sink_tokens", "window_tokens", "budget_tokens"):
            value = getattr(self, name)
            if value is None and name == "budget_tokens":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if self.policy == "page_scores":
            if self.budget_tokens is None:
                raise ValueError("policy 'page_scores' needs budget_tokens (tokens kept in all)")
            if self.budget_tokens < self.sink_tokens + self.window_tokens:
                raise ValueError(
                    f"budget_tokens ({self.budget_tokens}) must be >= sink_tokens + window_tokens "
                    f"({self.sink_tokens} + {self.window_tokens})"
                )
        elif self.budget_tokens is not None:
            raise ValueError(f"budget_tokens is for policy 'page_scores', not {self.policy!r}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVCompressionConfig:
        """From a JSON object (a server flag or a request field); unknown keys are an error."""
        if not isinstance(d, dict):
            raise ValueError(
                f"a KV compression config must be a JSON object, got {type(d).__name__}"
            )
        unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"unknown KV compression keys: {', '.join(map(str, unknown))}")
        if "policy" not in d:
            raise ValueError(
                f"a KV compression config needs 'policy' (one of {', '.join(POLICIES)})"
            )
        return cls(**d)

    def check_page_size(self, page_size: int) -> None:
        """The budget must hold the sink and window pages whole: both round up to pages."""
        if self.policy == "page_scores":
            fixed = (
                -(-self.sink_tokens // page_size) - (-self.window_tokens // page_size)
            ) * page_size
            if self.budget_tokens < fixed:
                raise ValueError(
                    f"budget_tokens ({self.budget_tokens}) must be >= the sink and window rounded to "
                    f"pages of {page_size} ({fixed})"
                )

    def check_model(self, model_config: Any) -> None:
        """Refuse a model with sliding-window layers (`ModelConfig.has_sliding_window`): its windows
        count keys by cache index, which dropped pages would make differ from positions."""
        if model_config.has_sliding_window:
            raise ValueError(
                f"KV compression is not supported for {model_config.family} models with sliding-window "
                f"attention; use kv_compression=None"
            )


# Speculative decoding (engine/decoding/speculative.py proposes and verifies drafts).
@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4  # draft tokens proposed per step, at most
    prompt_lookup_max: int = 4  # longest suffix n-gram looked up
    prompt_lookup_min: int = 2  # shortest
    # vLLM's: no drafts while more sequences than this run. A verify step feeds 1 + k rows a
    # sequence; past a few rows the step is compute-bound (on CPU, XLA's matmul of 2-8 rows
    # already costs about twice its 1-row one), so a large batch gains less than it pays.
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method != "ngram":
            raise ValueError(
                f"speculative method {self.method!r} is not supported; use 'ngram' (prompt lookup)"
            )
        if (
            not isinstance(self.num_speculative_tokens, int)
            or not 1 <= self.num_speculative_tokens <= 16
        ):
            raise ValueError(
                f"num_speculative_tokens must be an integer in [1, 16], got {self.num_speculative_tokens!r}"
            )
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
            raise ValueError(
                f"need integers 1 <= prompt_lookup_min <= prompt_lookup_max, got {lo!r} and {hi!r}"
            )
        limit = self.disable_by_batch_size
        if limit is not None and (not isinstance(limit, int) or limit < 1):
            raise ValueError(
                f"disable_by_batch_size must be a positive integer or None, got {limit!r}"
            )

    @classmethod
    def from_dict(
        cls, config: Mapping[str, Any] | SpeculativeConfig | None
    ) -> SpeculativeConfig | None:
        """vLLM's dict form. A missing `prompt_lookup_min` is 2, or `prompt_lookup_max` when
        that is smaller."""
        if config is None or isinstance(config, SpeculativeConfig):
            return config
        if not isinstance(config, Mapping):
            raise ValueError(f"speculative_config must be a dict, got {type(config).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(config) - names
        if unknown:
            raise ValueError(
                f"unknown speculative_config keys {sorted(unknown)}; accepted: {sorted(names)}"
            )
        if "method" not in config:
            raise ValueError("speculative_config needs a 'method' (only 'ngram' is supported)")
        config = dict(config)
        if "prompt_lookup_max" in config and "prompt_lookup_min" not in config:
            config["prompt_lookup_min"] = min(config["prompt_lookup_max"], cls.prompt_lookup_min)
        return cls(**config)
