"""Quantization modes side by side: what each costs (bytes, memory, speed) and what it loses
(quality against fp32), one engine configuration and one fixed text for all of them.

Modes: fp32, bf16, fp16 (the model dtype), int8, int4, w8a8 (weight schemes, fp32 otherwise)
and gguf (the GGUF's own Q4 blocks), each with the KV cache in the model dtype ("auto") and in
int8 (`+kv8`). A mode that does not apply (gguf on a model that is not a GGUF) is listed as
skipped with the reason.

Every mode runs in its own process (so its peak RSS is its own) on the same token ids:
  - param bytes (`quantization.param_bytes` of the served params), KV bytes per token (the
    cache pytree's bytes, scales included, over its slots) and the largest batch of
    --kv-budget-context-token sequences that fits in --kv-budget-mib of KV;
  - peak RSS (VmHWM) after load and the speed runs, and again after the quality scoring;
  - batch-1 greedy decode tok/s (one prompt, --decode-tokens new tokens, best of --reps after a
    warm-up run), its ratio to fp32's, and its share of the bandwidth bound: the machine's read
    bandwidth (the best of `harness.measure_bandwidth` before and after all modes) over the
    weight bytes one decode step reads (every served param byte, less an untied input embedding,
    of which a step gathers one row); offline throughput (--batch prompts of --batch-input-len text tokens, each
    --batch-output-len new tokens), TTFT of a --ttft-prompt-len prompt (p50 of --ttft-reps);
  - quality against fp32 (the reference, always run first): perplexity on a fixed English text
    (license files of installed packages, >= --min-text-tokens tokens, in --window-token
    windows), mean KL(fp32 || mode) of the next-token distributions at every position and
    their top-1 agreement, scored through the mode's own served params and KV cache: each
    window is fed in --chunk-token chunks, each attending to the previous chunks from the cache
    (so an int8 cache is read); greedy agreement over the fixed prompts (--gen-tokens each) and
    vLLM's top-5 rule (`check_logprobs_close`: at the first position where two greedy outputs
    differ, each chosen token must be in the other run's top-5 logprobs there). The scoring
    lives in `quant_quality.py`; the table in `benchmarks.lib.readme.quant_table`.

    python benchmarks/quality/bench_quant.py                 # every mode (the longest entry of run_all)
    python benchmarks/quality/bench_quant.py --modes fp32 int8 --kv auto
    python benchmarks/quality/bench_quant.py --report                # print the table of --out (run_all.py --readme
                                                             # writes it into the READMEs)
    python benchmarks/quality/bench_quant.py --quick --model PATH_TO_TINY_HF_DIR --text FILE
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.lib import peers  # noqa: E402
from benchmarks.lib.harness import (  # noqa: E402
    build_llm,
    decode_bytes_per_token,
    decode_rate,
    greedy,
    measure_bandwidth,
    output_decode_rate,
    rates,
)
from benchmarks.lib.readme import REFERENCE, quant_table  # noqa: E402
from benchmarks.lib.report import (  # noqa: E402
    add_options,
    new_figure,
    peak_rss_bytes,
    percentiles,
    rss_bytes,
    save_plot,
    script_parser,
    write_result,
)
from benchmarks.lib.workloads import DEFAULT_TEXTS, text_ids, tokenizer  # noqa: E402
from benchmarks.quality.quant_quality import compare_greedy, greedy_outputs, score_text  # noqa: E402
from minivllm_jax.ops.quantization import param_bytes  # noqa: E402

# base mode -> LLM arguments. The weight schemes keep the model in float32 (activations, norms).
BASE_MODES: dict[str, dict[str, Any]] = {
    "fp32": {"dtype": "float32", "quantization": None},
    "bf16": {"dtype": "bfloat16", "quantization": None},
    "fp16": {"dtype": "float16", "quantization": None},
    "int8": {"dtype": "float32", "quantization": "int8"},
    "int4": {"dtype": "float32", "quantization": "int4"},
    "w8a8": {"dtype": "float32", "quantization": "w8a8"},
    "gguf": {"dtype": "float32", "quantization": "gguf"},
}
KV_DTYPES = ("auto", "int8")

# Greedy-agreement prompts: fixed, varied English (stories, facts, code, lists, instructions).
PROMPTS = (
    "Write a short story about a robot learning to paint.",
    "The capital of France is",
    "Explain why the sky is blue in simple terms.",
    "def fibonacci(n):",
    "Here is a recipe for chocolate chip cookies:",
    "The three laws of thermodynamics are",
    "Once upon a time, in a small village by the sea,",
    "List five tips for staying productive while working from home:",
    "Q: What is the largest planet in the solar system?\nA:",
    "The history of the printing press begins",
    "Translate to French: 'Good morning, how are you?'",
    "import numpy as np\n\ndef normalize(x):",
    "A haiku about autumn leaves:",
    "The main causes of the First World War were",
    "Photosynthesis is the process by which",
    "Dear hiring manager, I am writing to apply for",
    "The difference between a list and a tuple in Python is",
    "In 1969, the Apollo 11 mission",
    "Five fun facts about octopuses:",
    "How to change a flat tire, step by step:",
    "The best way to learn a new language is",
    "SELECT name, email FROM users WHERE",
    "The theory of evolution by natural selection states that",
    "My favorite thing about winter is",
)
DECODE_PROMPT = PROMPTS[0]


# The sizes recorded with a result.
SETTINGS = (
    "window chunk decode_tokens reps batch batch_input_len batch_output_len ttft_prompt_len "
    "ttft_reps kv_budget_mib kv_budget_context quick"
).split()


def mode_name(base: str, kv: str) -> str:
    return base if kv == "auto" else f"{base}+kv8"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = script_parser(__doc__, "quant.json")
    p.add_argument(
        "--modes",
        nargs="+",
        default=list(BASE_MODES),
        choices=list(BASE_MODES),
        help=f"base modes (default: all; {REFERENCE}, the reference, always runs)",
    )
    p.add_argument(
        "--kv",
        nargs="+",
        default=list(KV_DTYPES),
        choices=KV_DTYPES,
        help="KV cache dtypes of each mode",
    )
    p.add_argument(
        "--text",
        nargs="+",
        default=None,
        metavar="FILE",
        help="perplexity text files (default: licence files of installed packages: "
        + ", ".join(f"{d} {f}" for d, f in DEFAULT_TEXTS)
        + ")",
    )
    add_options(
        p,
        [  # the sizes, then the switches
            ("--min-text-tokens", 5000, "the scored text must have at least this many"),
            ("--window", 512, "perplexity window (tokens; windows do not overlap)"),
            ("--chunk", 64, "tokens fed per step when scoring a window"),
            ("--num-prompts", len(PROMPTS), f"greedy prompts (at most {len(PROMPTS)})"),
            ("--gen-tokens", 64, "greedy tokens per prompt"),
            ("--decode-tokens", 128, "batch-1 decode: new tokens"),
            ("--reps", 3, "batch-1 decode: timed runs (best counts) after a warm-up"),
            ("--batch", 32, "offline throughput: prompts"),
            ("--batch-input-len", 128, "offline throughput: prompt tokens (text slices)"),
            ("--batch-output-len", 64, "offline throughput: new tokens per prompt"),
            ("--ttft-prompt-len", 256, "TTFT: prompt tokens (text slices)"),
            ("--ttft-reps", 5, "TTFT: prompts timed (p50 reported)"),
            ("--kv-budget-mib", 64.0, "KV budget for the largest-batch column"),
            ("--kv-budget-context", 512, "tokens per sequence for that column"),
            ("--bandwidth-mb", 512, "array size of the bandwidth probe (>> caches)"),
            ("--child-timeout", 3600.0, "seconds one mode may take"),
            ("--keep-workdir", False, "keep the reference logprobs and child logs"),
            ("--quick", False, "tiny sizes for smoke tests (a tiny model, any text)"),
            ("--no-llamacpp", False, "skip llama.cpp's batch-1 decode on the model's own GGUF"),
        ],
    )
    p.add_argument("--report", action="store_true", help="only print/rebuild the table from --out")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: run one mode
    p.add_argument("--workdir", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.min_text_tokens, args.window, args.chunk = 0, 64, 16
        args.num_prompts, args.gen_tokens, args.decode_tokens, args.reps = 4, 8, 8, 1
        args.batch, args.batch_input_len, args.batch_output_len = 4, 16, 8
        args.ttft_prompt_len, args.ttft_reps, args.kv_budget_context = 32, 2, 64
        args.bandwidth_mb = 64
    if args.window % args.chunk:
        p.error(f"--window ({args.window}) must be a multiple of --chunk ({args.chunk})")
    args.num_prompts = min(args.num_prompts, len(PROMPTS))
    return args


# ---------------------------------------------------------------- which modes can run


def skip_reason(model: str, base: str, kv: str) -> str | None:
    """Why this mode does not apply to `model` (None: it does): gguf needs a GGUF model."""
    quant = BASE_MODES[base]["quantization"]
    if quant == "gguf":
        from minivllm_jax.loading.quantize import gguf_source_of

        try:
            gguf_source_of(model)
        except ValueError as e:
            return f"not applicable: {e}"
    return None


def plan_modes(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Every requested (base, kv) pair, the reference first, with a skip reason where it cannot run."""
    pairs = [(REFERENCE, "auto")] + [
        (b, kv) for b in args.modes for kv in args.kv if (b, kv) != (REFERENCE, "auto")
    ]
    plan = {}
    for base, kv in pairs:
        reason = skip_reason(args.model, base, kv)
        plan[mode_name(base, kv)] = {
            "base": base,
            **BASE_MODES[base],
            "kv_cache_dtype": kv,
            **({"status": "skipped", "reason": reason} if reason else {}),
        }
    return plan


# ---------------------------------------------------------------- inputs (the same token ids for every mode)


def build_inputs(args: argparse.Namespace) -> dict[str, Any]:
    """Tokenize the text and prompts once (the reference model's tokenizer): token ids for all modes."""
    tok = tokenizer(args.model)
    ids, sources = text_ids(tok, args.text)
    windows = len(ids) // args.window
    scored = windows * args.window
    if windows == 0 or scored < args.min_text_tokens:
        raise SystemExit(
            f"the text has {len(ids)} tokens: {windows} windows of {args.window} give {scored}, "
            f"need >= {args.min_text_tokens} (--text more files, or --min-text-tokens)"
        )

    def slices(n: int, length: int, offset: int) -> list[list[int]]:
        """`n` distinct slices of the text, wrapping around."""
        return [
            [ids[(offset + i * length + j) % len(ids)] for j in range(length)] for i in range(n)
        ]

    prompts = [tok(p)["input_ids"] for p in PROMPTS[: args.num_prompts]]
    return {
        "text": {
            "sources": sources,
            "tokens": len(ids),
            "window": args.window,
            "chunk": args.chunk,
            "windows": windows,
            "scored_tokens": scored,
        },
        "ids": ids[:scored],
        "prompts": prompts,
        "decode_prompt": tok(DECODE_PROMPT)["input_ids"],
        "batch_prompts": slices(args.batch, args.batch_input_len, 0),
        "ttft_prompts": slices(args.ttft_reps, args.ttft_prompt_len, len(ids) // 2),
    }


# ---------------------------------------------------------------- one mode (runs in its own process)


def kv_budget(
    bytes_per_token: float, page_size: int, budget_mib: float, context: int
) -> dict[str, Any]:
    """How many whole pages, tokens and `context`-token sequences fit in `budget_mib` of KV."""
    pages = int(budget_mib * 2**20 // (bytes_per_token * page_size))
    return {
        "budget_mib": budget_mib,
        "context": context,
        "pages": pages,
        "tokens": pages * page_size,
        "max_batch": pages // -(-context // page_size),
    }


def _pages(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def build_mode_llm(args: argparse.Namespace, spec: dict[str, Any], inputs: dict[str, Any]):
    """The mode's LLM, sized for every run of this tool, prefix caching off (repeated prompts
    must be recomputed, and scoring writes pages of the idle engine's cache)."""
    ps = 16
    lens = [
        args.window,
        args.ttft_prompt_len + 1,
        len(inputs["decode_prompt"]) + args.decode_tokens,
        args.batch_input_len + args.batch_output_len,
        max(map(len, inputs["prompts"])) + args.gen_tokens,
    ]
    num_pages = 1 + max(
        _pages(max(lens), ps),
        args.batch * _pages(lens[3], ps),
        len(inputs["prompts"]) * _pages(lens[4], ps),
    )
    kw: dict[str, Any] = dict(
        dtype=spec["dtype"],
        quantization=spec["quantization"],
        page_size=ps,
        max_num_seqs=max(args.batch, len(inputs["prompts"])),
        max_model_len=_pages(max(lens), ps) * ps,
        num_pages=num_pages,
        enable_prefix_caching=False,
    )
    if spec["kv_cache_dtype"] != "auto":  # only when asked: engines without it run "auto"
        kw["kv_cache_dtype"] = spec["kv_cache_dtype"]
    if args.quick:  # its prompts are short: 7 step programs to warm up per mode, not 10
        kw["max_num_batched_tokens"] = 64
    return build_llm(args.model, **kw)


def measure_speed(llm, args: argparse.Namespace, inputs: dict[str, Any]) -> dict[str, Any]:
    """Batch-1 decode (best of --reps after a warm-up run), TTFT (p50) and offline throughput."""
    runs = []
    for _ in range(args.reps + 1):
        (out,) = llm.generate([inputs["decode_prompt"]], greedy(args.decode_tokens), use_tqdm=False)
        runs.append({"decode_tok_s": output_decode_rate([out]), "ttft_s": out.metrics.ttft})
    timed = runs[1:]
    ttft = []
    for prompt in inputs["ttft_prompts"]:
        (out,) = llm.generate([prompt], greedy(1), use_tqdm=False)
        ttft.append(out.metrics.ttft)
    start = time.perf_counter()
    outs = llm.generate(inputs["batch_prompts"], greedy(args.batch_output_len), use_tqdm=False)
    elapsed = time.perf_counter() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    in_tokens = sum(map(len, inputs["batch_prompts"]))
    return {
        "decode_b1": {
            "tokens": args.decode_tokens,
            "decode_tok_s": max(r["decode_tok_s"] for r in timed),
            "median_tok_s": statistics.median(r["decode_tok_s"] for r in timed),
            "runs": timed,
        },
        "ttft": {"prompt_tokens": args.ttft_prompt_len, **percentiles(ttft)},
        "offline": {
            "prompts": len(outs),
            "input_tokens": in_tokens,
            "output_tokens": out_tokens,
            **rates(elapsed, in_tokens, out_tokens),
        },
    }


def run_mode(args: argparse.Namespace) -> dict[str, Any]:
    """The child: one mode, everything measured in this process."""
    import jax

    workdir = Path(args.workdir)
    name = args.child
    spec = json.loads((workdir / "plan.json").read_text())[name]
    inputs = json.loads((workdir / "inputs.json").read_text())
    start = time.perf_counter()
    llm = build_mode_llm(args, spec, inputs)
    load_s = time.perf_counter() - start
    print(f"{name}: loaded and warmed up in {load_s:.1f} s", flush=True)  # the child's log
    runner = llm.engine.runner
    leaves = jax.tree.leaves(runner.cache)
    slots = runner.config.cache.num_pages * runner.config.cache.page_size
    per_token = sum(x.size * x.dtype.itemsize for x in leaves) / slots
    result: dict[str, Any] = {
        "param_bytes": param_bytes(runner.params),
        "decode_bytes_per_token": decode_bytes_per_token(runner.params),
        "kv_bytes_per_token": per_token,
        "kv_cache_leaf_dtypes": sorted({str(x.dtype) for x in leaves}),
        "kv_budget": kv_budget(
            per_token, runner.config.cache.page_size, args.kv_budget_mib, args.kv_budget_context
        ),
        "engine": {
            "max_num_seqs": runner.config.scheduler.max_num_seqs,
            "max_model_len": runner.config.max_model_len,
            "num_pages": runner.config.cache.num_pages,
            "page_size": runner.config.cache.page_size,
            "attention": runner.attention,
            "matmul": runner.matmul,
        },
        "load_s": load_s,
        "warmup_s": llm.warmup_seconds,
        "rss_after_load_bytes": rss_bytes(),
    }
    compiles = llm.engine.stats().compiles
    result.update(measure_speed(llm, args, inputs))
    result["compiles_during_run"] = llm.engine.stats().compiles - compiles
    result["peak_rss_bytes"] = peak_rss_bytes()  # serving: load, warm-up and the speed runs
    print(f"{name}: speed runs done at {time.perf_counter() - start:.1f} s", flush=True)
    is_ref = name == REFERENCE
    result["quality"] = score_text(runner, inputs["ids"], args.window, args.chunk, workdir, is_ref)
    print(f"{name}: text scored at {time.perf_counter() - start:.1f} s", flush=True)
    outputs = greedy_outputs(llm, inputs["prompts"], args.gen_tokens)
    (workdir / f"{name}.greedy.json").write_text(json.dumps(outputs))
    result["peak_rss_with_scoring_bytes"] = peak_rss_bytes()
    return result


def child_main(args: argparse.Namespace) -> int:
    result = run_mode(args)
    (Path(args.workdir) / f"{args.child}.json").write_text(json.dumps(result))
    return 0


def run_child(
    args: argparse.Namespace, argv: list[str], name: str, workdir: Path
) -> dict[str, Any]:
    """Run one mode in a fresh interpreter; its result, or an error with its log's tail."""
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--child", name]
    cmd += ["--workdir", str(workdir)]
    log = workdir / f"{name}.log"
    start = time.perf_counter()
    try:
        with log.open("w") as f:
            rc = subprocess.run(
                cmd, stdout=f, stderr=subprocess.STDOUT, timeout=args.child_timeout
            ).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    wall = time.perf_counter() - start
    out = workdir / f"{name}.json"
    if rc != 0 or not out.is_file():
        tail = log.read_text(errors="replace").strip().splitlines()[-12:] or ["(no output)"]
        return {
            "status": "error",
            "reason": f"exit {rc}: {tail[-1]}",
            "log_tail": tail,
            "wall_s": wall,
        }
    return {"status": "ok", **json.loads(out.read_text()), "wall_s": wall}


# ---------------------------------------------------------------- report


def plot(result: dict[str, Any], out: Path) -> None:
    """Speed vs quality: batch-1 decode tok/s against perplexity, offline tok/s against mean KL."""
    fig, axes = new_figure(2, width=6.0, height=4.2)
    ax, bx = axes[0]
    kv8 = {"facecolors": "none", "edgecolors": "C3"}  # the int8 KV cache's marker
    for name, m in result["modes"].items():
        if m.get("status") != "ok":
            continue
        q, style = m["quality"], {"color": "C0"} if m["kv_cache_dtype"] == "auto" else kv8
        for a, x, y in (
            (ax, m["decode_b1"]["decode_tok_s"], q["perplexity"]),
            (bx, m["offline"]["output_tok_s"], q["mean_kl"]),
        ):
            a.scatter([x], [y], s=40, **style)
            a.annotate(name, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set(xlabel="batch-1 decode tok/s", ylabel="perplexity (lower is better)")
    ax.set(title="decode speed vs perplexity")
    bx.set(xlabel="offline output tok/s", ylabel=f"mean KL vs {REFERENCE} (symlog)")
    bx.set(title="throughput vs KL")
    bx.set_yscale("symlog", linthresh=1e-4)
    ax.scatter([], [], color="C0", label="KV cache in the model dtype")
    ax.scatter([], [], **kv8, label="int8 KV cache (+kv8)")
    ax.legend(fontsize=8)
    for a in (ax, bx):
        a.grid(alpha=0.3)
    save_plot(fig, out)


def report(out: Path) -> str:
    """Print the README table of the modes (`benchmarks.lib.readme.quant_table`) of `out`."""
    table = quant_table(json.loads(out.read_text()))
    print(table)
    return table


def llamacpp_decode(args: argparse.Namespace, inputs: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's batch-1 greedy decode on the model's own GGUF (the peer of `gguf`), measured
    as ours is: the same prompt and token count, best of --reps after a warm-up run."""
    ok, why = peers.available()
    path = peers.source_gguf(args.model)
    if not ok or path is None:
        return {
            "status": "skipped",
            "reason": why if not ok else f"{args.model} is not a GGUF model",
        }
    runs = []
    with peers.LlamaCppPeer(path, 2) as peer:
        for _ in range(args.reps + 1):
            run = peer.run([inputs["decode_prompt"]], [args.decode_tokens], 1)
            runs.append(decode_rate(run.token_times[0]))
    print(f"llama.cpp {path.name}: {max(runs[1:]):.1f} tok/s batch-1", flush=True)
    return {"status": "ok", "gguf": path.name, "decode_tok_s": max(runs[1:]), "runs": runs[1:]}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.child:
        return child_main(args)
    out = Path(args.out)
    if args.report:
        report(out)
        return 0
    plan = plan_modes(args)
    # The machine's speed drifts: probe the bandwidth before and after the modes, the best is the bound.
    bandwidth = {"before": measure_bandwidth(args.bandwidth_mb, args.reps)}
    workdir = Path(tempfile.mkdtemp(prefix="bench_quant-"))
    try:
        inputs = build_inputs(args)
        (workdir / "plan.json").write_text(json.dumps(plan))
        (workdir / "inputs.json").write_text(json.dumps(inputs))
        modes: dict[str, dict[str, Any]] = {}
        for name, spec in plan.items():
            if spec.get("status") == "skipped":
                print(f"{name}: skipped ({spec['reason']})", flush=True)
                modes[name] = spec
                continue
            if name != REFERENCE and modes[REFERENCE]["status"] != "ok":
                modes[name] = {
                    **spec,
                    "status": "skipped",
                    "reason": f"the reference ({REFERENCE}) failed",
                }
                continue
            print(f"{name}: running", flush=True)
            modes[name] = {**spec, **run_child(args, argv, name, workdir)}
            m = modes[name]
            if m["status"] == "ok":
                outputs = json.loads((workdir / f"{name}.greedy.json").read_text())
                ref = json.loads((workdir / f"{REFERENCE}.greedy.json").read_text())
                m["greedy"] = compare_greedy(ref, outputs)
                q = m["quality"]
                print(
                    f"{name}: {m['decode_b1']['decode_tok_s']:.1f} tok/s batch-1, {m['offline']['output_tok_s']:.1f} "
                    f"offline, perplexity {q['perplexity']:.3f}, mean KL {q['mean_kl']:.4f}, {m['wall_s']:.0f} s",
                    flush=True,
                )
            else:
                print(f"{name}: {m['status']}: {m['reason']}", flush=True)
    finally:
        if args.keep_workdir:
            print(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    bandwidth["after"] = measure_bandwidth(args.bandwidth_mb, args.reps)
    bandwidth["best_gb_s"] = max(v for probe in bandwidth.values() for v in probe.values())
    result = {
        "benchmark": "quantization",
        "model": args.model,
        "reference": REFERENCE,
        "text": inputs["text"],
        "greedy_prompts": len(inputs["prompts"]),
        "gen_tokens": args.gen_tokens,
        "settings": {k: getattr(args, k) for k in SETTINGS},
        "modes": modes,
        "bandwidth": bandwidth,
    }
    if not args.quick and not args.no_llamacpp:
        result["llamacpp"] = llamacpp_decode(args, inputs)
    write_result(result, out)
    if any(m.get("status") == "ok" for m in modes.values()):
        plot(result, out)
    report(out)
    return 0 if all(m.get("status") in ("ok", "skipped") for m in modes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
