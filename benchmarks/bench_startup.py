"""Server start-up: seconds from `python -m server` to /health 200, cold and warm.

Deliver 6 of the ragged-step issue: cold (empty caches) <= 60 s, warm (caches from an earlier
start) <= 15 s on this machine. Cold: a fresh cache folder (`MINIVLLM_COMPILE_CACHE`), so every
bucket is traced, lowered and compiled (and stored). Warm, `--repeats` times: the same folder,
so every program is loaded whole (`minivllm_jax.engine.compilation`).

The converted checkpoint is reused by all of them (conversion happens once per model, before
the first start, and is not timed). The program counts (compiled, of which loaded) come from
the server's /metrics.

    python benchmarks/bench_startup.py                  # SmolLM2, server defaults
    python benchmarks/bench_startup.py --quick          # smoke test on a tiny model
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import RESULTS, machine_info, write_result  # noqa: E402
from benchmarks.load_test import launched_server  # noqa: E402

COLD_TARGET_S, WARM_TARGET_S = 60.0, 15.0


def timed_start(model: str, server_args: str, cache_dir: Path, timeout: float) -> dict:
    """Launch the server with this compile cache; the seconds until /health said 200 and the
    program counts its /metrics reports."""
    import httpx

    start = time.perf_counter()
    with launched_server(
        model,
        server_args,
        timeout,
        None,
        env={"MINIVLLM_COMPILE_CACHE": str(cache_dir)},
        poll_s=0.05,
    ) as url:
        ready_s = time.perf_counter() - start
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
    return {"ready_s": ready_s, **_program_counts(metrics)}


def _program_counts(metrics: str) -> dict:
    counts = {}
    for line in metrics.splitlines():
        for name in ("minivllm_compiles_total", "minivllm_programs_loaded_total"):
            if line.startswith(name + " "):
                counts[name.removeprefix("minivllm_")] = int(float(line.split()[1]))
    return counts


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--server-args", default="", help='extra server flags, e.g. "--max-num-seqs 32"')
    p.add_argument("--repeats", type=int, default=3, help="warm starts (median reported)")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument(
        "--quick", action="store_true", help="smoke test: a tiny model (--model), 1 repeat"
    )
    p.add_argument("--out", default=str(RESULTS / "startup.json"))
    args = p.parse_args(argv)
    if args.quick:
        args.repeats = 1
    return args


def run(args: argparse.Namespace) -> dict:
    cache = Path(tempfile.mkdtemp(prefix="minivllm-startup-"))
    try:
        cold = timed_start(args.model, args.server_args, cache, args.timeout)
        print(f"cold: {cold['ready_s']:.1f} s", flush=True)
        warm = []
        for _ in range(args.repeats):
            warm.append(timed_start(args.model, args.server_args, cache, args.timeout))
            print(f"warm: {warm[-1]['ready_s']:.1f} s", flush=True)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    return {
        "benchmark": "startup",
        "model": args.model,
        "server_args": args.server_args,
        "machine": machine_info(),
        "cold": cold,
        "warm": warm,
        "cold_s": cold["ready_s"],
        "warm_s": statistics.median(r["ready_s"] for r in warm),
        "targets_s": {"cold": COLD_TARGET_S, "warm": WARM_TARGET_S},
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    write_result(result, args.out)
    print(
        f"cold {result['cold_s']:.1f} s (target <= {COLD_TARGET_S:.0f}), warm {result['warm_s']:.1f} s "
        f"(target <= {WARM_TARGET_S:.0f}); programs {result['cold'].get('compiles_total')}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
