"""Results and how they are shown: the options every script has, percentiles and latency summaries, machine facts, the JSON
result files, markdown tables and headless matplotlib figures."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
DEFAULT_MODEL = "smollm2-135m"


def script_parser(doc: str, out: str | None, model: str | None = DEFAULT_MODEL):
    """The parser every benchmark starts from: its docstring as help, --model (unless None)
    and --out (the JSON result, `results/<out>` by default; a PNG goes beside it)."""
    p = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    if model is not None:
        p.add_argument("--model", default=model, help="alias, converted dir, HF folder or .gguf")
    p.add_argument(
        "--out",
        default=None if out is None else str(RESULTS / out),
        help="JSON result path; the PNG goes beside it",
    )
    return p


def add_options(p: argparse.ArgumentParser, rows: Sequence[tuple[str, Any, str]]) -> None:
    """Options from `(flag, default, help)` rows: the type is the default's, or the default
    itself when it is a type (`int`: no default, None); a list default takes one or more
    values of its first item's type; False is a switch (`store_true`)."""
    for flag, default, help in rows:
        if default is False:
            p.add_argument(flag, action="store_true", help=help)
            continue
        kind = default if isinstance(default, type) else type(default)
        more = {}
        if isinstance(default, list):
            kind, more = type(default[0]), {"nargs": "+"}
        p.add_argument(
            flag, type=kind, default=None if default is kind else default, help=help, **more
        )


def fmt(x: float | None, digits: int = 1, scale: float = 1.0) -> str:
    """A number (times `scale`) as the tables print it (thousands separators), or n/a."""
    return "n/a" if x is None else f"{x * scale:,.{digits}f}"


def ms(seconds: float | None, digits: int = 0, unit: str = "") -> str:
    """Seconds as milliseconds for a console line, or "-"."""
    return "-" if seconds is None else f"{seconds * 1000:.{digits}f}{unit}"


def md_table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A markdown table, one line per row."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows]) + "\n"


def percentiles(values: list[float]) -> dict[str, float | None]:
    """p50/p90/p99/mean (nearest-rank on sorted values); None when there are no values."""
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None, "count": 0}
    xs = sorted(values)
    q = lambda p: nearest_rank(xs, p)
    return {
        "p50": q(50),
        "p90": q(90),
        "p99": q(99),
        "mean": statistics.fmean(xs),
        "count": len(xs),
    }


def nearest_rank(sorted_values: list[float], p: float) -> float | None:
    """The nearest-rank `p`th percentile of already sorted values; None when there are none."""
    n = len(sorted_values)
    return sorted_values[min(n - 1, max(0, int(np.ceil(p / 100 * n)) - 1))] if n else None


# ------------------------------------------------------------------ latency under load

# Goodput SLO defaults: a reply starts within a second, and then streams at 10 tokens/s or
# faster per request (faster than people read). Every latency script uses the same ones.
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


# ------------------------------------------------------------------ machine and process facts

# The CPU features a kernel's speed depends on (recorded with every result: the same code runs at
# different speeds on CPUs with and without them).
KERNEL_CPU_FLAGS = frozenset(
    "avx avx2 fma f16c avx512f avx512bw avx512vl avx512_vnni avx512_bf16 avx512vbmi avx_vnni "
    "amx_tile amx_bf16 amx_int8".split()
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


def git_state() -> dict:
    """The commit measured and the engine files that differ from it (a baseline says what it measured)."""
    run = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout
    return {
        "commit": run("rev-parse", "HEAD").strip() or None,
        "dirty": run("status", "--porcelain", "minivllm_jax").rstrip().splitlines(),
    }


def _proc_status_bytes(field: str) -> int | None:
    """A `kB` field of /proc/self/status (Linux), in bytes; None where it cannot be read."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def rss_bytes() -> int:
    """Resident set size of this process now (Linux /proc; psutil elsewhere)."""
    rss = _proc_status_bytes("VmRSS")
    if rss is not None:
        return rss
    import psutil

    return psutil.Process().memory_info().rss


def peak_rss_bytes() -> int:
    """Peak RSS of this process so far: VmHWM from /proc (per address space, reset by exec).

    getrusage's ru_maxrss is the fallback only: Linux carries it across fork+exec, so a child
    started by a big parent would report the parent's peak."""
    peak = _proc_status_bytes("VmHWM")
    if peak is None:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return max(peak, rss_bytes())


# ------------------------------------------------------------------ files


def write_result(result: dict[str, Any], out: str | Path) -> Path:
    """Write `result` plus timestamp and machine facts as JSON at `out`; returns the path."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now().isoformat(timespec="seconds")
    full = {**result, "timestamp": stamp, "machine": machine_info()}
    out.write_text(json.dumps(full, indent=2) + "\n")
    print(f"wrote {out}")
    return out


def new_figure(ncols: int = 1, width: float = 6.0, height: float = 4.0):
    """A headless matplotlib figure with `ncols` axes side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(1, ncols, figsize=(width * ncols, height), squeeze=False)


def save_plot(fig, out: str | Path) -> Path:
    """Save a matplotlib figure as PNG next to the JSON results (headless backend)."""
    import matplotlib.pyplot as plt

    out = Path(out).with_suffix(".png")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    print(f"wrote {out}")
    return out


def style_axes(axes, titles: Sequence[str], xlabel: str, xticks: Sequence[int] | None = None):
    """Grid, legend, title and x label on each axis; log2 x with these ticks when given."""
    for ax, title in zip(axes, titles):
        if xticks is not None:
            ax.set_xscale("log", base=2)
            ax.set_xticks(list(xticks), [str(c) for c in xticks])
        ax.set_xlabel(xlabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)


def print_levels(sides: dict[str, list[dict]]) -> None:
    """Latency levels (`latency_summary` dicts with their concurrency) side by side, one row per
    side and concurrency, the first side's levels first (ms; tok/s; goodput req/s)."""
    by_c = {name: {lv["concurrency"]: lv for lv in levels} for name, levels in sides.items()}
    cols = ["TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "ITL p99", "out tok/s", "goodput/s"]
    print(f"{'C':>4} {'':15}" + "".join(f"{c:>11}" for c in cols))
    for c in [lv["concurrency"] for lv in next(iter(sides.values()))]:
        for name, levels in by_c.items():
            if (row := levels.get(c)) is None:
                continue
            vals = [ms(row[k][q]) for k, q in [("ttft_s", "p50"), ("ttft_s", "p99")]]
            vals += [
                ms(row[k][q]) for k, q in [("tpot_s", "p50"), ("tpot_s", "p99"), ("itl_s", "p99")]
            ]
            vals += [
                f"{row['output_tokens_per_s'] or 0:.1f}",
                f"{row['goodput']['requests_per_s'] or 0:.2f}",
            ]
            print(f"{c:>4} {name:15}" + "".join(f"{v:>11}" for v in vals))


def plot_levels(series: list[tuple[str, list[dict]]], title: str, out: str | Path) -> Path:
    """TTFT p50/p99, TPOT p50/p99 and output tok/s against concurrency, one color per series."""
    fig, axes = new_figure(3, width=4.5)
    for k, (name, levels) in enumerate(series):
        cs = [lv["concurrency"] for lv in levels]
        ms = lambda key, q: [(lv[key][q] or 0) * 1000 for lv in levels]
        for ax, key in ((axes[0, 0], "ttft_s"), (axes[0, 1], "tpot_s")):
            ax.plot(cs, ms(key, "p50"), "o-", color=f"C{k}", label=f"{name} p50")
            ax.plot(cs, ms(key, "p99"), "s--", color=f"C{k}", label=f"{name} p99")
        tok_s = [lv["output_tokens_per_s"] or 0 for lv in levels]
        axes[0, 2].plot(cs, tok_s, "o-", color=f"C{k}", label=name)
    xticks = sorted({lv["concurrency"] for _, levels in series for lv in levels})
    style_axes(
        axes[0],
        ["TTFT (ms)", "TPOT (ms)", "output tok/s"],
        "concurrency (requests in flight)",
        xticks,
    )
    fig.suptitle(title)
    return save_plot(fig, out)
