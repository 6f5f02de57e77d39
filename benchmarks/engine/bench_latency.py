"""Offline latency under load: our engine vs HF transformers `generate` (PyTorch), same run.

A closed loop keeps C requests in flight (C = each `--concurrency`): whenever one finishes,
the next one arrives at once. Every request's arrival and the host time each of its output
tokens became available are recorded, giving time to first token (TTFT, queueing included),
time per output token after the first (TPOT), inter-token latency (ITL) at p50/p90/p99,
output tok/s, and goodput (completed requests/s meeting both `--slo-ttft-ms` and
`--slo-tpot-ms`).

Ours: `LLMEngine.add_request` / `step()` with continuous batching; all bucket shapes are
compiled before timing and `num_compiles` must not change while timing (checked, recorded).
PyTorch peer: the same requests in static batches of C with left padding (`generate`, no
EOS, greedy); a request's tokens are timestamped by a streamer, and a closed-loop user whose
request finished early waits for the whole batch, so its next TTFT includes that wait.
llama.cpp peer (llama-cpp-python, on the shipped Q4_1 GGUF and an F32 GGUF of the same
weights): C sequences in flight through its multi-sequence batch API, a finished one's slot
refilled at once (continuous batching, as llama.cpp's server does), greedy argmax.

Prompts are seeded random token ids (fresh ids at each concurrency, same lengths, so the
prefix cache never hits across levels); outputs are forced to their drawn lengths
(`ignore_eos`), greedy on both sides.

    python benchmarks/engine/bench_latency.py                          # chat preset, C = 1 2 4 8 16 32
    python benchmarks/engine/bench_latency.py --concurrency 1 8 --num-prompts 16 --no-hf --no-llamacpp
    python benchmarks/engine/bench_latency.py --quick                  # smoke test: tiny preset, C = 1 2 4
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.lib import peers  # noqa: E402
from benchmarks.lib.harness import add_engine_args, engine_facts, greedy, llm_from_args  # noqa: E402
from benchmarks.lib.report import (  # noqa: E402
    add_slo_args,
    latency_summary,
    ms,
    plot_levels,
    print_levels,
    request_timings,
    script_parser,
    write_result,
)
from benchmarks.lib.workloads import (  # noqa: E402
    Workload,
    add_workload_args,
    make_workload,
    random_prompts,
    vocab_hi,
)

DEFAULT_CONCURRENCY = [1, 2, 4, 8, 16, 32]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = script_parser(__doc__, "latency.json", model=None)
    # max_num_seqs is the largest --concurrency; max_model_len None: the next power of two
    # >= the longest request (at least 128); --seed is the workload's.
    add_engine_args(p, exclude=("seed", "max_num_seqs"))
    add_workload_args(p, default_preset="chat")
    levels = " ".join(map(str, DEFAULT_CONCURRENCY))
    p.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=None,
        help=f"requests kept in flight, one run each (default {levels})",
    )
    add_slo_args(p)
    p.add_argument("--threads", type=int, default=2, help="torch and llama.cpp threads")
    p.add_argument("--no-hf", action="store_true", help="skip the PyTorch peer")
    peers.add_peer_args(p)
    p.add_argument(
        "--quick", action="store_true", help="smoke test: tiny preset, concurrency 1 2 4"
    )
    args = p.parse_args(argv)
    if args.quick:
        args.preset = "tiny"
        args.concurrency = args.concurrency or [1, 2, 4]
    args.concurrency = sorted(set(args.concurrency or DEFAULT_CONCURRENCY))
    if args.concurrency[0] < 1:
        p.error("--concurrency values must be >= 1")
    return args


def fresh_prompts(work: Workload, seed: int, vocab_hi: int) -> list[list[int]]:
    """New random ids with the workload's prompt lengths: each level gets prompts the prefix
    cache has never seen, while lengths (and so the work) stay identical across levels."""
    return random_prompts([len(p) for p in work.prompts], seed, vocab_hi)


# ------------------------------------------------------------------ ours


def engine_closed_loop(
    llm: Any, prompts: list[list[int]], output_lens: list[int], concurrency: int
) -> tuple[list[dict], float]:
    """Keep `concurrency` requests in flight on `llm.engine` until all are done; returns
    per-request timings (see `request_timings`) and the wall time."""
    engine = llm.engine
    pending = deque(range(len(prompts)))
    arrival: dict[str, float] = {}
    times: dict[str, list[float]] = {}
    records: list[dict] = []
    start = time.perf_counter()
    while pending or arrival:
        while pending and len(arrival) < concurrency:
            i = pending.popleft()
            rid = engine.add_request(prompts[i], greedy(output_lens[i]))
            arrival[rid], times[rid] = time.perf_counter(), []
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            stamps = times[out.request_id]
            stamps += [now] * (len(out.outputs[0].token_ids) - len(stamps))
            if out.finished:
                records.append(
                    request_timings(arrival.pop(out.request_id), times.pop(out.request_id))
                )
    return records, time.perf_counter() - start


def run_ours(
    args: argparse.Namespace,
    work: Workload,
    level_prompts: dict[int, list[list[int]]],
    vocab_hi: int,
) -> dict:
    """Load and warm up our engine, then one closed-loop run per concurrency level."""
    max_len = args.max_model_len or max(128, 1 << (work.max_len - 1).bit_length())
    start = time.perf_counter()
    llm = llm_from_args(
        args,
        max_num_seqs=max(args.concurrency),
        max_model_len=max_len,
        use_tqdm=sys.stderr.isatty(),
    )
    startup_s = time.perf_counter() - start
    # An untimed pass over the same shapes warms Python and allocator paths (compiles are done).
    warm = fresh_prompts(work, args.seed + 10_000, vocab_hi)[: max(args.concurrency)]
    engine_closed_loop(llm, warm, [4] * len(warm), max(args.concurrency))

    levels, compiles_before = [], llm.engine.stats().compiles
    for c in args.concurrency:
        before = llm.engine.stats().compiles
        records, wall = engine_closed_loop(llm, level_prompts[c], work.output_lens, c)
        levels.append(summarize_level(args, "ours", c, records, wall))
        levels[-1]["compiles_during_run"] = llm.engine.stats().compiles - before
    cfg = llm.engine.config
    return {
        "engine": engine_facts(cfg, "enable_prefix_caching"),
        "startup_s": startup_s,
        "warmup_s": llm.warmup_seconds,
        "num_compiles": llm.engine.stats().compiles,
        "compiles_during_timed": llm.engine.stats().compiles - compiles_before,
        "levels": levels,
    }


# ------------------------------------------------------------------ PyTorch peer


def hf_stamps(hf: Any, prompts: list[list[int]], max_new: int, pad_id: int) -> list[float]:
    """One left-padded greedy batch, EOS disabled; returns the host time of every generated step."""
    streamer = peers.TokenTimes()
    peers.hf_generate(hf, prompts, max_new, pad_id=pad_id, streamer=streamer)
    if len(streamer.times) < max_new:
        raise RuntimeError(f"HF generate stopped after {len(streamer.times)} of {max_new} steps")
    return streamer.times


def hf_static_batches(
    hf: Any, prompts: list[list[int]], output_lens: list[int], concurrency: int, pad_id: int
) -> tuple[list[dict], float]:
    """C closed-loop users, served in static batches of C: user j's next request arrives when
    its previous one has its last token, but runs only when the whole batch is done."""
    records: list[dict] = []
    start = time.perf_counter()
    user_free = [start] * concurrency  # when each user sent its next request
    for b in range(0, len(prompts), concurrency):
        batch = range(b, min(b + concurrency, len(prompts)))
        stamps = hf_stamps(
            hf, [prompts[i] for i in batch], max(output_lens[i] for i in batch), pad_id
        )
        for j, i in enumerate(batch):
            token_times = stamps[: output_lens[i]]
            records.append(request_timings(user_free[j], token_times))
            user_free[j] = token_times[-1]
    return records, time.perf_counter() - start


def run_hf(
    args: argparse.Namespace, work: Workload, level_prompts: dict[int, list[list[int]]]
) -> dict:
    """The PyTorch peer at the same concurrency levels, on the same prompts."""
    start = time.perf_counter()
    hf = peers.load_hf_model(args.model, args.dtype, args.threads)
    load_s = time.perf_counter() - start
    pad_id = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0
    hf_stamps(hf, work.prompts[: max(args.concurrency)], 2, pad_id)  # warm-up, like ours
    levels = []
    for c in args.concurrency:
        records, wall = hf_static_batches(hf, level_prompts[c], work.output_lens, c, pad_id)
        levels.append(summarize_level(args, "hf", c, records, wall))
    batching = "static batches of C, left padding"
    return {"load_s": load_s, "threads": args.threads, "batching": batching, "levels": levels}


# ------------------------------------------------------------------ llama.cpp peer


def run_llamacpp(
    args: argparse.Namespace,
    work: Workload,
    level_prompts: dict[int, list[list[int]]],
    name: str,
    path: Path,
) -> dict:
    """llama.cpp at the same concurrency levels, on the same prompts: C closed-loop users."""
    start = time.perf_counter()
    levels = []
    with peers.LlamaCppPeer(path, args.threads) as peer:
        load_s = time.perf_counter() - start
        for c in args.concurrency:
            run = peer.run(level_prompts[c], work.output_lens, c, closed_loop=True)
            records = [request_timings(a, t) for a, t in zip(run.arrival, run.token_times)]
            levels.append(summarize_level(args, name, c, records, run.elapsed_s))
    batching = "continuous, C sequences in flight (multi-sequence llama_decode)"
    return {
        "gguf": path.name,
        "load_s": load_s,
        "threads": args.threads,
        "batching": batching,
        "levels": levels,
    }


# ------------------------------------------------------------------ report


def summarize_level(args: argparse.Namespace, name: str, c: int, records: list, wall: float):
    """One concurrency level's latency summary (`latency_summary`), printed as it is made."""
    lv = {"concurrency": c, **latency_summary(records, wall, args.slo_ttft_ms, args.slo_tpot_ms)}
    print(
        f"[{name}] C={lv['concurrency']}: TTFT p50 {ms(lv['ttft_s']['p50'])} ms, TPOT p50 "
        f"{ms(lv['tpot_s']['p50'])} ms, {lv['output_tokens_per_s']:.1f} out tok/s",
        flush=True,
    )
    return lv


def plot(result: dict, out: str) -> Path:
    """TTFT, TPOT and output tok/s vs concurrency, ours vs HF and llama.cpp."""
    series = [("ours", result["ours"]["levels"])]
    if result.get("hf"):
        series.append(("HF generate", result["hf"]["levels"]))
    series += [
        (f"llama.cpp {v}", side["levels"]) for v, side in (result.get("llamacpp") or {}).items()
    ]
    w = result["workload"]
    title = f"{result['model']} {result['dtype']}, {w['num_prompts']} requests ({w['preset']}) per level"
    return plot_levels(series, title, out)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    hi = vocab_hi(args.model)
    work = make_workload(args, vocab_hi=hi)
    level_prompts = {c: fresh_prompts(work, args.seed + c, hi) for c in args.concurrency}
    ours = run_ours(args, work, level_prompts, hi)
    hf = None if args.no_hf else run_hf(args, work, level_prompts)
    result = {
        "benchmark": "latency",
        "model": args.model,
        "dtype": args.dtype,
        "workload": work.describe(),
        "concurrency": args.concurrency,
        "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms},
        "sampling": "greedy, ignore_eos (exact output lengths)",
        "ours": ours,
        "hf": hf,
    }
    peer = peers.run_variants(
        args,
        result,
        lambda v, path: run_llamacpp(args, work, level_prompts, f"llama.cpp {v}", path),
    )
    sides = {"ours": ours["levels"], **({"hf": hf["levels"]} if hf else {})}
    print_levels({**sides, **{f"llama.cpp {v}": side["levels"] for v, side in peer.items()}})
    write_result(result, args.out)
    plot(result, args.out)
    if ours["compiles_during_timed"]:
        n = ours["compiles_during_timed"]
        print(
            f"error: {n} compiles during the timed runs (a bucket is missing from warm-up)",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
