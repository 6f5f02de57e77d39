"""Loopback load test of `minivllm-serve`, in the spirit of `vllm bench serve`.

Each request is a streaming `/v1/completions` (or chat) call parsed as raw SSE with httpx.
Reports errors, time to first token (TTFT), inter-token latency (gap between content chunks),
time per output token after the first (TPOT) and end-to-end latency (p50/p90/p99), output
token throughput, and goodput (requests/s meeting both `--slo-ttft-ms` and `--slo-tpot-ms`).
Bounded: a fixed request count, a per-request timeout and an overall deadline; refuses
non-loopback URLs.

Workload: by default the fixed text prompts below with `--max-tokens` each (EOS ignored);
with `--preset` (or `--input-len` / `--output-len`) seeded random lengths, prompts sent as
random token-id lists (`--prompt-format ids`, the default) or as their decoded text.
Load shape: `--concurrency C` requests in flight; or `--request-rate R` Poisson arrivals
(seeded; `inf` sends all at once; `--concurrency` then caps requests in flight); or
`--concurrency-sweep 1 2 4 ...`, one run per level (with a PNG of latency vs concurrency).
`--launch` starts `python -m server` itself on a free loopback port, waits for /health 200,
runs, then stops it with SIGTERM, so one command reproduces the serving numbers.

    python -m server --port 8000 &        # or minivllm-serve
    python benchmarks/serving/load_test.py --requests 100 --concurrency 16
    python benchmarks/serving/load_test.py --launch --server-args "--max-num-seqs 32" \\
        --preset chat --concurrency-sweep 1 2 4 8 16 32
    python benchmarks/serving/load_test.py --launch --preset chat --request-rate 4
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402

from benchmarks.lib.report import (  # noqa: E402
    add_options,
    add_slo_args,
    latency_summary,
    ms,
    new_figure,
    plot_levels,
    print_levels,
    save_plot,
    script_parser,
    write_result,
)
from benchmarks.lib.serving import launched_server, one_request  # noqa: E402
from benchmarks.lib.workloads import (  # noqa: E402
    TEXT_PROMPTS,
    add_workload_args,
    local_model_dir,
    make_workload,
    vocab_hi,
)

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
DEFAULT_REQUESTS, DEFAULT_CONCURRENCY = 100, 16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = script_parser(__doc__, "load_test.json", model=None)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (loopback only)")
    p.add_argument(
        "--api-key", default=os.environ.get("MINIVLLM_API_KEY"), help="default: $MINIVLLM_API_KEY"
    )
    p.add_argument(
        "--model", help="default: the first model /v1/models lists (with --launch: smollm2-135m)"
    )
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    add_options(
        p,
        [
            ("--requests", int, f"requests per run (default {DEFAULT_REQUESTS}, or the preset's)"),
            ("--concurrency", int, f"in flight (default {DEFAULT_CONCURRENCY}; a rate's cap)"),
            ("--request-rate", float, "Poisson arrivals at R requests/s (--seed); inf: at once"),
            ("--max-tokens", 64, "output tokens per fixed-prompt request (EOS ignored)"),
            ("--temperature", 0.8, "sampling temperature"),
            ("--warmup-requests", 1, "untimed short requests sent first"),
            ("--request-timeout", 300.0, "seconds per request"),
            ("--deadline", 1800.0, "seconds for each run"),
            ("--launch-timeout", 900.0, "seconds to wait for the launched server"),
        ],
    )
    p.add_argument(
        "--concurrency-sweep",
        type=int,
        nargs="+",
        metavar="C",
        help="one run per concurrency level (e.g. 1 2 4 8 16 32), plus a PNG",
    )
    add_workload_args(p, default_preset=None)
    p.add_argument(
        "--prompt-format",
        choices=["ids", "text"],
        default="ids",
        help="random prompts as token-id lists or decoded text (chat always uses text)",
    )
    add_slo_args(p)
    p.add_argument("--launch", action="store_true", help="start `python -m server` for the run")
    p.add_argument("--server-args", default="", help='flags for --launch: "--max-num-seqs 32"')
    p.add_argument(
        "--quick", action="store_true", help="smoke test: tiny preset, 8 requests, concurrency 4"
    )
    args = p.parse_args(argv)
    if urlparse(args.url).hostname not in LOOPBACK:
        p.error(f"--url must be a loopback address ({', '.join(sorted(LOOPBACK))}); got {args.url}")
    if args.quick:
        args.preset = args.preset or "tiny"
        args.concurrency = args.concurrency or (None if args.request_rate else 4)
    args.random = (
        args.preset is not None or args.input_len is not None or args.output_len is not None
    )
    if args.random:
        args.preset = args.preset or "chat"
    if args.request_rate is not None and args.concurrency_sweep:
        p.error("use either --request-rate or --concurrency-sweep")
    if args.request_rate is not None and not args.request_rate > 0:
        p.error("--request-rate must be > 0 (or inf)")
    levels = [args.concurrency or 1] + (args.concurrency_sweep or [])
    if args.max_tokens < 1 or (args.requests is not None and args.requests < 1) or min(levels) < 1:
        p.error("--requests, --concurrency, --concurrency-sweep and --max-tokens must be >= 1")
    if args.request_rate is None and args.concurrency is None:
        args.concurrency = DEFAULT_CONCURRENCY
    if args.launch and args.model is None:
        args.model = "smollm2-135m"
    return args


# ------------------------------------------------------------------ requests


def build_requests(args: argparse.Namespace) -> tuple[list[dict], dict[str, Any]]:
    """Request bodies (without `model`) and a description of the workload."""
    base = {
        "temperature": args.temperature,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if not args.random:
        n = args.requests or DEFAULT_REQUESTS
        texts = [TEXT_PROMPTS[i % len(TEXT_PROMPTS)] for i in range(n)]
        bodies = [
            _with_prompt(args, {**base, "max_tokens": args.max_tokens, "seed": i}, t)
            for i, t in enumerate(texts)
        ]
        return bodies, {"kind": "fixed prompts", "num_prompts": n, "max_tokens": args.max_tokens}
    args.num_prompts = args.requests or args.num_prompts
    if args.model is None or local_model_dir(args.model) is None:
        print("note: model not found locally; random token ids drawn below 10000", file=sys.stderr)
    work = make_workload(args, vocab_hi=vocab_hi(args.model) if args.model else 10_000)
    fmt = "text" if args.endpoint == "chat" else args.prompt_format
    prompts: list[Any] = work.prompts
    if fmt == "text":
        from transformers import AutoTokenizer

        folder = local_model_dir(args.model) if args.model else None
        if folder is None:
            raise SystemExit(
                "text prompts need the model's tokenizer on this machine (pass --model)"
            )
        tok = AutoTokenizer.from_pretrained(str(folder))
        prompts = [tok.decode(p) for p in work.prompts]
    bodies = [
        _with_prompt(args, {**base, "max_tokens": o, "seed": i}, p)
        for i, (p, o) in enumerate(zip(prompts, work.output_lens))
    ]
    return bodies, {"kind": "random", "prompt_format": fmt, **work.describe()}


def _with_prompt(args: argparse.Namespace, body: dict, prompt: str | list[int]) -> dict:
    if args.endpoint == "chat":
        return {**body, "messages": [{"role": "user", "content": prompt}]}
    return {**body, "prompt": prompt}


def arrival_offsets(n: int, rate: float | None, seed: int) -> list[float]:
    """Send times (s after the start): Poisson arrivals at `rate`/s, first at 0; all 0 for
    None or inf (the concurrency limit alone shapes the load)."""
    if rate is None or math.isinf(rate):
        return [0.0] * n
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n)
    return [0.0] + np.cumsum(gaps[:-1]).tolist()


async def run_level(
    client: Any, args: argparse.Namespace, bodies: list[dict], concurrency: int | None
) -> dict:
    """One timed run: all `bodies` at the given concurrency limit and --request-rate."""
    gate = asyncio.Semaphore(concurrency) if concurrency else contextlib.nullcontext()
    offsets = arrival_offsets(len(bodies), args.request_rate, args.seed)
    start = time.perf_counter()

    async def send(i: int) -> dict:
        await asyncio.sleep(max(0.0, start + offsets[i] - time.perf_counter()))
        async with gate:
            return await one_request(client, args, bodies[i])

    results = await asyncio.wait_for(
        asyncio.gather(*(send(i) for i in range(len(bodies)))), args.deadline
    )
    wall = time.perf_counter() - start
    ok = [r for r in results if "error" not in r]
    errors = [r["error"] for r in results if "error" in r]
    return {
        "url": args.url,
        "model": args.model,
        "endpoint": args.endpoint,
        "requests": len(bodies),
        "concurrency": concurrency,
        "request_rate": args.request_rate,
        "max_tokens": args.max_tokens if not args.random else None,
        "errors": len(errors),
        "error_samples": errors[:5],
        **latency_summary(ok, wall, args.slo_ttft_ms, args.slo_tpot_ms),
        "samples": {
            "ttft_s": [r["ttft"] for r in ok],
            "tpot_s": [r["tpot"] for r in ok if r["tpot"] is not None],
        },
    }


async def run(args: argparse.Namespace) -> dict:
    """Warm up, then one run (or one per --concurrency-sweep level); returns the report."""
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    levels = args.concurrency_sweep or [args.concurrency]
    width = max(c or 0 for c in levels) or 1000  # connections: a rate without a cap may open many
    limits = httpx.Limits(max_connections=width, max_keepalive_connections=width)
    async with httpx.AsyncClient(
        base_url=args.url, headers=headers, limits=limits, timeout=30.0
    ) as client:
        if args.model is None:
            models = (await client.get("/v1/models")).raise_for_status().json()
            args.model = models["data"][0]["id"]
        bodies, workload = build_requests(args)
        for body in bodies[: args.warmup_requests]:
            warm = await one_request(client, args, {**body, "max_tokens": 4})
            if "error" in warm:
                raise SystemExit(f"warm-up request failed: {warm['error']}")
        runs = []
        for c in levels:
            runs.append(await run_level(client, args, bodies, c))
            _print_run(runs[-1])
    if not args.concurrency_sweep:
        return {**runs[0], "workload": workload}
    return {
        "mode": "concurrency-sweep",
        "url": args.url,
        "model": args.model,
        "endpoint": args.endpoint,
        "workload": workload,
        "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms},
        "concurrency": levels,
        "errors": sum(r["errors"] for r in runs),
        "levels": runs,
    }


# ------------------------------------------------------------------ report


def _print_run(r: dict) -> None:
    load = (
        f"concurrency {r['concurrency']}"
        if r["request_rate"] is None
        else f"rate {r['request_rate']}/s"
    )
    tps = r["output_tokens_per_s"] or 0.0
    print(
        f"{r['requests']} requests at {load}: {r['completed']} ok, {r['errors']} errors, {r['wall_s']:.1f} s, "
        f"{tps:.1f} output tok/s, goodput {r['goodput']['requests_per_s'] or 0:.2f} req/s"
    )
    for name in ("ttft_s", "itl_s", "tpot_s", "e2e_s"):
        s = r[name]
        print(
            f"  {name[:-2]:5s} p50 {ms(s['p50'], unit=' ms'):>9s}  p90 {ms(s['p90'], unit=' ms'):>9s}  p99 {ms(s['p99'], unit=' ms'):>9s}"
        )
    for e in r["error_samples"]:
        print(f"  error: {e}", file=sys.stderr)


def plot_run(report: dict, out: str) -> Path:
    """CDFs of per-request TTFT and TPOT for a single run."""
    fig, axes = new_figure(2, width=4.5)
    for ax, name in zip(axes[0], ["TTFT", "TPOT"]):
        xs = sorted(v * 1000 for v in report["samples"][f"{name.lower()}_s"])
        ax.plot(xs, np.arange(1, len(xs) + 1) / max(1, len(xs)), drawstyle="steps-post")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    rate = report["request_rate"]
    load = f"concurrency {report['concurrency']}" if rate is None else f"{rate} req/s"
    fig.suptitle(f"HTTP serving: {report['model']}, {report['requests']} requests at {load}")
    return save_plot(fig, out)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with contextlib.ExitStack() as stack:
        if args.launch:
            server = launched_server(
                args.model, args.server_args, args.launch_timeout, args.api_key
            )
            args.url, _ = stack.enter_context(server)
        report = asyncio.run(run(args))
    write_result(report, args.out)
    if args.concurrency_sweep:
        print_levels({"server": report["levels"]})
        w = report["workload"]
        title = f"HTTP serving: {report['model']}, {w['num_prompts']} requests per level"
        plot_levels([("server", report["levels"])], title, args.out)
    elif report["completed"]:
        plot_run(report, args.out)
    return 0 if report["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
