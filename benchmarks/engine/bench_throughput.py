"""Offline throughput, nano-vllm style: N requests with random input/output lengths (seeded),
our engine vs the PyTorch peer (HF transformers `generate`, batched with left padding), same
model, dtype and threads, in the same run, for each --dtype; and llama.cpp (llama-cpp-python)
on the shipped Q4_1 GGUF and an F32 GGUF of the same weights, continuous batching of
--llamacpp-parallel sequences through its multi-sequence batch API, greedy, measured once
(its precision is the file's, whatever --dtype says).

Outputs are forced to their drawn lengths (`ignore_eos`; HF with no EOS), so both sides
produce exactly the same useful tokens. HF runs its batches in input order and decodes each
batch to its longest request; only requested tokens count. `--hf-batch-sweep 1 4 8 16` first
times each batch size on a prefix of the workload and runs the whole workload at the best.
Cost per 1M output tokens comes from --usd-per-hour; energy from RAPL / nvidia-smi when
readable (see micro/energy.py), else the JSON says why not.

    python benchmarks/engine/bench_throughput.py [--preset mixed] [--dtype float32 bfloat16] [--hf-batch 8]
    python benchmarks/engine/bench_throughput.py --no-llamacpp            # ours and HF only
    python benchmarks/engine/bench_throughput.py --quick --model PATH_TO_TINY_HF_DIR
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.lib import peers  # noqa: E402
from benchmarks.lib.harness import add_engine_args, llm_from_args, rates  # noqa: E402
from benchmarks.lib.report import (  # noqa: E402
    add_options,
    new_figure,
    save_plot,
    script_parser,
    write_result,
)
from benchmarks.lib.workloads import Workload, add_workload_args, make_workload, vocab_hi  # noqa: E402
from benchmarks.micro.energy import EnergyMeter, add_cost_args, cost_fields  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = script_parser(__doc__, "throughput.json", model=None)
    add_workload_args(p, default_preset="mixed")
    # The workload decides max_model_len; --seed is the workload's; --dtype takes a list here.
    add_engine_args(p, exclude=("dtype", "seed", "max_model_len"))
    p.add_argument(
        "--dtype",
        nargs="+",
        default=["float32"],
        choices=["float32", "bfloat16"],
        help="one or both; each is measured for both engines in this run",
    )
    add_options(
        p,
        [
            ("--temperature", 0.6, "0 = greedy on both sides"),
            ("--hf-batch", 8, "HF generate batch size (0 skips the PyTorch peer)"),
            ("--hf-sweep-prompts", int, "prefix length for the sweep (default: the largest batch)"),
            ("--threads", 2, "torch and llama.cpp threads (XLA uses the same cores)"),
            ("--llamacpp-parallel", 16, "llama.cpp sequences in flight (see docs/perf-notes.md)"),
        ],
    )
    p.add_argument(
        "--hf-batch-sweep",
        type=int,
        nargs="*",
        default=None,
        metavar="B",
        help="candidate HF batch sizes; the best on a workload prefix is used "
        "(overrides --hf-batch)",
    )
    peers.add_peer_args(p)
    add_cost_args(p)
    p.add_argument("--quick", action="store_true", help="preset tiny, small engine: a smoke test")
    args = p.parse_args(argv)
    if args.quick:
        args.preset, args.max_num_seqs, args.max_num_batched_tokens = "tiny", 8, 64
    return args


def run_ours(args: argparse.Namespace, dtype: str, wl: Workload) -> dict[str, Any]:
    """Our engine on the whole workload at once (continuous batching), after a full warm-up."""
    from minivllm_jax import SamplingParams

    start = time.perf_counter()
    llm = llm_from_args(args, dtype=dtype, max_model_len=wl.max_len)
    startup = time.perf_counter() - start
    params = [
        SamplingParams(temperature=args.temperature, max_tokens=o, ignore_eos=True, seed=i)
        for i, o in enumerate(wl.output_lens)
    ]
    compiles = llm.engine.stats().compiles
    with EnergyMeter() as meter:
        outs = llm.generate(wl.prompts, params, use_tqdm=False)
    elapsed = meter.elapsed_s
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == wl.output_tokens, (produced, wl.output_tokens)
    result = {
        "startup_s": startup,
        "warmup_s": llm.warmup_seconds,
        "compiled_programs": compiles,
        "compiles_during_run": llm.engine.stats().compiles - compiles,
        "preemptions": llm.engine.stats().preemptions,
        "num_pages": llm.engine.config.cache.num_pages,
        **rates(elapsed, wl.input_tokens, produced),
        **cost_fields(elapsed, produced, args.usd_per_hour, meter),
    }
    del llm, outs
    gc.collect()
    return result


def hf_batches(
    model: Any, prompts: list[list[int]], out_lens: list[int], batch: int, temperature: float
) -> None:
    """HF `generate` over the prompts in input order, `batch` at a time, each batch to its longest."""
    for i in range(0, len(prompts), batch):
        peers.hf_generate(model, prompts[i : i + batch], max(out_lens[i : i + batch]), temperature)


def run_hf(args: argparse.Namespace, dtype: str, wl: Workload) -> dict[str, Any]:
    """The PyTorch peer: load, warm up, optionally pick the best batch size, run the workload."""
    import torch

    start = time.perf_counter()
    model = peers.load_hf_model(args.model, dtype, args.threads)
    startup = time.perf_counter() - start
    torch.manual_seed(0)
    hf_batches(model, wl.prompts[:2], [2, 2], 2, args.temperature)  # warm-up: first-call overheads

    batch, sweep = args.hf_batch, None
    if args.hf_batch_sweep:
        n = args.hf_sweep_prompts or max(args.hf_batch_sweep)
        prompts, lens = wl.prompts[:n], wl.output_lens[:n]
        sweep = {}
        for b in args.hf_batch_sweep:
            t = time.perf_counter()
            hf_batches(model, prompts, lens, b, args.temperature)
            sweep[str(b)] = sum(lens) / (time.perf_counter() - t)
            print(
                f"  HF {dtype} batch {b}: {sweep[str(b)]:.1f} output tok/s on {len(prompts)} prompts"
            )
        batch = int(max(sweep, key=sweep.get))

    with EnergyMeter() as meter:
        hf_batches(model, wl.prompts, wl.output_lens, batch, args.temperature)
    elapsed = meter.elapsed_s
    del model
    gc.collect()
    result = {
        "batch_size": batch,
        "startup_s": startup,
        **rates(elapsed, wl.input_tokens, wl.output_tokens),
        **cost_fields(elapsed, wl.output_tokens, args.usd_per_hour, meter),
    }
    if sweep is not None:
        result["batch_sweep_output_tok_s"] = sweep
    return result


def run_llamacpp(args: argparse.Namespace, path: Path, wl: Workload) -> dict[str, Any]:
    """llama.cpp on the whole workload at once, --llamacpp-parallel sequences in flight, greedy."""
    start = time.perf_counter()
    with peers.LlamaCppPeer(path, args.threads) as peer:
        startup = time.perf_counter() - start
        with EnergyMeter() as meter:  # includes llama.cpp's few-token warm-up on the new context
            run = peer.run(wl.prompts, wl.output_lens, args.llamacpp_parallel)
    produced = sum(map(len, run.token_ids))
    assert produced == wl.output_tokens, (produced, wl.output_tokens)
    return {
        "gguf": path.name,
        "n_parallel": args.llamacpp_parallel,
        "sampling": "greedy",
        "startup_s": startup,
        **rates(run.elapsed_s, wl.input_tokens, produced),
        **cost_fields(run.elapsed_s, produced, args.usd_per_hour, meter),
    }


def _rates_text(side: dict[str, Any]) -> str:
    """The console line's start: tok/s and wall time."""
    return f"{side['output_tok_s']:.1f} output tok/s, {side['total_tok_s']:.1f} total tok/s ({side['elapsed_s']:.1f} s"


def _energy_text(side: dict[str, Any]) -> str:
    e = side["energy"]
    return f"{e['j_per_output_token']:.3f} J/token" if isinstance(e, dict) else "energy n/a"


def plot(result: dict[str, Any], out: str | Path) -> Path:
    """Grouped bars per dtype: output and total tok/s, ours vs HF, with the speedup on top; then
    one bar per llama.cpp GGUF variant."""
    fig, axes = new_figure(ncols=2, width=5.0)
    by_dtype, peer, wl = result["by_dtype"], result.get("llamacpp", {}), result["workload"]
    dtypes = list(by_dtype)
    for ax, metric in zip(axes[0], ["output_tok_s", "total_tok_s"]):
        sides = [("ours", "minivllm-jax (XLA)"), ("hf", "HF generate (PyTorch)")]
        for j, (side, label) in enumerate(sides):
            xs = [i + (j - 0.5) * 0.38 for i in range(len(dtypes))]
            ys = [by_dtype[d].get(side, {}).get(metric, 0.0) for d in dtypes]
            ax.bar_label(ax.bar(xs, ys, width=0.38, label=label), fmt="%.0f", fontsize=8)
        for i, d in enumerate(dtypes):
            if "speedup" in by_dtype[d] and metric == "output_tok_s":
                text = f"ours/HF {by_dtype[d]['speedup']:.2f}x"
                ax.annotate(
                    text, (i, 0), (0, -28), textcoords="offset points", ha="center", fontsize=9
                )
        for k, (variant, c) in enumerate(peer.items()):
            label, x = f"llama.cpp {variant}", len(dtypes) + k
            bars = ax.bar([x], [c[metric]], width=0.38, color=f"C{2 + k}", label=label)
            ax.bar_label(bars, fmt="%.0f", fontsize=8)
        ax.set_xticks(range(len(dtypes) + len(peer)), dtypes + [f"llama.cpp {v}" for v in peer])
        ax.set_ylabel(metric.replace("_tok_s", " tokens/s"))
        title = f"{result['model']}: {wl['preset']} workload, {wl['num_prompts']} requests"
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=8)
    return save_plot(fig, out)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    wl = make_workload(args, vocab_hi=vocab_hi(args.model))
    desc = wl.describe()
    result: dict[str, Any] = {
        "benchmark": "offline_throughput",
        "model": args.model,
        "workload": desc,
        # Flat workload fields of the old layout, kept for its readers.
        "num_prompts": desc["num_prompts"],
        "input_len": desc["input_len_range"],
        "output_len": desc["output_len_range"],
        "input_tokens": wl.input_tokens,
        "output_tokens": wl.output_tokens,
        "temperature": args.temperature,
        "threads": args.threads,
        "dtypes": args.dtype,
        "usd_per_hour": args.usd_per_hour,
        "by_dtype": {},
    }
    for dtype in args.dtype:
        r: dict[str, Any] = {"ours": run_ours(args, dtype, wl)}
        o = r["ours"]
        print(
            f"[{dtype}] ours: {_rates_text(o)}; warm-up {o['warmup_s']:.1f} s, {o['compiled_programs']} programs; "
            f"{o['usd_per_1m_output_tokens']:.4f} USD/1M tok, {_energy_text(o)})"
        )
        if args.hf_batch:
            r["hf"] = h = run_hf(args, dtype, wl)
            r["speedup"] = o["output_tok_s"] / h["output_tok_s"]
            print(
                f"[{dtype}] HF:   {_rates_text(h)} at batch {h['batch_size']}; "
                f"{h['usd_per_1m_output_tokens']:.4f} USD/1M tok, "
                f"{_energy_text(h)})\n[{dtype}] ours/HF output tok/s: {r['speedup']:.2f}x"
            )
        result["by_dtype"][dtype] = r
    # The first dtype's sides at the top level too, as in the old single-dtype layout.
    result.update({k: v for k, v in result["by_dtype"][args.dtype[0]].items()})
    for variant, c in peers.run_variants(
        args, result, lambda _, path: run_llamacpp(args, path, wl)
    ).items():
        c["ours_speedup"] = result["ours"]["output_tok_s"] / c["output_tok_s"]
        print(
            f"llama.cpp {variant}: {_rates_text(c)}, {c['n_parallel']} in flight; {_energy_text(c)}); "
            f"ours ({args.dtype[0]})/llama.cpp output tok/s: {c['ours_speedup']:.2f}x"
        )
    write_result(result, args.out)
    plot(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
