"""Run every benchmark with the settings the README quotes, then rebuild the results table.

    python benchmarks/run_all.py            # the full suite (about 80 minutes on 2 cores, 20-25 of them bench_quant)
    python benchmarks/run_all.py --only throughput decode
    python benchmarks/run_all.py --report   # only rebuild the tables from the JSON results

The table goes to benchmarks/results/SUMMARY.md and between the markers in benchmarks/README.md;
bench_quant.py's table to results/QUANT.md and between the quant markers of both READMEs.

Each entry is one script run (ours and the PyTorch peer in the same process where the script
compares them), so each number in the table can be reproduced by the command printed beside
it. Runs are sequential: on a small CPU, anything running beside a benchmark is noise.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
MARK_START, MARK_END = "<!-- results:start -->", "<!-- results:end -->"
QUANT_START, QUANT_END = "<!-- quant:start -->", "<!-- quant:end -->"  # bench_quant.py's table

# name -> script arguments. Sizes are chosen so the whole suite fits in about 70 minutes here.
SUITE: dict[str, list[str]] = {
    "throughput": ["bench_throughput.py", "--preset", "mixed", "--hf-batch", "8"],
    "throughput_bf16": [
        "bench_throughput.py",
        "--preset",
        "chat",
        "--num-prompts",
        "16",
        "--dtype",
        "bfloat16",
        "--hf-batch",
        "8",
        "--out",
        str(RESULTS / "throughput_bf16.json"),
    ],
    "decode": ["bench_decode.py", "--tokens", "128", "--reps", "3"],
    "roofline": ["bench_roofline.py"],
    "latency": [
        "bench_latency.py",
        "--preset",
        "chat",
        "--num-prompts",
        "16",
        "--concurrency",
        "1",
        "2",
        "4",
        "8",
        "16",
        "32",
    ],
    "serving": [
        "load_test.py",
        "--launch",
        "--preset",
        "chat",
        "--requests",
        "48",
        "--concurrency-sweep",
        "1",
        "2",
        "4",
        "8",
        "16",
        "32",
        "--server-args",
        "--max-num-seqs 16",
        "--out",
        str(RESULTS / "serving.json"),
    ],
    "memory": ["bench_memory.py", "--preset", "mixed", "--num-prompts", "32"],
    "ablations": ["bench_ablations.py", "--preset", "mixed", "--num-prompts", "24"],
    "interference": ["bench_interference.py"],
    "startup": ["bench_startup.py"],
    "quant": ["bench_quant.py"],
    "scaling": ["bench_scaling.py"],
    "decoding": ["bench_decoding.py"],
    "kv_tiers": ["bench_kv_tiers.py"],
    "resilience": ["bench_resilience.py"],
    "family_parity": ["family_parity.py"],
}


def _load(name: str) -> dict | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _fmt(x, digits: int = 1) -> str:
    return "n/a" if x is None else f"{x:,.{digits}f}"


def _peer_cells(result: dict, ours: float | None, value) -> tuple[str, str]:
    """The llama.cpp column ("F32 / Q4_1" values) and ours / llama.cpp F32, from `result["llamacpp"]`
    with `value(side)` picking the number; blank where the run had no llama.cpp peer."""
    peer = result.get("llamacpp") or {}
    if not peer:
        return "", ""
    f32, q4 = (value(peer[v]) if v in peer else None for v in ("f32", "q4_1"))
    ratio = f"{ours / f32:.2f}x" if ours and f32 else ""
    return f"{_fmt(f32)} / {_fmt(q4)}", ratio


def summary() -> str:
    """The main table (ours vs PyTorch, and llama.cpp when its results exist) from whatever
    results exist; missing ones say n/a."""
    rows: list[tuple[str, ...]] = []
    tp = _load("throughput") or {}
    ours, hf = tp.get("ours", {}), tp.get("hf", {})
    rows.append(
        (
            "offline throughput, output tok/s (mixed, fp32)",
            _fmt(ours.get("output_tok_s")),
            _fmt(hf.get("output_tok_s")),
            _fmt(tp.get("speedup"), 2) + "x",
            *_peer_cells(tp, ours.get("output_tok_s"), lambda c: c.get("output_tok_s")),
        )
    )
    rows.append(
        (
            "offline throughput, total tok/s",
            _fmt(ours.get("total_tok_s")),
            _fmt(hf.get("total_tok_s")),
            "",
            *_peer_cells(tp, ours.get("total_tok_s"), lambda c: c.get("total_tok_s")),
        )
    )
    bf = _load("throughput_bf16") or {}
    rows.append(
        (
            "offline throughput, output tok/s (chat, bf16)",
            _fmt(bf.get("ours", {}).get("output_tok_s")),
            _fmt(bf.get("hf", {}).get("output_tok_s")),
            _fmt(bf.get("speedup"), 2) + "x",
        )
    )
    dec = _load("decode") or {}
    ours_dec = dec.get("ours", {}).get("decode_tok_s")
    rows.append(
        (
            "batch-1 greedy decode, tok/s",
            _fmt(ours_dec),
            _fmt(dec.get("hf", {}).get("decode_tok_s")),
            _fmt(dec.get("speedup"), 2) + "x",
            *_peer_cells(dec, ours_dec, lambda c: c.get("decode_tok_s")),
        )
    )
    lat = _load("latency") or {}
    ms = lambda d, k: None if d is None or d.get(k) is None else 1e3 * d[k]  # noqa: E731

    def ttft8(side: dict | None) -> str:
        t = next(
            (lv["ttft_s"] for lv in (side or {}).get("levels", []) if lv["concurrency"] == 8), None
        )
        return f"{_fmt(ms(t, 'p50'), 0)} / {_fmt(ms(t, 'p99'), 0)}"

    peer8 = "; ".join(
        f"{v.upper()}: {ttft8(side)}" for v, side in sorted((lat.get("llamacpp") or {}).items())
    )
    rows.append(
        (
            "TTFT p50 / p99 at concurrency 8, ms (chat)",
            ttft8(lat.get("ours")),
            ttft8(lat.get("hf")),
            "",
            peer8,
            "",
        )
    )
    mem = _load("memory") or {}
    gib = lambda b: None if b is None else b / 2**30  # noqa: E731
    rows.append(
        (
            "params + KV pool, GiB",
            _fmt(gib((mem.get("params") or {}).get("bytes")), 2)
            + " + "
            + _fmt(gib((mem.get("kv_pool") or {}).get("bytes")), 2),
            "",
            "",
        )
    )
    rows.append(
        (
            "peak host RSS, GiB",
            _fmt(gib((mem.get("host_rss") or {}).get("peak_rss_bytes")), 2),
            _fmt(gib((mem.get("hf") or {}).get("peak_rss_bytes")), 2),
            "",
        )
    )
    roof = _load("roofline") or {}
    point = (roof.get("points") or {}).get("decode b=1 (LLM engine)") or {}
    frac = point.get("fraction_of_bound")
    rows.append(
        (
            "batch-1 engine decode, share of the bandwidth bound",
            _fmt(None if frac is None else 100 * frac, 0) + "%",
            "",
            "",
        )
    )
    inter = _load("interference") or {}
    med = inter.get("median") or {}
    ratio = med.get("ratio_worst_gap_to_itl_p50")
    gap = "n/a" if not med else f"{_fmt(ms(med, 'worst_gap_s'), 0)} ({_fmt(ratio)}x ITL p50)"
    rows.append(
        (
            "worst stream gap while a 1,500-token prompt prefills, ms (target <= 2x ITL p50)",
            gap,
            "",
            "",
        )
    )
    start = _load("startup") or {}
    rows.append(
        (
            "server start-up to /health 200, cold / warm caches, s (targets <= 60 / 15)",
            f"{_fmt(start.get('cold_s'))} / {_fmt(start.get('warm_s'))}",
            "",
            "",
        )
    )
    dcd = _load("decoding") or {}
    beam = (dcd.get("beam_search") or {}).get("batch_1") or {}
    rows.append(
        (
            "beam search (k = 4), batch 1, tok/s",
            _fmt(beam.get("ours_tok_s")),
            _fmt(beam.get("hf_tok_s")),
            _fmt(beam["ours_tok_s"] / beam["hf_tok_s"], 2) + "x" if beam else "n/a",
        )
    )
    spec = (dcd.get("speculative") or {}).get("grounded_batch_1") or {}
    rows.append(
        (
            "n-gram speculation, batch-1 decode, input-grounded, tok/s with / without",
            f"{_fmt(spec.get('ngram', {}).get('decode_tok_s'))} / {_fmt(spec.get('off', {}).get('decode_tok_s'))}",
            "",
            _fmt(spec.get("decode_speedup"), 2) + "x",
        )
    )
    kv = _load("kv_tiers") or {}
    modes = {r["mode"]: r["elapsed_s"] for r in (kv.get("preemption") or {}).get("rows", [])}
    rows.append(
        (
            "preemption-heavy workload, completion s: recompute / swap / auto",
            " / ".join(_fmt(modes.get(m)) for m in ("recompute", "swap", "auto")),
            "",
            _fmt(modes["recompute"] / modes["swap"], 2) + "x" if modes else "n/a",
        )
    )
    tiers = {r["tier"]: r["ttft_s"]["p50"] for r in (kv.get("restart") or {}).get("rows", [])}
    rows.append(
        (
            "TTFT p50 of the first requests after a server restart, ms: disk tier / none",
            f"{_fmt(ms(tiers, 'disk'), 0)} / {_fmt(ms(tiers, 'none'), 0)}",
            "",
            _fmt(tiers["none"] / tiers["disk"], 2) + "x" if len(tiers) == 2 else "n/a",
        )
    )
    res = _load("resilience") or {}
    rows += _resilience_rows(res)
    header = ["metric", "minivllm-jax (XLA)", "HF transformers (PyTorch)", "ratio"]
    if any(r[4:] != ("", "") for r in rows if len(r) > 4):
        header += ["llama.cpp F32 / Q4_1 GGUF", "ours / llama.cpp F32"]
    rows = [(*r, "", "")[: len(header)] for r in rows]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    machine = tp.get("machine") or dec.get("machine") or {}
    stamps = sorted(
        r["timestamp"]
        for r in (tp, bf, dec, lat, mem, roof, inter, start, dcd, kv, res)
        if r.get("timestamp")
    )
    when = (
        "not run yet"
        if not stamps
        else stamps[0]
        if stamps[0] == stamps[-1]
        else (
            f"from {stamps[0]} to {stamps[-1]} (rows rerun with `--only` keep their own timestamps)"
        )
    )
    lines.append(
        f"\nMeasured {when} on {machine.get('cpu', '?')}, {machine.get('cpu_count', '?')} cores, "
        f"{machine.get('mem_gib', '?')} GiB (`python benchmarks/run_all.py`)."
    )
    return "\n".join(lines) + "\n"


def _resilience_rows(res: dict) -> list[tuple[str, ...]]:
    """bench_resilience.py: good-traffic goodput alone and beside the worst abuse, good requests
    lost, and /health's worst latency while tool bombs arrive."""
    phases = {p["phase"]: p for p in res.get("phases", [])}

    def pct(phase: dict) -> str:
        goodput = phase["good"]["goodput"]
        return f"{_fmt(None if goodput is None else 100 * goodput, 0)}% ({phase['phase']})"

    abused = [p for name, p in phases.items() if name != "alone"]
    worst = min(abused, key=lambda p: p["good"]["goodput"] or 0) if abused else None
    goodput = (
        "n/a"
        if not phases
        else (
            f"{pct(phases['alone']) if 'alone' in phases else 'n/a'} / "
            f"{pct(worst) if worst else 'n/a'}; {res.get('lost_good_requests')} lost"
        )
    )
    health = res.get("health_worst_s_during_tool_bombs")
    return [
        (
            "good-traffic goodput at concurrency 16 (TTFT <= 2 s, TPOT <= 100 ms): alone / worst beside abuse; "
            "good requests lost",
            goodput,
            "",
            "",
        ),
        (
            "/health worst latency while 800 KB tool-bomb requests arrive, ms",
            _fmt(None if health is None else 1e3 * health, 0),
            "",
            "",
        ),
    ]


def _write_between(path: Path, start: str, end: str, table: str) -> None:
    """Replace what lies between the markers `start` and `end` in `path` (if it has them) by `table`."""
    if path.exists() and start in (text := path.read_text()):
        head, rest = text.split(start, 1)
        path.write_text(head + start + "\n" + table + end + rest.split(end, 1)[1])


def quant_report(readmes: list[Path]) -> str | None:
    """bench_quant.py's table from results/quant.json, written to results/QUANT.md and between
    the quant markers of each of `readmes`; None when there are no results yet."""
    quant = _load("quant")
    if quant is None:
        return None
    sys.path.insert(0, str(HERE.parent))
    from benchmarks.bench_quant import markdown_table

    table = markdown_table(quant)
    (RESULTS / "QUANT.md").write_text(table)
    for readme in readmes:
        _write_between(readme, QUANT_START, QUANT_END, table)
    return table


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--only", nargs="+", choices=sorted(SUITE), help="run just these entries")
    p.add_argument("--report", action="store_true", help="skip the runs; rebuild the summary only")
    args = p.parse_args(argv)
    failed = []
    for name in [] if args.report else (args.only or list(SUITE)):
        cmd = [sys.executable, str(HERE / SUITE[name][0]), *SUITE[name][1:]]
        print(f"\n=== {name}: {shlex.join(cmd[1:])}", flush=True)
        start = time.perf_counter()
        rc = subprocess.call(cmd)
        print(f"=== {name}: exit {rc} in {time.perf_counter() - start:.0f} s", flush=True)
        if rc:
            failed.append(name)
    table = summary()
    (RESULTS / "SUMMARY.md").write_text(table)
    _write_between(HERE / "README.md", MARK_START, MARK_END, table)
    qtable = quant_report([HERE / "README.md", HERE.parent / "README.md"])
    if qtable is not None:
        print("\n" + qtable)
    print("\n" + table)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
