"""What the benchmarks feed the engines: seeded random token-id workloads by preset, a few fixed
text prompts, and the licence texts the quality benchmarks score."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.metadata
import json
from pathlib import Path
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class Preset:
    """A workload shape: request count and inclusive ranges of input/output lengths."""

    num_prompts: int
    input_len: tuple[int, int]
    output_len: tuple[int, int]
    doc: str


PRESETS: dict[str, Preset] = {
    "chat": Preset(64, (24, 40), (48, 80), "short chat turns, in/out about 32/64"),
    "medium": Preset(32, (192, 320), (192, 320), "in/out about 256/256"),
    "long-doc": Preset(8, (1400, 1600), (96, 160), "long documents, in/out about 1,500/128"),
    "mixed": Preset(64, (16, 512), (16, 256), "nano-vllm style random mix (the issue-4 workload)"),
    "tiny": Preset(8, (8, 48), (4, 16), "smoke tests (--quick)"),
}

# Short text prompts of several kinds, for runs that send text rather than token ids.
TEXT_PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived",
    "List three colors of the rainbow:",
    "Q: What is 2 + 2?\nA:",
    "The quick brown fox",
    "Explain what a paged KV cache is in one sentence.",
]


@dataclasses.dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]  # token ids
    output_lens: list[int]
    preset: str | None

    @property
    def input_tokens(self) -> int:
        return sum(map(len, self.prompts))

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def max_len(self) -> int:
        return max(len(p) + o for p, o in zip(self.prompts, self.output_lens))

    def describe(self) -> dict[str, Any]:
        return {
            "preset": self.preset,
            "num_prompts": len(self.prompts),
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "input_len_range": [min(map(len, self.prompts)), max(map(len, self.prompts))],
            "output_len_range": [min(self.output_lens), max(self.output_lens)],
        }


def add_workload_args(p: argparse.ArgumentParser, default_preset: str | None = "mixed") -> None:
    """--preset NAME, or explicit --num-prompts/--input-len/--output-len (which override it)."""
    names = ", ".join(f"{k} ({v.doc})" for k, v in PRESETS.items())
    p.add_argument(
        "--preset", default=default_preset, choices=sorted(PRESETS), help=f"workload: {names}"
    )
    p.add_argument("--num-prompts", type=int, help="override the preset's request count")
    p.add_argument("--input-len", type=int, nargs=2, metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, metavar=("MIN", "MAX"))
    p.add_argument("--seed", type=int, default=0, help="workload seed (lengths and token ids)")


def random_prompts(lengths: list[int], seed: int, vocab_hi: int = 10000) -> list[list[int]]:
    """Seeded random token ids of these lengths, drawn from [100, vocab_hi) so they avoid the
    special tokens of real vocabularies."""
    rng = np.random.default_rng(seed)
    return [rng.integers(100, vocab_hi, size=int(k)).tolist() for k in lengths]


def make_workload(args: argparse.Namespace, vocab_hi: int = 10000) -> Workload:
    """Seeded random token-id prompts; `--quick` callers set `args.preset = "tiny"` first."""
    preset = PRESETS[args.preset]
    n = args.num_prompts or preset.num_prompts
    lo_in, hi_in = args.input_len or preset.input_len
    lo_out, hi_out = args.output_len or preset.output_len
    if not (1 <= lo_in <= hi_in and 1 <= lo_out <= hi_out and n >= 1):
        raise SystemExit(f"bad workload: n={n}, input {lo_in}..{hi_in}, output {lo_out}..{hi_out}")
    rng = np.random.default_rng(args.seed)
    in_lens = rng.integers(lo_in, hi_in + 1, size=n)
    prompts = [rng.integers(100, vocab_hi, size=int(k)).tolist() for k in in_lens]
    outputs = [int(x) for x in rng.integers(lo_out, hi_out + 1, size=n)]
    return Workload(prompts, outputs, args.preset)


def local_model_dir(model: str) -> Path | None:
    """The local folder holding `model`'s config.json and tokenizer (alias -> its converted
    cache dir, which the engine made already), or None when `model` is not on this machine.
    Imported here: the package brings JAX, which a serving benchmark's client does not need."""
    from minivllm_jax.loading.aliases import MODEL_ALIASES
    from minivllm_jax.loading.resolve import resolve_model

    if model in MODEL_ALIASES:
        return Path(resolve_model(model, progress=False))
    path = Path(model)
    return path if (path / "config.json").is_file() else None


def model_vocab_size(model: str) -> int | None:
    """`vocab_size` from the model's config.json, so random token-id prompts stay in range."""
    folder = local_model_dir(model)
    if folder is None:
        return None
    return int(json.loads((folder / "config.json").read_text())["vocab_size"])


def tokenizer(model: str):
    """`model`'s HF tokenizer (from its converted folder, made on first use)."""
    from transformers import AutoTokenizer

    from minivllm_jax.loading.resolve import resolve_model

    return AutoTokenizer.from_pretrained(str(resolve_model(model, progress=False)))


def vocab_hi(model: str) -> int:
    """The exclusive upper bound of random prompt ids for `model`: 10,000 or its vocabulary."""
    return min(10_000, model_vocab_size(model) or 10_000)


# ------------------------------------------------------------------ text to score

# Licence texts that ship with the project's own dependencies, concatenated in this order.
DEFAULT_TEXTS = (("typing_extensions", "LICENSE"), ("transformers", "LICENSE"))


def default_text_files() -> list[tuple[Path, dict[str, Any]]]:
    """The licence files of DEFAULT_TEXTS' installed distributions (one file each, by name)."""
    found = []
    for dist_name, file_name in DEFAULT_TEXTS:
        dist = importlib.metadata.distribution(dist_name)
        files = [f for f in dist.files or [] if f.name == file_name and ".dist-info" in str(f)]
        if not files:
            raise SystemExit(
                f"{dist_name} {dist.version} has no {file_name} in its dist-info; pass --text FILE"
            )
        first = sorted(files, key=str)[0]
        info = {"package": dist_name, "version": dist.version, "file": str(first)}
        found.append((Path(first.locate()), info))
    return found


def text_ids(tok: Any, files: list[str] | None = None) -> tuple[list[int], list[dict[str, Any]]]:
    """The text of `read_text(files)` as `tok`'s token ids, and where each part came from."""
    text, sources = read_text(files)
    return tok(text, add_special_tokens=False)["input_ids"], sources


def read_text(files: list[str] | None) -> tuple[str, list[dict[str, Any]]]:
    """The text (`files`, or DEFAULT_TEXTS' licence files) joined by blank lines, and where each
    part came from (with its sha256, so a result says exactly what was scored)."""
    found = [(Path(f), {"file": str(f)}) for f in files] if files else default_text_files()
    parts, sources = [], []
    for path, info in found:
        body = path.read_text(encoding="utf-8")
        parts.append(body)
        digest = hashlib.sha256(body.encode()).hexdigest()
        sources.append({**info, "chars": len(body), "sha256": digest})
    return "\n\n".join(parts), sources
