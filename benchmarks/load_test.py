"""Loopback load test of a running `minivllm-serve`: N streaming requests at concurrency C.

Each request is a streaming `/v1/completions` (or chat) call parsed as raw SSE with httpx.
Reports errors, time to first token (TTFT), inter-token latency (gap between content chunks),
time per output token after the first (TPOT) and end-to-end latency (p50/p90/p99), plus output
token throughput; writes JSON under benchmarks/results/. Bounded: a fixed request count, a
per-request timeout and an overall deadline; refuses non-loopback URLs.

    python -m server --port 8000 &        # or minivllm-serve
    python benchmarks/load_test.py --requests 100 --concurrency 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

RESULTS = Path(__file__).parent / "results"
LOOPBACK = {"127.0.0.1", "localhost", "::1"}
PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived",
    "List three colors of the rainbow:",
    "Q: What is 2 + 2?\nA:",
    "The quick brown fox",
    "Explain what a paged KV cache is in one sentence.",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (loopback only)")
    p.add_argument("--api-key", default=os.environ.get("MINIVLLM_API_KEY"), help="default: $MINIVLLM_API_KEY")
    p.add_argument("--model", default=None, help="default: the first model /v1/models lists")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--requests", type=int, default=100)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (EOS ignored)")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request")
    p.add_argument("--deadline", type=float, default=1800.0, help="seconds for the whole run")
    p.add_argument("--out", default=str(RESULTS / "load_test.json"))
    args = p.parse_args(argv)
    if urlparse(args.url).hostname not in LOOPBACK:
        p.error(f"--url must be a loopback address ({', '.join(sorted(LOOPBACK))}); got {args.url}")
    if args.requests < 1 or args.concurrency < 1 or args.max_tokens < 1:
        p.error("--requests, --concurrency and --max-tokens must be >= 1")
    return args


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (None for no data)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def summarize(values: list[float]) -> dict[str, float | None]:
    return {
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "mean": statistics.fmean(values) if values else None,
    }


async def one_request(client, args: argparse.Namespace, i: int) -> dict:
    """Stream one request; returns its timings or its error."""
    prompt = PROMPTS[i % len(PROMPTS)]
    body: dict = {"model": args.model, "max_tokens": args.max_tokens, "temperature": args.temperature,
                  "seed": i, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    if args.endpoint == "chat":
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt}]
    else:
        path, body["prompt"] = "/v1/completions", prompt
    start = time.perf_counter()
    chunk_times: list[float] = []
    tokens, done = None, False
    try:
        async with client.stream("POST", path, json=body, timeout=args.request_timeout) as r:
            if r.status_code != 200:
                return {"error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    return {"error": f"stream error: {chunk['error']}"}
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                for c in chunk["choices"]:
                    if c.get("text") or (c.get("delta") or {}).get("content"):
                        chunk_times.append(time.perf_counter())
    except Exception as e:  # connection errors, timeouts
        return {"error": f"{type(e).__name__}: {e}"}
    end = time.perf_counter()
    if not done or not chunk_times or tokens is None:
        return {"error": "stream ended without content, usage or [DONE]"}
    return {
        "ttft": chunk_times[0] - start,
        "itl": [b - a for a, b in zip(chunk_times, chunk_times[1:])],
        "tpot": (chunk_times[-1] - chunk_times[0]) / (tokens - 1) if tokens > 1 else None,
        "e2e": end - start,
        "tokens": tokens,
    }


async def run(args: argparse.Namespace) -> dict:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    async with httpx.AsyncClient(base_url=args.url, headers=headers, limits=limits, timeout=30.0) as client:
        if args.model is None:
            models = (await client.get("/v1/models")).raise_for_status().json()
            args.model = models["data"][0]["id"]
        gate = asyncio.Semaphore(args.concurrency)

        async def limited(i: int) -> dict:
            async with gate:
                return await one_request(client, args, i)

        start = time.perf_counter()
        results = await asyncio.wait_for(asyncio.gather(*(limited(i) for i in range(args.requests))), args.deadline)
        wall = time.perf_counter() - start
    ok = [r for r in results if "error" not in r]
    errors = [r["error"] for r in results if "error" in r]
    tokens = sum(r["tokens"] for r in ok)
    return {
        "url": args.url,
        "model": args.model,
        "endpoint": args.endpoint,
        "requests": args.requests,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "completed": len(ok),
        "errors": len(errors),
        "error_samples": errors[:5],
        "wall_s": wall,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / wall if wall > 0 else None,
        "ttft_s": summarize([r["ttft"] for r in ok]),
        "itl_s": summarize([x for r in ok for x in r["itl"]]),
        "tpot_s": summarize([r["tpot"] for r in ok if r["tpot"] is not None]),
        "e2e_s": summarize([r["e2e"] for r in ok]),
    }


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f} ms"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = asyncio.run(run(args))
    report["timestamp"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(
        f"{report['requests']} requests at concurrency {report['concurrency']}: {report['completed']} ok, "
        f"{report['errors']} errors, {report['wall_s']:.1f} s, {report['output_tokens_per_s']:.1f} output tok/s"
    )
    for name in ("ttft_s", "itl_s", "tpot_s", "e2e_s"):
        s = report[name]
        print(f"  {name[:-2]:5s} p50 {_ms(s['p50']):>9s}  p90 {_ms(s['p90']):>9s}  p99 {_ms(s['p99']):>9s}")
    for e in report["error_samples"]:
        print(f"  error: {e}", file=sys.stderr)
    print(f"wrote {out}")
    return 0 if report["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
