"""Prefill interference: how long a long prompt's arrival stalls the streams already decoding.

Before the ragged step, a step was either a prefill or a decode and prefill chunks went first:
while a long prompt was prefilled no running stream got a token, so every stream saw one gap as
long as the whole prefill. Now every step carries the running decodes and a prompt chunk sized
by the SLO-aware budget (`target_tpot_ms`, auto by default); the target is a worst gap of at
most 2x the streams' normal inter-token latency (ITL p50). This script measures that gap.

LLMEngine is driven in-process (no HTTP). Phase 1: `--streams` greedy `ignore_eos` streams with
64-token random prompts decode alone (their ITL). Phase 2: a `--long-prompt-tokens` random prompt
(max_tokens 8) arrives while they keep decoding. Reported: the stream gaps that overlap its
prefill (arrival -> first token: worst, p50, p99), its TTFT, worst_gap / ITL p50, and each engine
step in that window (kind, rows, tokens, duration: `runner.run` is wrapped to time each step from
its start to when its tokens are read). Phase 2
runs `--repeats` times with fresh ids (no prefix-cache hits); medians are reported. `LLM(...)`
compiles every bucket first and `num_compiles` must not change; pages are sized so nothing is
preempted (both checked).

    python benchmarks/engine/bench_interference.py              # SmolLM2, 8 streams, 1,500-token prompt
    python benchmarks/engine/bench_interference.py --quick      # smoke test: 4 streams, 300 tokens, 1 repeat
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402

from benchmarks.lib.harness import add_engine_args, engine_facts, greedy, llm_from_args  # noqa: E402
from benchmarks.lib.report import git_state, ms, percentiles, save_plot, script_parser, write_result  # noqa: E402
from benchmarks.lib.workloads import vocab_hi  # noqa: E402

STREAM_PROMPT_TOKENS, LONG_MAX_TOKENS, TARGET_RATIO = 64, 8, 2.0
# Sizes with a default and a smaller --quick default: (option, full, quick, help).
SIZES = [
    ("--streams", 8, 4, "decoding streams"),
    ("--long-prompt-tokens", 1500, 300, "the long prompt"),
    ("--max-num-batched-tokens", 512, 128, "step token budget"),
    ("--max-num-seqs", 16, 8, "sequences (the server's default)"),
    ("--max-model-len", 2048, 512, "tokens per sequence"),
    ("--warm-steps", 40, 8, "phase-1 decode steps"),
    ("--repeats", 3, 1, "phase-2 measurements"),
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = script_parser(__doc__, "interference.json", model=None)
    # The sizes below set three engine knobs (with --quick defaults); num_pages fits every stream.
    engine_sizes = ("max_num_batched_tokens", "max_num_seqs", "max_model_len", "num_pages")
    add_engine_args(p, exclude=("seed", *engine_sizes))
    for flag, full, quick, help in SIZES:
        p.add_argument(flag, type=int, help=f"{help} (default {full}; --quick {quick})")
    p.add_argument("--tail-steps", type=int, default=4, help="steps recorded past the first token")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="smoke test: small shapes, one repeat")
    args = p.parse_args(argv)
    for flag, full, quick, _ in SIZES:
        name = flag[2:].replace("-", "_")
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    if args.streams + 1 > args.max_num_seqs:
        p.error("--streams + 1 (the long prompt) must fit in --max-num-seqs")
    return args


class Recorder:
    """Drives the engine step by step; stamps every stream token and records every device step
    (the engine's step listener)."""

    def __init__(self, engine) -> None:
        self.engine, self.tokens, self.steps = engine, {}, []
        engine.add_step_listener(self.record)

    def record(self, event) -> None:
        # Steps run back to back: a step dispatched while the one before it ran starts when that one ends.
        self.steps.append(
            {
                "start": event.start,
                "kind": event.kind,  # mixed: has prompt tokens
                "rows": event.num_seqs,
                "decodes": event.num_decodes,
                "tokens": event.num_tokens,
                "end": event.end,
                "duration_s": event.end - event.start,
            }
        )

    def close(self) -> None:
        self.engine.remove_step_listener(self.record)

    def step(self) -> list:
        outputs = self.engine.step()
        now = time.monotonic()
        for out in outputs:
            stamps = self.tokens.setdefault(out.request_id, [])
            stamps += [now] * (len(out.outputs[0].token_ids) - len(stamps))
        return outputs


def gaps_within(stamps: list[float], lo: float, hi: float) -> list[float]:
    """Gaps between consecutive tokens of one stream that overlap [lo, hi]."""
    return [b - a for a, b in zip(stamps, stamps[1:]) if b > lo and a < hi]


def long_prompt(
    rec: Recorder, streams: list[str], prompt: list[int], params, tail_steps: int
) -> dict:
    """Submit one long prompt while the streams decode; step until it has finished (recording
    `tail_steps` steps past its first token at least); return the stall it caused."""
    arrival = time.monotonic()
    rid = rec.engine.add_request(prompt, params)
    while not rec.tokens.get(rid):
        rec.step()
    first, done, n = rec.tokens[rid][0], None, 0
    while done is None or n < tail_steps:
        done = done or next((o for o in rec.step() if o.request_id == rid and o.finished), None)
        n += 1
    gaps = [g for s in streams for g in gaps_within(rec.tokens[s], arrival, first)]
    during = [st for st in rec.steps if arrival <= st["start"] and st["end"] <= first]
    keys = ("kind", "rows", "decodes", "tokens", "duration_s")
    steps = [{k: st[k] for k in keys} for st in during]
    return {
        "arrival": arrival,
        "first_token": first,
        "ttft_s": first - arrival,
        "worst_gap_s": max(gaps),
        "gaps_s": percentiles(gaps),
        "steps_during_prefill": steps,
        "num_prompt_steps": sum(st["kind"] in ("prefill", "mixed") for st in steps),
        "num_decode_steps": sum(st["kind"] == "decode" for st in steps),
        "long_finished": done.outputs[0].finish_reason,
        "long_output_tokens": len(done.outputs[0].token_ids),
        "long_cached_tokens": done.num_cached_tokens,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rng = np.random.default_rng(args.seed)
    hi = vocab_hi(args.model)
    # Every sequence at full length fits.
    num_pages = (args.streams + 1) * -(-args.max_model_len // 16) + 1
    llm = llm_from_args(
        args,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_pages=num_pages,
        use_tqdm=sys.stderr.isatty(),
    )
    engine, cfg = llm.engine, llm.engine.config
    streams = [
        engine.add_request(
            rng.integers(100, hi, STREAM_PROMPT_TOKENS).tolist(),
            greedy(cfg.max_model_len - STREAM_PROMPT_TOKENS),
        )
        for _ in range(args.streams)
    ]
    rec = Recorder(engine)
    while min(len(rec.tokens.get(s, [])) for s in streams) < 4:  # prefilled, a few decodes
        rec.step()
    compiles_before = engine.stats().compiles

    t0 = time.monotonic()  # phase 1: the streams alone
    for _ in range(args.warm_steps):
        rec.step()
    t1 = time.monotonic()
    itl = [g for s in streams for g in gaps_within(rec.tokens[s], t0, t1)]
    decode_steps = [
        st["end"] - st["start"] for st in rec.steps if st["start"] >= t0 and st["end"] <= t1
    ]
    phase1 = {
        "itl_s": {**percentiles(itl), "max": max(itl)},
        "decode_step_s": percentiles(decode_steps),
    }
    p50 = phase1["itl_s"]["p50"]
    print(
        f"phase 1: ITL p50 {ms(p50, 1)} ms, p99 {ms(phase1['itl_s']['p99'], 1)} ms, max {ms(max(itl), 1)} ms",
        flush=True,
    )

    # Phase 2: a long prompt arrives (fresh ids each time: no prefix-cache hit).
    repeats, spans = [], []
    for r in range(args.repeats):
        rep = long_prompt(
            rec,
            streams,
            rng.integers(100, hi, args.long_prompt_tokens).tolist(),
            greedy(LONG_MAX_TOKENS),
            args.tail_steps,
        )
        spans.append((rep.pop("arrival") - t0, rep.pop("first_token") - t0))
        rep = {"repeat": r, **rep, "ratio_worst_gap_to_itl_p50": rep["worst_gap_s"] / p50}
        repeats.append(rep)
        kinds = " ".join(
            f"{st['kind']}({st['rows']}x, {st['tokens']} tok) {ms(st['duration_s'], 1)}"
            for st in rep["steps_during_prefill"]
        )
        print(
            f"repeat {r}: TTFT {ms(rep['ttft_s'], 1)} ms, worst gap {ms(rep['worst_gap_s'], 1)} ms = "
            f"{rep['ratio_worst_gap_to_itl_p50']:.1f}x ITL p50; steps (ms): {kinds}",
            flush=True,
        )

    alive = sum(s in engine.requests for s in streams)
    for s in streams:
        engine.abort(s)
    rec.close()
    med = lambda f: statistics.median(map(f, repeats))  # noqa: E731
    median = {
        "ttft_s": med(lambda r: r["ttft_s"]),
        "worst_gap_s": med(lambda r: r["worst_gap_s"]),
        "gap_p50_s": med(lambda r: r["gaps_s"]["p50"]),
        "gap_p99_s": med(lambda r: r["gaps_s"]["p99"]),
        "ratio_worst_gap_to_itl_p50": med(lambda r: r["ratio_worst_gap_to_itl_p50"]),
    }
    result = {
        "benchmark": "interference",
        "model": args.model,
        "dtype": args.dtype,
        "scenario": {
            "streams": args.streams,
            "stream_prompt_tokens": STREAM_PROMPT_TOKENS,
            "long_prompt_tokens": args.long_prompt_tokens,
            "long_max_tokens": LONG_MAX_TOKENS,
            "warm_steps": args.warm_steps,
            "tail_steps": args.tail_steps,
            "repeats": args.repeats,
            "seed": args.seed,
            "sampling": "greedy, ignore_eos",
        },
        "engine": engine_facts(cfg, "target_tpot_ms"),
        "git": git_state(),
        "warmup_s": llm.warmup_seconds,
        "num_compiles": engine.stats().compiles,
        "compiles_during_timed": engine.stats().compiles - compiles_before,
        "num_preemptions": engine.stats().preemptions,
        "streams_outlasted": alive == len(streams),
        "phase1": phase1,
        "median": median,
        "repeats": repeats,
        "target_ratio": TARGET_RATIO,
        "meets_target": median["ratio_worst_gap_to_itl_p50"] <= TARGET_RATIO,
        "timeline": {
            "streams_s": [[round(t - t0, 5) for t in rec.tokens[s] if t >= t0] for s in streams],
            "prefill_spans_s": spans,
        },
    }
    print(
        f"median: TTFT {ms(median['ttft_s'], 1)} ms, worst gap {ms(median['worst_gap_s'], 1)} ms = "
        f"{median['ratio_worst_gap_to_itl_p50']:.1f}x ITL p50 (target <= {TARGET_RATIO:g}x)"
    )
    write_result(result, args.out)
    plot(result, args.out)
    if (
        result["compiles_during_timed"]
        or result["num_preemptions"]
        or not result["streams_outlasted"]
    ):
        print(
            "error: compiles, preemptions or a finished stream during the timed run",
            file=sys.stderr,
        )
        return 1
    return 0


def plot(result: dict, out: str) -> Path:
    """Top: each stream's token arrivals over time. Bottom: each token's gap to the previous one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(12, 6.4), height_ratios=[1, 1.3])
    streams = result["timeline"]["streams_s"]
    for i, ts in enumerate(streams):
        top.plot(ts, [i] * len(ts), "|", markersize=8)
        bottom.plot(ts[1:], [1e3 * (b - a) for a, b in zip(ts, ts[1:])], ".", markersize=4)
    p50 = 1e3 * result["phase1"]["itl_s"]["p50"]
    bottom.axhline(p50, color="k", lw=0.8, label=f"phase-1 ITL p50 {p50:.0f} ms")
    bottom.axhline(2 * p50, color="k", ls="--", lw=0.8, label="target: 2x p50")
    for j, (a, b) in enumerate(result["timeline"]["prefill_spans_s"]):
        for ax in (top, bottom):
            label = "long prompt: arrival -> first token" if j == 0 and ax is bottom else None
            ax.axvspan(a, b, color="tab:red", alpha=0.15, label=label)
    top.set_ylabel("stream")
    top.set_yticks(range(len(streams)))
    bottom.set_yscale("log")
    bottom.set_ylabel("gap to previous token (ms)")
    bottom.set_xlabel("time since phase 1 started (s)")
    bottom.legend(fontsize=8, loc="upper left")
    top.grid(alpha=0.3)
    bottom.grid(alpha=0.3)
    s, m = result["scenario"], result["median"]
    top.set_title(
        f"{Path(result['model']).name}: {s['streams']} streams, a {s['long_prompt_tokens']}-token prompt "
        f"arrives (chunk {result['engine']['max_num_batched_tokens']}); median worst gap "
        f"{1e3 * m['worst_gap_s']:.0f} ms = {m['ratio_worst_gap_to_itl_p50']:.1f}x ITL p50, "
        f"TTFT {1e3 * m['ttft_s']:.0f} ms",
        fontsize=10,
    )
    return save_plot(fig, out)


if __name__ == "__main__":
    sys.exit(main())
