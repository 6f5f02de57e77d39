"""Ablations: switch one engine idea off (or turn one knob) and measure the same seeded workload.

Every row runs the same requests (greedy, forced output lengths) and reports output tok/s,
total tok/s, TTFT p50 (all requests arrive at the start, offline) and bucket padding waste
(% of computed token slots that were padding, counted by a step listener).

Method notes:
  - kv-cache-off: batch 1 on a small subset. With the cache, a prompt is prefilled once and
    each token is one decode step. Without it, every new token re-runs a full prefill of
    prompt + tokens so far on a fresh cache (prefix caching off), i.e. O(n^2) work. The
    prefixes are the cached run's greedy tokens, and the row says how many of the recomputed
    tokens matched them. Compare its per-token ms with the cached batch-1 run in the same row.
  - static-batching: the requests in fixed batches of --static-batch, one `generate`-style run
    per batch; a batch starts when the previous one has fully finished.
  - paged-same-kv vs contiguous: the same KV bytes (--kv-budget-seqs sequences of max_model_len).
    Contiguous is emulated with one page of max_model_len per sequence; both report how many
    sequences ran at once (peak_running).
  - Scheduler knobs (num_pages, max_num_seqs, max_num_batched_tokens, prefix caching) are
    applied to a fresh scheduler and page manager on an already compiled engine, never above
    its compiled buckets, so no ablation pays extra compiles (`compiles_during_run` shows 0).

Adding an ablation is one `Ablation(name, description, fn)` line in `registry()`.

    python benchmarks/engine/bench_ablations.py [--preset mixed] [--num-prompts 24] [--only baseline static-batching] [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.lib.harness import (  # noqa: E402
    PaddingCounter,
    add_engine_args,
    greedy_params,
    llm_from_args,
    run_batches,
    run_requests,
)
from benchmarks.lib.report import (  # noqa: E402
    add_options,
    new_figure,
    save_plot,
    script_parser,
    write_result,
)
from benchmarks.lib.workloads import (  # noqa: E402
    Workload,
    add_workload_args,
    make_workload,
    vocab_hi,
)
from minivllm_jax.engine.kv.pages import PageManager  # noqa: E402

Batches = list[tuple[list[list[int]], list[int]]]  # requests run together, one group after another


@dataclasses.dataclass(frozen=True)
class Ablation:
    name: str
    description: str
    run: Callable[[Bench], dict[str, Any]]  # returns the row's metrics (see Bench.execute)


def registry(a: argparse.Namespace) -> list[Ablation]:
    """Every ablation, in report order. To add one: a name, what it changes, and a function of
    the Bench (usually `b.run(knob=value)` or `b.run(workload=...)`)."""
    budget = f"KV bytes of {a.kv_budget_seqs} max-length sequences"
    rows = [
        Ablation(
            "baseline", "continuous batching, paged KV cache, prefix caching on", lambda b: b.run()
        ),
        Ablation(
            "kv-cache-off",
            "batch 1, every token re-prefills prompt + output so far (vs cached batch 1)",
            kv_cache_off,
        ),
        Ablation(
            "static-batching",
            f"fixed batches of {a.static_batch}; each waits for its slowest request",
            lambda b: b.run(batch_size=a.static_batch),
        ),
        Ablation(
            "paged-same-kv",
            f"paged (page {a.page_size}) limited to {budget}",
            lambda b: b.run(num_pages=1 + a.kv_budget_seqs * b.max_model_len // a.page_size),
        ),
        Ablation("contiguous", f"one max_model_len page per sequence, {budget}", contiguous),
        Ablation(
            "bucket-padding",
            "baseline's padded slots per step kind (tokens, sequences)",
            lambda b: b.run(),
        ),
        Ablation(
            "sync-scheduling",
            "each step's tokens read before the next step is scheduled (async off)",
            lambda b: b.run(async_scheduling=False),
        ),
        Ablation(
            "prefix-caching-on",
            f"prompts share their first {a.shared_prefix_len} tokens; cache on",
            lambda b: b.run(workload=b.shared_prefix),
        ),
        Ablation(
            "prefix-caching-off",
            f"prompts share their first {a.shared_prefix_len} tokens; cache off",
            lambda b: b.run(workload=b.shared_prefix, enable_prefix_caching=False),
        ),
    ]
    rows += [
        Ablation(
            f"chunked-prefill-{t}",
            f"max_num_batched_tokens={t} (step token budget: decodes + prompt chunks)",
            lambda b, t=t: b.run(max_num_batched_tokens=t),
        )
        for t in a.chunk_sizes
    ]
    rows += [
        Ablation(
            f"max-num-seqs-{n}",
            f"at most {n} sequences running (decode batch)",
            lambda b, n=n: b.run(max_num_seqs=n),
        )
        for n in a.max_num_seqs_values
    ]
    return rows


# ---------------------------------------------------------------- the harness


class Bench:
    """The shared workload, compiled engines (one per cache layout) and memoized runs."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.workload = make_workload(args, vocab_hi=vocab_hi(args.model))
        self.shared_prefix = _with_shared_prefix(self.workload, args.shared_prefix_len, args.seed)
        ps = args.page_size
        need = args.max_model_len or self.workload.max_len
        self.max_model_len = -(-need // ps) * ps
        self._llms: dict[tuple, Any] = {}
        self._counters: dict[int, PaddingCounter] = {}
        self._memo: dict[tuple, dict[str, Any]] = {}

    def llm(self, **overrides: Any):
        """The engine for these overrides, built (and compiled) once."""
        key = tuple(sorted(overrides.items()))
        if key not in self._llms:
            a = self.args
            base = dict(
                max_model_len=self.max_model_len,
                max_num_seqs=max(a.max_num_seqs, *a.max_num_seqs_values),
                max_num_batched_tokens=max(a.max_num_batched_tokens, *a.chunk_sizes),
                num_pages=a.num_pages or 1 + a.max_num_seqs * self.max_model_len // a.page_size,
            )
            start = time.perf_counter()
            llm = llm_from_args(a, **{**base, **overrides})
            # Untimed pass (outputs capped at 8 tokens) so first-call costs of the compiled
            # programs do not land on whichever ablation happens to run first.
            fresh_host_state(llm.engine)
            wl = self.workload
            run_requests(llm.engine, wl.prompts, greedy_params([min(o, 8) for o in wl.output_lens]))
            print(
                f"  engine {dict(key) or 'base'}: ready in {time.perf_counter() - start:.1f} s "
                f"({llm.engine.stats().compiles} programs)",
                flush=True,
            )
            self._llms[key] = llm
            self._counters[id(llm)] = PaddingCounter(llm.engine)
        return self._llms[key]

    def run(
        self,
        workload: Workload | None = None,
        batch_size: int | None = None,
        llm=None,
        contiguous: bool = False,
        **knobs: Any,
    ) -> dict[str, Any]:
        """Run a whole workload (all at once, or in static batches of `batch_size`); memoized."""
        wl = workload or self.workload
        llm = llm or self.llm()
        n = len(wl.prompts)
        size = batch_size or n
        batches = [
            (wl.prompts[i : i + size], wl.output_lens[i : i + size]) for i in range(0, n, size)
        ]
        key = (id(llm), id(wl), size, contiguous, _scheduler_config(llm.engine, **knobs))
        if key not in self._memo:
            runs = sorted(
                (
                    self.execute(batches, llm, contiguous, **knobs)[0]
                    for _ in range(self.args.repeat)
                ),
                key=lambda m: m["elapsed_s"],
            )
            median = runs[len(runs) // 2]
            self._memo[key] = {**median, "repeat_elapsed_s": [m["elapsed_s"] for m in runs]}
        return self._memo[key]

    def execute(
        self, batches: Batches, llm=None, contiguous: bool = False, **knobs: Any
    ) -> tuple[dict[str, Any], list]:
        """Run groups of requests one after another on fresh host state (scheduler, page manager
        and prefix cache), with scheduler knobs applied; all requests count as arriving at the
        start. Returns the metrics and the generated token ids."""
        llm = llm or self.llm()
        engine = llm.engine
        fresh_host_state(engine, contiguous, **knobs)
        counter = self._counters[id(llm)]
        counter.reset()
        compiles = engine.stats().compiles
        peak = 0

        def on_step(e) -> None:
            nonlocal peak
            peak = max(peak, e.stats().running)

        run = run_batches(engine, [(p, greedy_params(o)) for p, o in batches], on_step)
        metrics = {
            **run.metrics(),
            "padding": counter.summary(),
            "peak_running": peak,
            "preemptions": engine.stats().preemptions,
            "compiles_during_run": engine.stats().compiles - compiles,
            "scheduler": _scheduler_config(engine, **knobs).knobs(),
        }
        return metrics, run.token_ids


# ---------------------------------------------------------------- ablations needing more than b.run


def kv_cache_off(b: Bench) -> dict[str, Any]:
    """Recompute-everything decoding vs the KV cache, both at batch 1 on a small subset."""
    a = b.args
    prompts = b.workload.prompts[: a.kv_off_prompts]
    lens = [min(o, a.kv_off_tokens) for o in b.workload.output_lens[: a.kv_off_prompts]]
    cached, cached_ids = b.execute([([p], [o]) for p, o in zip(prompts, lens)])
    # One 1-token request per generated token: a full prefill of prompt + tokens so far.
    steps = [([p + ids[:t]], [1]) for p, ids in zip(prompts, cached_ids) for t in range(len(ids))]
    off, off_ids = b.execute(steps, enable_prefix_caching=False)
    flat_cached = [t for ids in cached_ids for t in ids]
    flat_off = [t for ids in off_ids for t in ids]
    useful = sum(map(len, prompts)) + off["output_tokens"]

    def ms_per_token(m: dict[str, Any]) -> float:
        return 1000 * m["elapsed_s"] / m["output_tokens"]

    return {
        **off,
        "total_tok_s": useful
        / off["elapsed_s"],  # prompt + generated tokens, not the recomputed ones
        "ttft_s": None,  # not meaningful here: each token is its own request; compare per-token ms
        "recomputed_prefill_tokens": off["input_tokens"],
        "input_tokens": sum(map(len, prompts)),
        "ms_per_token": ms_per_token(off),
        "tokens_matching_cached_pct": 100.0
        * sum(x == y for x, y in zip(flat_off, flat_cached))
        / len(flat_cached),
        "cached_batch1": {
            k: cached[k] for k in ("elapsed_s", "output_tokens", "output_tok_s", "total_tok_s")
        }
        | {"ms_per_token": ms_per_token(cached)},
        "slowdown_vs_cached_batch1": ms_per_token(off) / ms_per_token(cached),
    }


def contiguous(b: Bench) -> dict[str, Any]:
    """One page of max_model_len per sequence: a contiguous max-length cache in paged clothing."""
    seqs = b.args.kv_budget_seqs
    llm = b.llm(
        page_size=b.max_model_len, num_pages=1 + seqs, max_num_seqs=min(seqs, b.args.max_num_seqs)
    )
    return b.run(llm=llm, contiguous=True)


# ---------------------------------------------------------------- engine plumbing (benchmark-side hooks)

# The compiled engine's buckets go up to the first three; the scheduler alone reads the others.
COMPILED_LIMITS = ("num_pages", "max_num_seqs", "max_num_batched_tokens")
SCHEDULER_KNOBS = (*COMPILED_LIMITS, "enable_prefix_caching", "target_tpot_ms", "target_ttft_ms")
SCHEDULER_KNOBS += ("max_batch_wait_ms", "async_scheduling")


def _scheduler_config(engine, **knobs: Any):
    """The engine's EngineConfig with scheduler-only knobs replaced; never above compiled buckets."""
    base = engine.config
    for name, value in knobs.items():
        if name not in SCHEDULER_KNOBS:
            raise ValueError(f"{name} is not a scheduler knob ({', '.join(SCHEDULER_KNOBS)})")
        if name in COMPILED_LIMITS and value > base.knobs()[name]:
            raise ValueError(f"{name}={value} exceeds the compiled engine's {base.knobs()[name]}")
    return base.replace(**knobs)


class NoReservePageManager(PageManager):
    """Admission without the per-running-sequence growth page (contiguous pages never grow)."""

    def allocate_slots(self, seq, lookahead: int = 0, reserve: int = 0):
        return super().allocate_slots(seq, lookahead, 0)


def fresh_host_state(engine, contiguous: bool = False, **knobs: Any) -> None:
    """Give the engine a new scheduler and page manager (empty prefix cache) with `knobs`.

    Contiguous: a page holds a whole sequence and never grows, so admission must not reserve
    a growth page per running sequence (the engine's scheduler does, for paged growth).
    """
    cfg = _scheduler_config(engine, **knobs)
    bm = (NoReservePageManager if contiguous else PageManager)(
        cfg.cache.num_pages, cfg.cache.page_size, cfg.cache.enable_prefix_caching
    )
    engine.reset_host_state(cfg, bm)


def _with_shared_prefix(wl: Workload, prefix_len: int, seed: int) -> Workload:
    """The same workload with each prompt's first tokens (up to prefix_len, keeping one of its
    own) replaced by one shared prefix: lengths, and so max_model_len, are unchanged."""
    import numpy as np

    lo = min(min(map(min, wl.prompts)), 100)
    hi = max(max(map(max, wl.prompts)) + 1, lo + 2)
    prefix = np.random.default_rng(seed + 1).integers(lo, hi, size=prefix_len).tolist()
    prompts = [
        prefix[: min(prefix_len, len(p) - 1)] + p[min(prefix_len, len(p) - 1) :] for p in wl.prompts
    ]
    return Workload(prompts, list(wl.output_lens), f"{wl.preset}+shared-prefix-{prefix_len}")


# ---------------------------------------------------------------- report


def row_of(ab: Ablation, m: dict[str, Any]) -> dict[str, Any]:
    """The headline columns first, then everything measured."""
    return {
        "name": ab.name,
        "description": ab.description,
        "output_tok_s": m["output_tok_s"],
        "total_tok_s": m["total_tok_s"],
        "ttft_p50_s": m["ttft_s"]["p50"] if m.get("ttft_s") else None,
        "padded_token_pct": m["padding"]["padded_token_pct"],
        "metrics": m,
    }


def plot(rows: list[dict[str, Any]], out: str | Path) -> Path:
    """Bars per ablation: output tok/s and TTFT p50 (baseline highlighted)."""
    fig, axes = new_figure(2, width=6.5, height=0.45 * len(rows) + 1.5)
    names = [r["name"] for r in rows][::-1]
    colors = ["tab:green" if n == "baseline" else "tab:blue" for n in names]
    for ax, key, label in (
        (axes[0][0], "output_tok_s", "output tok/s"),
        (axes[0][1], "ttft_p50_s", "TTFT p50 (s)"),
    ):
        values = [r[key] or 0.0 for r in rows][::-1]
        bars = ax.barh(names, values, color=colors)
        ax.bar_label(bars, fmt="%.3g", fontsize=8)
        ax.set_xlabel(label)
    axes[0][0].set_title("Ablations: throughput (same workload)")
    axes[0][1].set_title("Ablations: time to first token")
    return save_plot(fig, out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = script_parser(__doc__, "ablations.json", model=None)
    add_workload_args(p, default_preset="mixed")
    p.set_defaults(num_prompts=24)
    # max_model_len None: the workload's longest request; --seed is the workload's.
    add_engine_args(p, exclude=("seed",), max_num_seqs=32)
    p.add_argument(
        "--only", nargs="+", metavar="NAME", help="run these ablations (a prefix selects several)"
    )
    add_options(
        p,
        [
            ("--list", False, "list the ablations and exit"),
            ("--static-batch", 8, "batch size of static batching"),
            ("--kv-budget-seqs", 8, "KV bytes for paged-same-kv/contiguous, in max-length seqs"),
            ("--kv-off-prompts", 2, "prompts in the kv-cache-off subset"),
            ("--kv-off-tokens", 32, "output tokens per prompt in that subset (cap)"),
            ("--shared-prefix-len", 128, "shared prompt prefix for the prefix-caching rows"),
            ("--chunk-sizes", [256, 512], "max_num_batched_tokens values"),
            ("--max-num-seqs-values", [8, 16], "max_num_seqs values"),
            ("--repeat", 1, "runs per row; the median by wall time is reported (noisy: 3)"),
            ("--quick", False, "tiny preset and engine, for smoke tests"),
        ],
    )
    args = p.parse_args(argv)
    if args.quick:
        args.preset, args.num_prompts, args.max_num_seqs = "tiny", None, 4
        args.max_num_batched_tokens = 32
        args.static_batch, args.kv_budget_seqs, args.kv_off_prompts, args.kv_off_tokens = 2, 2, 1, 4
        args.shared_prefix_len, args.chunk_sizes, args.max_num_seqs_values = 16, [16, 32], [2]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ablations = registry(args)
    if args.list:
        for ab in ablations:
            print(f"{ab.name:>22}  {ab.description}")
        return 0
    if args.only:
        ablations = [ab for ab in ablations if any(ab.name.startswith(o) for o in args.only)]
        if not ablations:
            raise SystemExit(f"--only {' '.join(args.only)} matches nothing; see --list")
    bench = Bench(args)
    print(f"workload: {bench.workload.describe()}; max_model_len {bench.max_model_len}")
    rows = []
    for ab in ablations:
        start = time.perf_counter()
        rows.append(row_of(ab, ab.run(bench)))
        r = rows[-1]
        ttft = f"{r['ttft_p50_s'] * 1000:8.0f}" if r["ttft_p50_s"] is not None else "       -"
        print(
            f"{ab.name:>22}: {r['output_tok_s']:8.1f} out tok/s {r['total_tok_s']:8.1f} total tok/s "
            f"TTFT p50 {ttft} ms  padded {r['padded_token_pct']}%  ({time.perf_counter() - start:.1f} s)",
            flush=True,
        )
    result = {
        "benchmark": "ablations",
        "model": args.model,
        "workload": bench.workload.describe(),
        "shared_prefix_workload": bench.shared_prefix.describe(),
        "max_model_len": bench.max_model_len,
        "rows": rows,
    }
    write_result(result, args.out)
    plot(rows, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
