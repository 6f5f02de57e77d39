"""Server start-up: seconds from `python -m server` to /health 200, cold and warm.

Deliver 6 of the ragged-step issue: cold (empty caches) <= 60 s, warm (caches from an earlier
start) <= 15 s on this machine. Cold: a fresh cache folder (`MINIVLLM_COMPILE_CACHE`), so every
bucket is traced, lowered and compiled (and stored). Warm, `--repeats` times: the same folder,
so every program is loaded whole (`minivllm_jax.engine.compilation`).

The converted checkpoint is reused by all of them (conversion happens once per model, before
the first start, and is not timed). The program counts (compiled, of which loaded) come from
the server's /metrics.

    python benchmarks/serving/bench_startup.py                  # SmolLM2, server defaults
    python benchmarks/serving/bench_startup.py --quick          # smoke test on a tiny model
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.lib.report import script_parser, write_result  # noqa: E402
from benchmarks.lib.serving import launched_server, metric  # noqa: E402

COLD_TARGET_S, WARM_TARGET_S = 60.0, 15.0


def timed_start(model: str, server_args: str, cache_dir: Path, timeout: float) -> dict:
    """Launch the server with this compile cache; the seconds until /health said 200 and the
    program counts its /metrics reports."""
    start = time.perf_counter()
    env = {"MINIVLLM_COMPILE_CACHE": str(cache_dir)}
    with launched_server(model, server_args, timeout, env=env, poll_s=0.05) as (url, _):
        ready_s = time.perf_counter() - start
        counts = {
            k: metric(url, f"minivllm_{k}") for k in ("compiles_total", "programs_loaded_total")
        }
    return {"ready_s": ready_s, **{k: int(v) for k, v in counts.items() if v is not None}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = script_parser(__doc__, "startup.json")
    p.add_argument("--server-args", default="", help='extra server flags, e.g. "--max-num-seqs 32"')
    p.add_argument("--repeats", type=int, default=3, help="warm starts (median reported)")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument(
        "--quick", action="store_true", help="smoke test: a tiny model (--model), 1 repeat"
    )
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
