"""Run every benchmark with the settings the README quotes, then rebuild the results table.

    python benchmarks/run_all.py            # the full suite
    python benchmarks/run_all.py --only throughput decode
    python benchmarks/run_all.py --readme   # only rebuild the tables from the JSON results

The summary table goes to benchmarks/results/SUMMARY.md, bench_quant.py's to results/QUANT.md,
and every `<!-- results:NAME -->` block of README.md and benchmarks/README.md is rewritten from
the JSON results (benchmarks/lib/readme.py; tests/test_readme_results.py fails on a stale one).

Each entry is one script run (ours and the PyTorch peer in the same process where the script
compares them), so each number in the table can be reproduced by the command printed beside
it. Runs are sequential: on a small CPU, anything running beside a benchmark is noise.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchmarks.lib import readme  # noqa: E402
from benchmarks.lib.readme import Results  # noqa: E402
from benchmarks.lib.report import RESULTS  # noqa: E402

# name -> script and arguments (`{results}`: the results folder). Sizes are chosen so the whole
# suite fits in an hour or two on 2 cores.
SUITE: dict[str, str] = {
    "throughput": "engine/bench_throughput.py --preset mixed --hf-batch 8",
    "throughput_bf16": "engine/bench_throughput.py --preset chat --num-prompts 16 --dtype bfloat16 "
    "--hf-batch 8 --out {results}/throughput_bf16.json",
    "decode": "engine/bench_decode.py --tokens 128 --reps 3",
    "roofline": "micro/bench_roofline.py",
    "latency": "engine/bench_latency.py --preset chat --num-prompts 16 --concurrency 1 2 4 8 16 32",
    "serving": "serving/load_test.py --launch --preset chat --requests 48 "
    "--concurrency-sweep 1 2 4 8 16 32 --server-args '--max-num-seqs 16' "
    "--out {results}/serving.json",
    "memory": "engine/bench_memory.py --preset mixed --num-prompts 32",
    "ablations": "engine/bench_ablations.py --preset mixed --num-prompts 24",
    "interference": "engine/bench_interference.py",
    "startup": "serving/bench_startup.py",
    "quant": "quality/bench_quant.py",
    "scaling": "engine/bench_scaling.py",
    "decoding": "engine/bench_decoding.py",
    "kv_tiers": "engine/bench_kv_tiers.py",
    "resilience": "serving/bench_resilience.py",
    "family_parity": "quality/family_parity.py",
}


def command(name: str) -> list[str]:
    """The command line of one entry of SUITE."""
    script, *args = shlex.split(SUITE[name].format(results=shlex.quote(str(RESULTS))))
    return [sys.executable, str(HERE / script), *args]


def write_reports(results: Results) -> str:
    """Rewrite results/SUMMARY.md, results/QUANT.md and every results block of the READMEs."""
    table = readme.summary(results)
    (RESULTS / "SUMMARY.md").write_text(table)
    if results("quant"):
        (RESULTS / "QUANT.md").write_text(readme.quant(results).lstrip("\n"))
    for path in readme.write_readmes(results):
        print(f"rewrote the results blocks of {path}")
    return table


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--only", nargs="+", choices=sorted(SUITE), help="run just these entries")
    p.add_argument(
        "--readme",
        "--report",
        action="store_true",
        help="skip the runs; only rebuild the tables and the READMEs' results blocks",
    )
    args = p.parse_args(argv)
    failed = []
    for name in [] if args.readme else (args.only or list(SUITE)):
        cmd = command(name)
        print(f"\n=== {name}: {shlex.join(cmd[1:])}", flush=True)
        start = time.perf_counter()
        rc = subprocess.call(cmd)
        print(f"=== {name}: exit {rc} in {time.perf_counter() - start:.0f} s", flush=True)
        if rc:
            failed.append(name)
    print("\n" + write_reports(readme.loader(RESULTS)))
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
