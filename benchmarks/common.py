"""What every benchmark shares: workload presets, seeded workloads, the PyTorch peer loader,
percentiles, machine facts, JSON results and PNG plots. One place, so scripts stay short.

Benchmarks run as scripts (`python benchmarks/x.py`); each puts the repo root on sys.path
first (`sys.path.insert(0, str(Path(__file__).resolve().parents[1]))`) and imports this as
`benchmarks.common`, which also works from tests.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np

RESULTS = Path(__file__).parent / "results"


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


def add_workload_args(p: argparse.ArgumentParser, default_preset: str = "mixed") -> None:
    """--preset NAME, or explicit --num-prompts/--input-len/--output-len (which override it)."""
    names = ", ".join(f"{k} ({v.doc})" for k, v in PRESETS.items())
    p.add_argument(
        "--preset",
        default=default_preset,
        choices=sorted(PRESETS),
        help=f"workload preset: {names}",
    )
    p.add_argument(
        "--num-prompts", type=int, default=None, help="override the preset's request count"
    )
    p.add_argument("--input-len", type=int, nargs=2, default=None, metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=None, metavar=("MIN", "MAX"))
    p.add_argument("--seed", type=int, default=0, help="workload seed (lengths and token ids)")


def make_workload(args: argparse.Namespace, vocab_hi: int = 10000) -> Workload:
    """Seeded random token-id prompts; `--quick` callers set `args.preset = "tiny"` first.

    Ids are drawn from [100, vocab_hi) so they avoid special tokens of real vocabularies.
    """
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


def load_hf_model(model: str, dtype: str = "float32", threads: int = 2):
    """The PyTorch peer: HF transformers' model for `model` (alias, HF folder or .gguf), eval mode."""
    import torch
    import transformers

    from minivllm_jax.loading.aliases import MODEL_ALIASES, alias_source

    torch.set_num_threads(threads)
    torch_dtype = getattr(torch, dtype)
    path = alias_source(model) if model in MODEL_ALIASES else Path(model)
    if path.suffix == ".gguf":
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent),
            gguf_file=path.name,
            dtype=torch_dtype,
            quantization_config=transformers.GgufConfig(dequantize=True),
        )
    else:
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype)
    # Benchmarks force output lengths; `generate` fills an unset eos_token_id from the model's
    # generation_config, so EOS must be cleared there too or the peer may stop early.
    hf.generation_config.eos_token_id = None
    return hf.eval()


def percentiles(values: list[float]) -> dict[str, float | None]:
    """p50/p90/p99/mean (nearest-rank on sorted values); None when there are no values."""
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None, "count": 0}
    xs = sorted(values)

    def q(p: float) -> float:
        return xs[min(len(xs) - 1, max(0, int(np.ceil(p / 100 * len(xs))) - 1))]

    return {
        "p50": q(50),
        "p90": q(90),
        "p99": q(99),
        "mean": statistics.fmean(xs),
        "count": len(xs),
    }


# The CPU features a kernel's speed depends on (recorded with every result: the same code runs at
# different speeds on CPUs with and without them).
KERNEL_CPU_FLAGS = frozenset(
    {
        "avx",
        "avx2",
        "fma",
        "f16c",
        "avx512f",
        "avx512bw",
        "avx512vl",
        "avx512_vnni",
        "avx512_bf16",
        "avx512vbmi",
        "avx_vnni",
        "amx_tile",
        "amx_bf16",
        "amx_int8",
    }
)


def machine_info() -> dict[str, Any]:
    """What a result was measured on, so numbers are never quoted without their machine."""
    info: dict[str, Any] = {
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
    }
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):  # the instruction sets the native kernels dispatch on
                info["cpu_flags"] = sorted(set(line.split(":", 1)[1].split()) & KERNEL_CPU_FLAGS)
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                info["mem_gib"] = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    for mod in ("jax", "torch", "transformers"):
        if mod in sys.modules:
            info[mod] = getattr(sys.modules[mod], "__version__", None)
    try:
        import jax

        info["jax_backend"] = jax.default_backend()
        info["jax_devices"] = [str(d) for d in jax.devices()]
    except Exception:  # noqa: BLE001 - machine facts are best effort
        pass
    return info


def write_result(result: dict[str, Any], out: str | Path) -> Path:
    """Write `result` plus timestamp and machine facts as JSON at `out`; returns the path."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    full = {
        **result,
        "timestamp": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": machine_info(),
    }
    out.write_text(json.dumps(full, indent=2) + "\n")
    print(f"wrote {out}")
    return out


def save_plot(fig, out: str | Path) -> Path:
    """Save a matplotlib figure as PNG next to the JSON results (headless backend)."""
    out = Path(out).with_suffix(".png")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    print(f"wrote {out}")
    return out


def new_figure(ncols: int = 1, width: float = 6.0, height: float = 4.0):
    """A headless matplotlib figure with `ncols` axes side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(1, ncols, figsize=(width * ncols, height), squeeze=False)


# ------------------------------------------------------------------ latency (bench_latency, load_test)

# Goodput SLO defaults: a reply starts within a second, and then streams at 10 tokens/s or
# faster per request (faster than people read). Both latency scripts use the same ones.
SLO_TTFT_MS = 1000.0
SLO_TPOT_MS = 100.0


def add_slo_args(p: argparse.ArgumentParser) -> None:
    """--slo-ttft-ms / --slo-tpot-ms: a request counts toward goodput only if it meets both."""
    ttft = f"goodput SLO on time to first token (default {SLO_TTFT_MS:g} ms)"
    tpot = f"goodput SLO on time per output token after the first (default {SLO_TPOT_MS:g} ms)"
    p.add_argument("--slo-ttft-ms", type=float, default=SLO_TTFT_MS, help=ttft)
    p.add_argument("--slo-tpot-ms", type=float, default=SLO_TPOT_MS, help=tpot)


def request_timings(arrival: float, token_times: list[float]) -> dict[str, Any]:
    """One request's TTFT, TPOT (mean gap after the first token), ITL gaps and end-to-end time,
    in seconds, from its arrival time and the host time each output token became available."""
    n = len(token_times)
    return {
        "ttft": token_times[0] - arrival,
        "tpot": (token_times[-1] - token_times[0]) / (n - 1) if n > 1 else None,
        "itl": [b - a for a, b in zip(token_times, token_times[1:])],
        "e2e": token_times[-1] - arrival,
        "tokens": n,
    }


def meets_slo(record: dict[str, Any], slo_ttft_ms: float, slo_tpot_ms: float) -> bool:
    """Both SLOs hold (a one-token request has no TPOT, so only TTFT applies)."""
    tpot = record["tpot"]
    return record["ttft"] * 1000 <= slo_ttft_ms and (tpot is None or tpot * 1000 <= slo_tpot_ms)


def latency_summary(
    records: list[dict[str, Any]], wall_s: float, slo_ttft_ms: float, slo_tpot_ms: float
) -> dict[str, Any]:
    """Percentiles (seconds), throughput and goodput of completed requests (`request_timings` dicts);
    goodput = completed requests per second that meet both SLOs."""
    tokens = sum(r["tokens"] for r in records)
    good = sum(meets_slo(r, slo_ttft_ms, slo_tpot_ms) for r in records)
    per_s = (lambda x: x / wall_s) if wall_s > 0 else (lambda x: None)
    return {
        "completed": len(records),
        "wall_s": wall_s,
        "output_tokens": tokens,
        "output_tokens_per_s": per_s(tokens),
        "requests_per_s": per_s(len(records)),
        "ttft_s": percentiles([r["ttft"] for r in records]),
        "tpot_s": percentiles([r["tpot"] for r in records if r["tpot"] is not None]),
        "itl_s": percentiles([x for r in records for x in r["itl"]]),
        "e2e_s": percentiles([r["e2e"] for r in records]),
        "goodput": {
            "slo_ttft_ms": slo_ttft_ms,
            "slo_tpot_ms": slo_tpot_ms,
            "requests_meeting_slo": good,
            "slo_attainment": good / len(records) if records else None,
            "requests_per_s": per_s(good),
        },
    }


def local_model_dir(model: str) -> Path | None:
    """The local folder holding `model`'s config.json and tokenizer (alias -> its converted
    cache dir, which the engine made already), or None when `model` is not on this machine."""
    from minivllm_jax.loading.aliases import MODEL_ALIASES

    if model in MODEL_ALIASES:
        from convert import resolve_model

        return Path(resolve_model(model, progress=False))
    path = Path(model)
    return path if (path / "config.json").is_file() else None


def model_vocab_size(model: str) -> int | None:
    """`vocab_size` from the model's config.json, so random token-id prompts stay in range."""
    folder = local_model_dir(model)
    if folder is None:
        return None
    return int(json.loads((folder / "config.json").read_text())["vocab_size"])


# ---------------------------------------------------------------- engine probes
# Shared by bench_memory.py and bench_ablations.py: run a workload through one LLMEngine step by
# step (so callers can sample state after every step) and count bucket padding.


def greedy_params(output_lens: list[int]) -> list:
    """Greedy SamplingParams forced to each drawn length, so every config yields the same tokens."""
    from minivllm_jax import SamplingParams

    return [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for o in output_lens]


@dataclasses.dataclass
class EngineRun:
    """One offline run: wall time, token counts, TTFTs (from the run's start) and the outputs."""

    elapsed_s: float
    input_tokens: int
    output_tokens: int
    ttft_s: list[float]
    token_ids: list[list[int]]

    def metrics(self) -> dict[str, Any]:
        return {
            "elapsed_s": self.elapsed_s,
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "output_tok_s": self.output_tokens / self.elapsed_s,
            "total_tok_s": (self.input_tokens + self.output_tokens) / self.elapsed_s,
            "ttft_s": percentiles(self.ttft_s),
        }


def run_requests(
    engine, prompts: list[list[int]], params: list, on_step=None, t0: float | None = None
) -> EngineRun:
    """Queue every request at once and step `engine` (an LLMEngine) until all finish.

    Offline semantics: all requests arrive at `t0` (default: now), so TTFT includes queueing.
    `on_step(engine)` runs after every step, which is how callers sample pages and batch sizes.
    """
    import time

    t0 = time.monotonic() if t0 is None else t0
    ids = [engine.add_request(p, sp, arrival_time=t0) for p, sp in zip(prompts, params)]
    done: dict[str, Any] = {}
    while len(done) < len(ids):
        if not engine.has_unfinished():
            raise RuntimeError(f"engine went idle with {len(ids) - len(done)} requests unfinished")
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if on_step is not None:
            on_step(engine)
    elapsed = time.monotonic() - t0
    outs = [done[i] for i in ids]
    token_ids = [o.outputs[0].token_ids for o in outs]
    return EngineRun(
        elapsed_s=elapsed,
        input_tokens=sum(map(len, prompts)),
        output_tokens=sum(map(len, token_ids)),
        ttft_s=[o.metrics.ttft for o in outs if o.metrics.ttft is not None],
        token_ids=token_ids,
    )


class PaddingCounter:
    """Counts real vs padded work of every step, as the engine's step listener (`StepEvent`).

    A ragged step pads its token count and its sequence count to a bucket; the waste is what
    the bucket computes beyond the real tokens and sequences (attention walks only real pages,
    see `minivllm_jax.ops.attention`). Steps with prompt tokens count as "mixed", the others as
    "decode". `uninstall()` stops counting.
    """

    def __init__(self, engine) -> None:
        self.engine = engine
        self.reset()
        engine.add_step_listener(self.record)

    def uninstall(self) -> None:
        self.engine.remove_step_listener(self.record)

    def reset(self) -> None:
        zero = {"steps": 0, "tokens": 0, "token_slots": 0, "rows": 0, "row_slots": 0, "pages": 0}
        self.counts = {"mixed": dict(zero), "decode": dict(zero)}

    def record(self, event) -> None:
        c = self.counts[event.kind]
        c["steps"] += 1
        c["tokens"] += event.num_tokens
        c["token_slots"] += event.token_slots
        c["rows"] += event.num_seqs
        c["row_slots"] += event.seq_slots
        c["pages"] += event.num_pages

    def summary(self) -> dict[str, Any]:
        """Per step kind: counts and % padded token slots and sequence rows."""

        def pct(used: int, slots: int) -> float | None:
            return round(100.0 * (1 - used / slots), 2) if slots else None

        out: dict[str, Any] = {}
        for kind, c in self.counts.items():
            out[kind] = {
                **c,
                "padded_token_pct": pct(c["tokens"], c["token_slots"]),
                "padded_row_pct": pct(c["rows"], c["row_slots"]),
            }
        total = sum(c["tokens"] for c in self.counts.values())
        slots = sum(c["token_slots"] for c in self.counts.values())
        out["padded_token_pct"] = pct(total, slots)
        return out


def add_engine_args(p: argparse.ArgumentParser, **defaults: Any) -> None:
    """--model/--dtype and the EngineConfig knobs, with per-script defaults."""
    d = {
        "model": "smollm2-135m",
        "dtype": "float32",
        "max_num_seqs": 64,
        "max_model_len": None,
        "page_size": 16,
        "num_pages": None,
        "max_num_batched_tokens": 512,
        **defaults,
    }
    p.add_argument("--model", default=d["model"], help="alias, converted dir, HF folder or .gguf")
    p.add_argument("--dtype", default=d["dtype"], choices=["float32", "bfloat16"])
    p.add_argument("--max-num-seqs", type=int, default=d["max_num_seqs"])
    p.add_argument(
        "--max-model-len",
        type=int,
        default=d["max_model_len"],
        help="None: the script decides (see its --help)",
    )
    p.add_argument("--page-size", type=int, default=d["page_size"])
    p.add_argument(
        "--num-pages", type=int, default=d["num_pages"], help="default: the engine's auto sizing"
    )
    p.add_argument("--max-num-batched-tokens", type=int, default=d["max_num_batched_tokens"])


def build_llm(args: argparse.Namespace, **overrides: Any):
    """An LLM from add_engine_args' options (overrides win), warmed up, without progress bars."""
    from minivllm_jax import LLM

    kw = dict(
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        page_size=args.page_size,
        num_pages=args.num_pages,
        max_num_batched_tokens=args.max_num_batched_tokens,
        use_tqdm=False,
    )
    kw.update(overrides)
    return LLM(args.model, **kw)
