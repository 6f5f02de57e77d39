"""Memory: where the bytes go, and how well the paged KV cache uses them.

Reports, for one engine configuration and one seeded workload:
  - parameter bytes (summed over the params pytree) and the KV pool (num_pages x bytes per page);
  - host RSS (now and peak, from /proc and getrusage) for our engine, and for the HF PyTorch
    peer loading the same model and generating one batch *in a separate process*, so the two
    RSS figures never mix (`--no-hf` skips it);
  - device memory stats from `jax.devices()[0].memory_stats()` (GPUs; "not available" on CPU);
  - a timeline sampled after every engine step: KV pages used, sequences running and waiting;
  - fragmentation: token slots allocated vs used. The configured page size is measured from the
    page manager; the `--page-sizes` sweep and the contiguous cache (every running sequence
    reserves max_model_len slots, as a non-paged engine must) are computed from the same
    timeline's sequence lengths, i.e. what each allocator would hold for the same sequences.

    python benchmarks/engine/bench_memory.py [--preset mixed] [--num-prompts 64] [--no-hf] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.lib.harness import (  # noqa: E402
    add_engine_args,
    engine_facts,
    greedy_params,
    llm_from_args,
    run_requests,
)
from benchmarks.lib.peers import hf_generate, load_hf_model  # noqa: E402
from benchmarks.lib.report import (  # noqa: E402
    add_options,
    new_figure,
    peak_rss_bytes,
    rss_bytes,
    save_plot,
    script_parser,
    write_result,
)
from benchmarks.lib.workloads import add_workload_args, make_workload  # noqa: E402

MIB = 2**20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = script_parser(__doc__, "memory.json", model=None)
    add_workload_args(p, default_preset="mixed")
    # max_model_len None: the engine default, what a server reserves. --preemption-mode swap
    # and --kv-disk-dir put pages in the other tiers (they are in the timeline).
    add_engine_args(p, exclude=("seed",))
    add_options(
        p,
        [
            ("--page-sizes", [8, 16, 32, 64, 128, 256], "page sizes of the fragmentation sweep"),
            ("--no-hf", False, "skip the PyTorch peer's RSS (a subprocess)"),
            ("--hf-batch", 8, "prompts the peer generates in one batch"),
            ("--threads", 2, "torch threads of the peer"),
            ("--quick", False, "tiny preset and a small engine, for smoke tests"),
        ],
    )
    p.add_argument("--hf-child", action="store_true", help=argparse.SUPPRESS)  # the peer process
    args = p.parse_args(argv)
    if args.quick:
        args.preset, args.num_prompts, args.max_num_seqs = "tiny", None, 4
        args.max_model_len, args.max_num_batched_tokens = 64, 32
        args.page_sizes = [4, 8, 16, 32, 64]
    return args


def device_memory() -> dict[str, Any]:
    """Accelerator memory stats, or an honest note where the backend has none (the CPU)."""
    import jax

    dev = jax.devices()[0]
    stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
    if not stats:
        return {"available": False, "note": f"not available on {dev.platform.upper()}"}
    keys = ("bytes_in_use", "peak_bytes_in_use", "bytes_limit", "bytes_reserved")
    return {"available": True, "device": str(dev), **{k: stats[k] for k in keys if k in stats}}


# ---------------------------------------------------------------- the PyTorch peer (own process)


def hf_child(args: argparse.Namespace) -> dict[str, Any]:
    """Runs inside the subprocess: load the HF model, generate one left-padded batch, report RSS."""
    rss_start = rss_bytes()
    model = load_hf_model(args.model, args.dtype, args.threads)
    rss_loaded = rss_bytes()
    wl = make_workload(args, vocab_hi=min(10000, model.config.vocab_size))
    prompts, lens = wl.prompts[: args.hf_batch], wl.output_lens[: args.hf_batch]
    hf_generate(model, prompts, max(lens))
    return {
        "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "batch": len(prompts),
        "rss_after_imports_bytes": rss_start,
        "rss_after_load_bytes": rss_loaded,
        "rss_after_generate_bytes": rss_bytes(),
        "peak_rss_bytes": peak_rss_bytes(),
    }


def measure_hf(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """The peer's memory, measured in a fresh interpreter so our RSS and its RSS never mix."""
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--hf-child"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        return {
            "error": proc.stderr.strip().splitlines()[-1]
            if proc.stderr.strip()
            else f"exit {proc.returncode}"
        }
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- timeline and fragmentation


class Timeline:
    """Samples the engine after every step: pages used, sequences running/waiting and the token
    count each running sequence holds in the cache (the input to the fragmentation numbers)."""

    def __init__(self) -> None:
        self.samples: list[dict[str, Any]] = []
        self.t0 = time.monotonic()

    def __call__(self, engine) -> None:
        stats = engine.stats()
        self.samples.append(
            {
                "step": len(self.samples),
                "t_s": round(time.monotonic() - self.t0, 4),
                "running": stats.running,
                "waiting": stats.waiting,
                "pages_used": stats.used_pages,  # the memory tier
                "swap_pages": stats.swap_pages,
                "disk_pages": stats.disk_pages,
                "seq_tokens": engine.running_kv_tokens(),
            }
        )


def fragmentation(
    samples: list[dict[str, Any]], page_sizes: list[int], max_model_len: int
) -> list[dict[str, Any]]:
    """Allocated vs used token slots summed over all steps, per allocator (paged P, contiguous).

    Paged with page size P holds ceil(n / P) * P slots for a sequence of n tokens; a contiguous
    cache reserves max_model_len slots per running sequence, whatever its length.
    """
    used = sum(sum(s["seq_tokens"]) for s in samples)
    allocators = [(f"paged-{p}", lambda n, p=p: -(-n // p) * p) for p in sorted(set(page_sizes))]
    allocators.append((f"contiguous-{max_model_len}", lambda n: max_model_len))
    rows = []
    for name, slots in allocators:
        per_step = [sum(slots(n) for n in s["seq_tokens"]) for s in samples]
        allocated = sum(per_step)
        rows.append(
            {
                "allocator": name,
                "used_slots_step_sum": used,
                "allocated_slots_step_sum": allocated,
                "peak_allocated_slots": max(per_step, default=0),
                "waste_pct": round(100.0 * (1 - used / allocated), 2) if allocated else None,
            }
        )
    return rows


def plot(result: dict[str, Any], out: str | Path) -> Path:
    """Left: pages used and sequences in flight per step. Right: fragmentation per allocator."""
    fig, axes = new_figure(2, width=6.5)
    ax, bx = axes[0]
    tl = result["timeline"]
    steps = [s["step"] for s in tl]
    ax.plot(steps, [s["pages_used"] for s in tl], color="tab:blue", label="KV pages used")
    usable = result["kv_pool"]["usable_pages"]
    ax.axhline(usable, color="tab:blue", ls=":", lw=1, label="usable pages")
    ax.set_xlabel("engine step")
    ax.set_ylabel("KV pages used", color="tab:blue")
    twin = ax.twinx()
    twin.plot(steps, [s["running"] for s in tl], color="tab:orange", label="running")
    twin.plot(steps, [s["waiting"] for s in tl], color="tab:gray", ls="--", label="waiting")
    twin.set_ylabel("sequences")
    lines = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
    ax.legend(lines, [h.get_label() for h in lines], loc="upper right", fontsize=8)
    ax.set_title(f"KV pages vs requests in flight ({result['workload']['preset']})")
    names = [r["allocator"] for r in result["fragmentation"]]
    colors = ["tab:red" if n.startswith("contiguous") else "tab:blue" for n in names]
    bars = bx.bar(names, [r["waste_pct"] or 0.0 for r in result["fragmentation"]], color=colors)
    bx.bar_label(bars, fmt="%.1f%%", fontsize=8)
    bx.set(ylabel="allocated but unused token slots (%)")
    bx.set_title("KV fragmentation: paged page sizes vs contiguous max-length")
    bx.tick_params(axis="x", rotation=30)
    return save_plot(fig, out)


# ---------------------------------------------------------------- main


def measure_ours(args: argparse.Namespace) -> dict[str, Any]:
    """Build the engine, run the workload sampling the timeline, and collect the memory facts."""
    import jax

    from minivllm_jax.models.params import model_dtype
    from minivllm_jax.ops.kv_cache import kv_bytes_per_page

    rss_start = rss_bytes()
    llm = llm_from_args(args)
    engine = llm.engine
    cfg, mcfg, dtype = engine.config, engine.model_config, model_dtype(engine.params)
    rss_loaded = rss_bytes()
    wl = make_workload(args, vocab_hi=min(10000, mcfg.vocab_size))
    if wl.max_len > cfg.max_model_len:
        raise SystemExit(
            f"workload needs max_model_len >= {wl.max_len}; engine has {cfg.max_model_len}"
        )
    timeline = Timeline()
    run = run_requests(engine, wl.prompts, greedy_params(wl.output_lens), on_step=timeline)
    per_page = kv_bytes_per_page(mcfg, cfg.cache.page_size, dtype, cfg.cache.kv_cache_dtype)
    measured_pool = sum(x.nbytes for x in jax.tree.leaves(engine.kv_cache))  # with int8 scales
    assert measured_pool == cfg.cache.num_pages * per_page, (measured_pool, per_page)
    pages = [s["pages_used"] for s in timeline.samples]
    capacity = (cfg.cache.num_pages - 1) * cfg.cache.page_size  # tokens: page 0 is scratch
    tiers = engine.stats().tiers()
    frag = fragmentation(
        timeline.samples, [cfg.cache.page_size, *args.page_sizes], cfg.max_model_len
    )
    for row in frag:  # the configured page size is also counted from the page manager itself
        if row["allocator"] == f"paged-{cfg.cache.page_size}":
            row["measured_allocated_slots_step_sum"] = sum(pages) * cfg.cache.page_size
    return {
        "workload": wl.describe(),
        "engine": {**engine_facts(cfg), "dtype": str(dtype)},
        "params": {
            "count": sum(x.size for x in jax.tree.leaves(engine.params)),
            "bytes": sum(x.nbytes for x in jax.tree.leaves(engine.params)),
        },
        "kv_pool": {
            "num_pages": cfg.cache.num_pages,
            "usable_pages": cfg.cache.num_pages - 1,  # page 0 is the scratch page
            "bytes_per_page": per_page,
            "bytes": measured_pool,
            "token_capacity": capacity,
            "max_len_seqs_that_fit_contiguous": capacity // cfg.max_model_len,
            "peak_pages_used": max(pages, default=0),
            "peak_running": max((s["running"] for s in timeline.samples), default=0),
        },
        "tiers": {  # where KV pages were: memory (the pool above), the host swap pool, the disk tier
            "memory_pages_peak": max(pages, default=0),
            "swap_pages_peak": max((s["swap_pages"] for s in timeline.samples), default=0),
            "disk_pages_end": tiers.get("disk_pages", 0),
            "preemption_mode": cfg.scheduler.preemption_mode,
            "kv_disk_dir": cfg.cache.kv_disk_dir,
            **{k: v for k, v in tiers.items() if k != "swap_pages"},
        },
        "host_rss": {
            "rss_before_load_bytes": rss_start,
            "rss_after_load_and_warmup_bytes": rss_loaded,
            "rss_after_run_bytes": rss_bytes(),
            "peak_rss_bytes": peak_rss_bytes(),
        },
        "device_memory": device_memory(),
        "run": run.metrics(),
        "timeline": timeline.samples,
        "fragmentation": frag,
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.hf_child:
        print(json.dumps(hf_child(args)))
        return 0
    result: dict[str, Any] = {"benchmark": "memory", "model": args.model, **measure_ours(args)}
    if not args.no_hf:
        result["hf"] = measure_hf(args, argv)
    write_result(result, args.out)
    plot(result, args.out)
    summarize(result)
    return 0


def summarize(r: dict[str, Any]) -> None:
    kv, rss = r["kv_pool"], r["host_rss"]
    print(
        f"params {r['params']['bytes'] / MIB:.1f} MiB; KV pool {kv['bytes'] / MIB:.1f} MiB "
        f"({kv['num_pages']} pages x {kv['bytes_per_page'] / 1024:.0f} KiB); peak {kv['peak_pages_used']} pages used, "
        f"peak {kv['peak_running']} running"
    )
    t = r["tiers"]
    print(
        f"tiers: memory peak {t['memory_pages_peak']} pages, swap pool peak {t['swap_pages_peak']} pages, disk "
        f"{t['disk_pages_end']} pages at the end; prefix hits: {t['memory_hit_tokens']} tokens from memory, "
        f"{t['disk_hit_tokens']} from disk"
    )
    print(
        f"ours: peak RSS {rss['peak_rss_bytes'] / MIB:.0f} MiB (after load+warm-up {rss['rss_after_load_and_warmup_bytes'] / MIB:.0f} MiB)"
    )
    if "hf" in r:
        hf = r["hf"]
        if "error" in hf:
            print(f"HF peer failed: {hf['error']}")
        else:
            print(
                f"HF:   peak RSS {hf['peak_rss_bytes'] / MIB:.0f} MiB (after load {hf['rss_after_load_bytes'] / MIB:.0f} MiB), params {hf['param_bytes'] / MIB:.1f} MiB"
            )
    print(f"device memory: {r['device_memory'].get('note', r['device_memory'])}")
    for row in r["fragmentation"]:
        print(f"  {row['allocator']:>16}: {row['waste_pct']:5.1f}% of allocated token slots unused")


if __name__ == "__main__":
    sys.exit(main())
