"""`EngineArgs`: every engine knob, declared once (its default, help text and choices).

Everything else is derived from the one dataclass below, as vLLM's `engine/arg_utils.py` and
nano-vllm's `Config` do:

- `LLM(model, **kwargs)`: each keyword is an `EngineArgs` field; an unknown one is a
  TypeError naming it and the closest field (`EngineArgs.from_kwargs`).
- `EngineConfig` and its groups (`CacheConfig`, `SchedulerConfig`, `ParallelConfig` in
  `minivllm_jax.config`): `EngineArgs.create_engine_config(model_config)` fills each group's
  fields from the `EngineArgs` fields of the same name, sizes the KV cache when `num_pages` is
  None and resolves `attention` for the model.
- Command lines (the server's, the benchmarks'): one flag per field, `--max-num-seqs` for
  `max_num_seqs` (booleans as `--flag/--no-flag` pairs):

      parser = argparse.ArgumentParser()
      EngineArgs.add_cli_args(parser, defaults={"max_num_seqs": 32})  # this script's defaults
      args = parser.parse_args()
      llm = LLM.from_engine_args(EngineArgs.from_cli_args(args, use_tqdm=False))

  `defaults` replaces a field's default on that command line only (the server states its own
  in `server/cli.py`'s `SERVER_DEFAULTS`); `exclude` leaves fields off the command line (they
  keep their defaults); keywords of `from_cli_args` win over the parsed flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import typing
from collections.abc import Collection, Mapping
from typing import Any

from minivllm_jax.config import (
    KV_CACHE_DTYPES,
    PREEMPTION_MODES,
    CacheConfig,
    EngineConfig,
    KVCompressionConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from minivllm_jax.engine.runtime import available_memory_bytes
from minivllm_jax.ops.attention import ATTENTION, resolve_attention
from minivllm_jax.ops.kv_cache import kv_bytes_per_page
from minivllm_jax.ops.quantization import LLM_QUANTIZATIONS

DTYPES = ("float32", "bfloat16", "float16")
# max_model_len=None: this, or the model's max_position_embeddings when that is smaller.
DEFAULT_MAX_MODEL_LEN = 2048


def knob(default: Any, help: str, choices: tuple | None = None, flag: str | None = None) -> Any:
    """A field of `EngineArgs`: its default, what it does (one place), and the values it takes.
    `flag` names a boolean's command-line pair (`--prefix-caching/--no-prefix-caching`) where
    the field's own name would read badly."""
    return dataclasses.field(
        default=default, metadata={"help": help, "choices": choices, "flag": flag}
    )


@dataclasses.dataclass
class EngineArgs:
    """Every knob of `LLM` and the engine, with its default. See the module docstring for what
    is derived from it."""

    # ---------------------------------------------------------------- the model and its weights
    model: str = knob(
        "smollm2-135m",
        "the model: an alias such as smollm2-135m, a converted dir, an HF folder or a .gguf file",
    )
    dtype: str = knob(
        "float32",
        "the model's float dtype (weights left full precision, activations, KV pages)",
        choices=DTYPES,
    )
    quantization: str | None = knob(
        None,
        "quantization of every layer's projections (None: none; int8/int4 weight-only, w8a8: "
        "int8 weights and activations; gguf: a GGUF model's own Q4_0/Q4_1 blocks as int4; see "
        "minivllm_jax/ops/quantization.py for the schemes and what stays full precision). A "
        "quantized checkpoint loads as it was stored",
        choices=LLM_QUANTIZATIONS,
    )
    max_model_len: int | None = knob(
        None,
        f"prompt + output tokens of one sequence (None: {DEFAULT_MAX_MODEL_LEN}, or the model's "
        "max_position_embeddings when smaller)",
    )
    attention: str = knob(
        "auto",
        "which implementation of the ragged attention contract runs: the pure-JAX reference, "
        "the native CPU kernel, or auto (native where the kernels are built and serve this "
        "model); MINIVLLM_KERNELS=reference forces the reference",
        choices=("auto", *ATTENTION),
    )
    seed: int = knob(0, "seed of unseeded sampling (data-parallel replica r uses seed + r)")

    # ---------------------------------------------------------------- KV cache (CacheConfig)
    page_size: int = knob(16, "tokens per KV page")
    num_pages: int | None = knob(
        None,
        "KV pages, the scratch page included (None: sized from free memory, see "
        "kv_memory_fraction, and never more than max_num_seqs full-length sequences use)",
    )
    kv_memory_fraction: float = knob(
        0.25,
        "with num_pages=None: the share of the memory available after loading the weights "
        "that the KV cache may take (split between data-parallel replicas)",
    )
    kv_cache_dtype: str = knob(
        "auto",
        "KV pages in the model's dtype (auto) or int8 with a scale per token and KV head "
        "(minivllm_jax/ops/kv_cache.py; 3.8x fewer bytes at head_dim 64: more sequences fit "
        "and attention reads less)",
        choices=KV_CACHE_DTYPES,
    )
    enable_prefix_caching: bool = knob(
        True, "reuse the KV pages of a shared prompt prefix", flag="--prefix-caching"
    )
    swap_space_gb: float = knob(
        4.0, "host pool for swapped-out KV pages in GiB (preemption_mode swap or auto)"
    )
    kv_disk_dir: str | None = knob(
        None,
        "disk tier under the prefix cache (minivllm_jax/engine/kv/disk.py): full pages evicted "
        "from memory, and all cached pages at a clean shutdown, are written here and found "
        "again, also by a later process (None: off)",
    )
    kv_disk_gb: float = knob(10.0, "size budget of kv_disk_dir in GiB (least recently used go)")

    # ---------------------------------------------------------------- scheduling (SchedulerConfig)
    max_num_seqs: int = knob(
        64, "sequences in one step, and running at once (the largest batch bucket)"
    )
    max_num_batched_tokens: int = knob(
        512, "hard cap on the tokens of one step (decodes first, then prompt chunks); >= 16"
    )
    target_tpot_ms: float | None = knob(
        None,
        "while some streaming request decodes, the prompt tokens added to a step are chosen "
        "so that the step's measured time stays under this (None: auto, about AUTO_TPOT_FACTOR "
        "times a decode-only step of the same decodes); offline requests (LLM.generate) have no "
        "TPOT to protect and always get the whole budget",
    )
    target_ttft_ms: float | None = knob(
        None, "a prompt that has waited this long gets the whole token budget (None: off)"
    )
    max_batch_wait_ms: float = knob(
        0.0, "hold new admissions up to this long to gather a bigger batch (0: admit now)"
    )
    async_scheduling: bool = knob(
        True,
        "schedule and dispatch step N+1 before reading step N's tokens (fed back on the "
        "device), so host work overlaps the device step; off: wait for each step (same tokens)",
    )
    num_scheduler_steps: int = knob(
        1,
        "k > 1 runs k decode steps in one device program whenever a step would only decode: "
        "one dispatch and one read for k tokens a row; streams then get up to k tokens at a "
        "time, and a new request waits up to k steps for its first (1: off)",
    )
    preemption_mode: str = knob(
        "recompute",
        "a preempted sequence's KV: freed and recomputed on resume (recompute), copied to a "
        "host pool of swap_space_gb and back (swap), or whichever a cost model says is cheaper "
        "for that sequence (auto; minivllm_jax/engine/kv/swap.py)",
        choices=PREEMPTION_MODES,
    )

    # ---------------------------------------------------------------- speculative, KV compression
    speculative_config: dict | SpeculativeConfig | None = knob(
        None,
        'n-gram speculative decoding in decode-only steps, as vLLM\'s dict: {"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2} '
        "(None: off)",
    )
    kv_compression: dict | KVCompressionConfig | None = knob(
        None,
        'drop KV pages of long sequences by a policy, for every request: {"policy": '
        '"sink_window", "window_tokens": 512} or {"policy": "page_scores", "budget_tokens": '
        "1024} (minivllm_jax/engine/kv/compression.py; None: off)",
    )
    allow_request_kv_compression: bool = knob(
        False,
        "a request may ask for its own KV compression policy (SamplingParams.kv_compression); "
        "its programs compile at warm-up, so nothing compiles while serving; refused with "
        "several processes (off: such a request is refused)",
    )

    # ---------------------------------------------------------------- parallelism (ParallelConfig)
    tensor_parallel_size: int = knob(
        1, "split the model over this many devices (heads, MLP and vocabulary; docs/scaling.md)"
    )
    data_parallel_size: int = knob(
        1,
        "this many replicas, each on tensor_parallel_size devices, behind one LLM; a request "
        "goes to the replica that cached its prefix, else the least loaded",
    )

    # ---------------------------------------------------------------- start-up
    warmup: bool = knob(
        True, "compile every step program at start-up (off: each compiles when first run)"
    )
    use_tqdm: bool = knob(True, "progress bars while loading, warming up and generating")
    compilation_cache_dir: str | None = knob(
        None,
        "directory of compiled programs kept across processes (None: "
        "minivllm_jax/engine/runtime.py's default)",
    )

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            choices, value = f.metadata["choices"], getattr(self, f.name)
            if choices is not None and value is not None and value not in choices:
                raise ValueError(f"{f.name} must be one of {choices}, got {value!r}")
        if not 0 < self.kv_memory_fraction <= 1:
            raise ValueError(f"kv_memory_fraction must be in (0, 1], got {self.kv_memory_fraction}")

    # ---------------------------------------------------------------- from keywords

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any], caller: str = "EngineArgs") -> EngineArgs:
        """`cls(**kwargs)`, but an unknown keyword is a TypeError that names it, the closest
        knob, and where the knobs are listed (`caller` names the function in the message)."""
        names = [f.name for f in dataclasses.fields(cls)]
        for key in kwargs:
            if key not in names:
                close = difflib.get_close_matches(key, names, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise TypeError(
                    f"{caller}() got an unexpected keyword argument {key!r}{hint} "
                    f"(its knobs are the fields of minivllm_jax.args.EngineArgs)"
                )
        return cls(**kwargs)

    # ---------------------------------------------------------------- the engine's config

    def create_engine_config(self, model_config: ModelConfig | None = None) -> EngineConfig:
        """The grouped `EngineConfig`: each group's fields come from the fields of the same name.
        Given the model, `max_model_len` is capped by its positions, `num_pages=None` sizes the
        cache from free memory, and `attention` is resolved for it; without one, `num_pages`
        must be given and `attention` stays as named (the runner resolves it)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        max_model_len = self.max_model_len or DEFAULT_MAX_MODEL_LEN
        if model_config is not None:
            max_model_len = min(max_model_len, model_config.max_position_embeddings)
        num_pages = self.num_pages
        if num_pages is None:
            if model_config is None:
                raise ValueError("num_pages=None sizes the KV cache for a model: give num_pages")
            num_pages = self.auto_num_pages(model_config, max_model_len)
        values.update(max_model_len=max_model_len, num_pages=num_pages)

        def group(cls: type) -> Any:
            return cls(**{f.name: values[f.name] for f in dataclasses.fields(cls)})

        kv_compression = self.kv_compression
        if isinstance(kv_compression, dict):  # as a flag or a JSON body gives it
            kv_compression = KVCompressionConfig.from_dict(kv_compression)
        return EngineConfig(
            max_model_len=max_model_len,
            attention=self.attention
            if model_config is None
            else resolve_attention(self.attention, model_config, self.dtype, self.kv_cache_dtype),
            cache=group(CacheConfig),
            scheduler=group(SchedulerConfig),
            parallel=group(ParallelConfig),
            speculative=SpeculativeConfig.from_dict(self.speculative_config),
            kv_compression=kv_compression,
            allow_request_kv_compression=self.allow_request_kv_compression,
        )

    def auto_num_pages(self, model_config: ModelConfig, max_model_len: int) -> int:
        """1 + min(max_num_seqs * ceil(max_model_len / page_size), kv_memory_fraction *
        MemAvailable / data_parallel_size // bytes_per_page): never more than the engine can
        use, and at least one full-length sequence (data-parallel replicas share the budget)."""
        per_seq = -(-max_model_len // self.page_size)
        budget = self.kv_memory_fraction * available_memory_bytes() / self.data_parallel_size
        page_bytes = kv_bytes_per_page(
            model_config, self.page_size, self.dtype, self.kv_cache_dtype
        )
        by_memory = _round_down_coarsely(int(budget) // page_bytes)
        return 1 + max(per_seq, min(self.max_num_seqs * per_seq, by_memory))

    # ---------------------------------------------------------------- command lines

    @classmethod
    def add_cli_args(
        cls,
        parser: argparse.ArgumentParser,
        defaults: Mapping[str, Any] | None = None,
        exclude: Collection[str] = (),
    ) -> argparse.ArgumentParser:
        """Add one flag per field to `parser` (in an "engine" group), `--page-size` for
        `page_size`; `defaults` replaces fields' defaults on this command line, `exclude` leaves
        fields off it. Returns the parser."""
        defaults = dict(defaults or {})
        names = {f.name for f in dataclasses.fields(cls)}
        for name in [*defaults, *exclude]:
            if name not in names:
                cls.from_kwargs({name: None}, "add_cli_args")  # the TypeError naming it
        hints = typing.get_type_hints(cls)
        group = parser.add_argument_group("engine", "the engine's knobs (minivllm_jax/args.py)")
        for f in dataclasses.fields(cls):
            if f.name in exclude:
                continue
            default = defaults.get(f.name, f.default)
            flag = f.metadata["flag"] or "--" + f.name.replace("_", "-")
            # argparse formats help with %: a literal one is written %%.
            text = f.metadata["help"].replace("%", "%%") + " (default: %(default)s)"
            if hints[f.name] is bool:
                group.add_argument(
                    flag,
                    dest=f.name,
                    default=default,
                    action=argparse.BooleanOptionalAction,
                    help=text,
                )
                continue
            parse, metavar = _parser_of(hints[f.name])
            group.add_argument(
                flag,
                dest=f.name,
                default=default,
                type=parse,
                choices=f.metadata["choices"],
                metavar=metavar,
                help=text,
            )
        return parser

    @classmethod
    def from_cli_args(cls, namespace: argparse.Namespace, **overrides: Any) -> EngineArgs:
        """The fields `add_cli_args` put in `namespace` (excluded ones keep their defaults);
        `overrides` win over them."""
        parsed = {
            f.name: getattr(namespace, f.name)
            for f in dataclasses.fields(cls)
            if hasattr(namespace, f.name)
        }
        return cls.from_kwargs({**parsed, **overrides}, "from_cli_args")


def _parser_of(hint: Any) -> tuple[Any, str | None]:
    """How a flag reads its value, from the field's type: JSON for dicts, else the one
    non-None type of the annotation (`int | None` reads an int)."""
    kinds = [t for t in typing.get_args(hint) or (hint,) if t is not type(None)]
    if dict in kinds:
        return json.loads, "JSON"
    (kind,) = kinds
    return kind, None


def _round_down_coarsely(n: int) -> int:
    """`n` with all but its 4 leading bits cleared (at most 1/8 less). Free memory differs a
    little from one start to the next, and the page count is part of every step program's
    shape: rounded, it stays the same, so the programs compiled by one start load whole in the
    next instead of compiling again."""
    dropped_bits = max(0, n.bit_length() - 4)
    return n >> dropped_bits << dropped_bits
