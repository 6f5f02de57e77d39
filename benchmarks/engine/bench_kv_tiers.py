"""The KV memory hierarchy, three measurements in one run (JSON + PNG):

1. Preemption: a preemption-heavy offline workload (num_pages forced small) run with
   `preemption_mode` recompute, swap and auto: completion time, preemptions, swaps, the prompt
   tokens computed (recomputation included), and whether the tokens are identical.
2. Restart: a shared-system-prompt workload across a server restart. "Yesterday" a server
   answers a few requests and is stopped cleanly (SIGTERM); "today" a new server on the same
   `--kv-disk-dir` gets concurrent first requests. TTFT p50 of those, with the disk tier and
   without it (the same two days, no `--kv-disk-dir`).
3. Compression: perplexity and greedy agreement with full attention over a long fixed text
   (>= 4k tokens, teacher-forced: `benchmarks/quality/kv_compression_quality.py`) per policy and kept
   fraction, and the KV memory per sequence.

    python benchmarks/engine/bench_kv_tiers.py                # SmolLM2, about 12 minutes
    python benchmarks/engine/bench_kv_tiers.py --quick        # smaller everything: a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.lib.harness import build_llm, greedy_params, load_model, run_requests  # noqa: E402
from benchmarks.lib.report import (  # noqa: E402
    add_options,
    new_figure,
    percentiles,
    save_plot,
    script_parser,
    write_result,
)
from benchmarks.lib.serving import launched_server, metric, one_request  # noqa: E402
from benchmarks.lib.workloads import random_prompts, text_ids, tokenizer, vocab_hi  # noqa: E402
from benchmarks.quality.kv_compression_quality import evaluate  # noqa: E402

MODES = ("recompute", "swap", "auto")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = script_parser(__doc__, "kv_tiers.json")
    p.add_argument("--quick", action="store_true", help="a smoke run: small workloads, short text")
    p.add_argument("--only", nargs="+", choices=["preemption", "restart", "compression"])
    # Long outputs: sequences are preempted deep into their decode, when recomputing costs most.
    add_options(
        p,
        [
            ("--requests", 12, "preemption: requests (all at once)"),
            ("--prompt-len", 128, "preemption: prompt tokens"),
            ("--output-len", 640, "preemption: output tokens"),
            ("--pressure-seqs", 3.0, "preemption: num_pages holds this many full-length sequences"),
            ("--system-tokens", 1024, "restart: shared system prompt length"),
            ("--first-requests", 8, "restart: concurrent first requests after it"),
            ("--text-tokens", 4096, "compression: tokens of the long text scored"),
        ],
    )
    args = p.parse_args(argv)
    if args.quick:
        args.requests, args.prompt_len, args.output_len, args.pressure_seqs = 6, 64, 128, 2
        args.system_tokens, args.first_requests, args.text_tokens = 256, 4, 1024
    return args


# ---------------------------------------------------------------- 1. preemption


def preemption(args: argparse.Namespace) -> dict[str, Any]:
    from minivllm_jax.engine.engine import LLMEngine

    full_len = args.prompt_len + args.output_len
    page_size = 16
    pages = 1 + int(args.pressure_seqs * -(-full_len // page_size))
    llm = build_llm(args.model, max_num_seqs=args.requests, max_model_len=full_len, num_pages=pages)
    prompts = random_prompts([args.prompt_len] * args.requests, 0, vocab_hi(args.model))
    params = greedy_params([args.output_len] * args.requests)
    base, rows, tokens = llm.engine, [], None
    for mode in MODES:
        config = base.config.replace(preemption_mode=mode)
        engine = LLMEngine(
            base.model_config,
            config,
            base.params,
            llm.tokenizer,
            eos_token_ids=base.eos_token_ids,
        )
        engine.warmup(progress=False)
        run = run_requests(engine, prompts, params)
        tokens = tokens or run.token_ids
        stats = engine.stats()
        pool = mode != "recompute"  # the engine keeps a swap pool for the other modes
        rows.append(
            {
                "mode": mode,
                "elapsed_s": run.elapsed_s,
                "output_tok_s": run.output_tokens / run.elapsed_s,
                "preemptions": stats.preemptions,
                "swap_outs": stats.swap_outs,
                "swap_ins": stats.swap_ins,
                "recomputes": stats.swap_recomputes if pool else None,
                "prompt_tokens_computed": stats.prompt_tokens,
                "swap_copy_gb_s": stats.swap_bytes_per_second / 1e9 if pool else None,
                "tokens_identical_to_recompute": run.token_ids == tokens,
            }
        )
        print(
            f"preemption {mode:>9}: {run.elapsed_s:6.1f} s, {rows[-1]['preemptions']} preemptions, "
            f"{rows[-1]['swap_outs']} swaps, {engine.stats().prompt_tokens} prompt tokens computed",
            flush=True,
        )
        del engine
    return {
        "requests": args.requests,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "num_pages": pages,
        "bytes_per_page": _page_bytes(base),
        "rows": rows,
    }


def _page_bytes(engine) -> int:
    from minivllm_jax.models.params import model_dtype
    from minivllm_jax.ops.kv_cache import kv_bytes_per_page

    c = engine.config
    return kv_bytes_per_page(
        engine.model_config, c.cache.page_size, model_dtype(engine.params), c.cache.kv_cache_dtype
    )


# ---------------------------------------------------------------- 2. restart


def _system_prompt(model: str, tokens: int) -> str:
    """The first `tokens` tokens of the long fixed text, as text: the shared system prompt."""
    tok = tokenizer(model)
    return tok.decode(text_ids(tok)[0][:tokens])


async def _first_requests(
    url: str, args: argparse.Namespace, system: str, n: int, offset: int
) -> list[dict]:
    import httpx

    req = argparse.Namespace(endpoint="chat", model=args.model, request_timeout=600)
    bodies = [
        {
            "messages": [
                {"role": "system", "content": system},
                {
                    "role": "user",
                    "content": f"Question {offset + i}: what does section {offset + i} say?",
                },
            ],
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        for i in range(n)
    ]
    async with httpx.AsyncClient(base_url=url) as client:
        return await asyncio.gather(*(one_request(client, req, b) for b in bodies))


def restart(args: argparse.Namespace) -> dict[str, Any]:
    system = _system_prompt(args.model, args.system_tokens)
    rows = []
    for tier in ("disk", "none"):
        with tempfile.TemporaryDirectory(prefix="minivllm-kv-disk-") as folder:
            flags = "--max-num-seqs 16 --max-model-len 2048" + (
                f" --kv-disk-dir {folder}" if tier == "disk" else ""
            )
            with launched_server(args.model, flags, 900) as (url, _):  # a few requests, SIGTERM
                yesterday = asyncio.run(_first_requests(url, args, system, 2, 0))
            start = time.perf_counter()
            with launched_server(args.model, flags, 900) as (url, _):
                ready_s = time.perf_counter() - start
                today = asyncio.run(_first_requests(url, args, system, args.first_requests, 100))
                hits = metric(url, 'minivllm_prefix_cache_hit_tokens_total{tier="disk"}') or 0.0
            files = len(list(Path(folder).rglob("*.kvpage")))
        errors = [r["error"] for r in yesterday + today if "error" in r]
        if errors:
            raise SystemExit(f"restart ({tier}): {errors[:3]}")
        ttft = [r["ttft"] for r in today]
        rows.append(
            {
                "tier": tier,
                "ttft_s": percentiles(ttft),
                "ttfts_s": ttft,
                "disk_hit_tokens": hits,
                "page_files_after": files,
                "server_ready_s": ready_s,
            }
        )
        print(
            f"restart {tier:>4}: first {len(ttft)} requests TTFT p50 {rows[-1]['ttft_s']['p50'] * 1000:.0f} ms, "
            f"{hits:.0f} prompt tokens from disk",
            flush=True,
        )
    return {
        "system_tokens": args.system_tokens,
        "first_requests": args.first_requests,
        "rows": rows,
    }


# ---------------------------------------------------------------- 3. compression


def compression(args: argparse.Namespace) -> dict[str, Any]:
    from minivllm_jax import kernels
    from minivllm_jax.config import KVCompressionConfig

    cfg, params = load_model(args.model)
    ids, sources = text_ids(tokenizer(args.model))
    ids = ids[: args.text_tokens + 1]
    if len(ids) < args.text_tokens + 1:
        raise SystemExit(
            f"the text has {len(ids)} tokens, fewer than --text-tokens {args.text_tokens} + 1"
        )
    native = "native" if kernels.native_available() else "reference"
    common = dict(page_size=16, chunk=16, attention=native, matmul=native)
    full = evaluate(params, cfg, ids, None, **common)
    rows = [{**full, "policy": "full"}]
    budgets = [n for n in (256, 512, 1024) if n < args.text_tokens // 2]
    configs = [
        KVCompressionConfig("sink_window", sink_tokens=16, window_tokens=b - 16) for b in budgets
    ]
    configs += [
        KVCompressionConfig("page_scores", sink_tokens=16, window_tokens=b // 4, budget_tokens=b)
        for b in budgets
    ]
    for config in configs:
        rows.append(evaluate(params, cfg, ids, config, reference_argmax=full["argmax"], **common))
        r = rows[-1]
        print(
            f"compression {config.policy:>11} keep {r['final_kept_tokens']:5d}: ppl {r['perplexity']:.3f} "
            f"(full {full['perplexity']:.3f}), agreement {r['greedy_agreement']:.3f}, "
            f"kept fraction {r['kept_fraction']:.3f}, {r['bytes_per_seq'] / 2**20:.1f} MiB/seq",
            flush=True,
        )
    for r in rows:
        r.pop("argmax", None)
    return {"tokens": len(ids), "text": sources, "rows": rows}


# ---------------------------------------------------------------- report


def plot(result: dict[str, Any], out: str) -> Path:
    fig, axes = new_figure(3, width=5.0, height=4.2)
    axes = axes[0]
    if "preemption" in result:
        rows = result["preemption"]["rows"]
        colors = ["#999", "#4a90d9", "#e8a33d"]
        axes[0].bar([r["mode"] for r in rows], [r["elapsed_s"] for r in rows], color=colors)
        title = f"preemption-heavy workload ({result['preemption']['requests']} requests)"
        axes[0].set(ylabel="completion time (s)", title=title)
    if "restart" in result:
        rows = result["restart"]["rows"]
        ttft_ms = [r["ttft_s"]["p50"] * 1000 for r in rows]
        axes[1].bar([r["tier"] for r in rows], ttft_ms, color=["#4a90d9", "#999"])
        axes[1].set(ylabel="TTFT p50 of the first requests (ms)")
        axes[1].set(title="after a server restart: disk tier vs none")
    if "compression" in result:
        comp = result["compression"]
        for policy, marker in (("sink_window", "o"), ("page_scores", "s")):
            rows = [r for r in comp["rows"] if r["policy"] != "full"]
            rows = [r for r in rows if r["policy"]["policy"] == policy]
            xs, ys = [r["kept_fraction"] for r in rows], [r["perplexity"] for r in rows]
            axes[2].plot(xs, ys, marker=marker, label=policy)
        axes[2].axhline(
            comp["rows"][0]["perplexity"], color="#999", ls="--", label="full attention"
        )
        axes[2].set(xlabel="kept KV fraction (mean over positions)", ylabel="perplexity")
        axes[2].set(title=f"compression over {comp['tokens']} tokens")
        axes[2].legend()
    return save_plot(fig, out)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    parts = args.only or ["preemption", "restart", "compression"]
    result: dict[str, Any] = {"benchmark": "kv_tiers", "model": args.model, "quick": args.quick}
    for name, fn in (
        ("preemption", preemption),
        ("restart", restart),
        ("compression", compression),
    ):
        if name in parts:
            result[name] = fn(args)
    write_result(result, args.out)
    plot(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
