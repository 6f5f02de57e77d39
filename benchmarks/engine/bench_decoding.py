"""Decoding strategies beyond one token a step, in one run on one machine (issue 15's Measure):

1. the functional, fully jitted `minivllm_jax.generate` vs the engine (`LLM.generate`) vs HF
   transformers `generate`, greedy, batch 1 and batch 8, generated tokens per second;
2. multi-step decode: batch-1 engine decode with `num_scheduler_steps` k = 1, 4, 8, as tok/s and
   as a share of the bandwidth bound (read bandwidth over the weight bytes a step reads);
3. n-gram speculative decoding on an input-grounded workload (rewrite a passage, edit code: the
   answer copies much of the prompt) and on the chat preset, at batch 1 and 8, with and
   without (float32 at batch 1 and 8, also with `disable_by_batch_size`; int8 weights on the
   native matmul at batch 1): acceptance rate, output tok/s, and whether the tokens are identical;
4. beam search (`LLM.beam_search`, k = 4) vs HF `generate(num_beams=4)`, 1 and 4 prompts.

Every timing is the median of --reps runs after a warm-up run of the same work (which also
compiles what it needs). JSON and PNG go to benchmarks/results/decoding.*.

    python benchmarks/engine/bench_decoding.py [--quick] [--reps 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.lib import peers  # noqa: E402
from benchmarks.lib.harness import (  # noqa: E402
    build_llm,
    decode_bytes_per_token,
    decode_rate,
    greedy,
    load_model,
    measure_bandwidth,
    output_decode_rate,
    stream_one,
    timed,
)
from benchmarks.lib.report import add_options, new_figure, save_plot, script_parser, write_result  # noqa: E402
from benchmarks.lib.workloads import PRESETS, random_prompts, vocab_hi  # noqa: E402

# 7 draft tokens: 1 + 7 = 8 rows, a step bucket, which the native matmuls read the weights once
# for; it was the best of the draft lengths and lookup sizes tried (docs/perf-notes.md).
SPECULATIVE = {
    "method": "ngram",
    "num_speculative_tokens": 7,
    "prompt_lookup_max": 4,
    "prompt_lookup_min": 1,
}
BATCH_LIMIT = 4  # `disable_by_batch_size` of the third setting at batch 8

# Input-grounded requests: the answer is mostly the given text again, edited.
PASSAGES = [
    "The quick brown fox jumps over the lazy dog near the river bank. Every morning the fox walks along the "
    "water, looking for fish, and every evening it returns to its den under the old oak tree at the edge of "
    "the forest, where its three cubs wait for it.",
    "Our library opens at nine in the morning and closes at six in the evening from Monday to Friday. On "
    "Saturdays it opens at ten and closes at four. Books can be borrowed for three weeks and renewed twice, "
    "unless another reader has reserved them.",
    "To make the bread, mix the flour, the salt and the yeast in a large bowl, then add the warm water and "
    "stir until a soft dough forms. Knead the dough for ten minutes, cover it, and let it rise for one hour "
    "before baking it at two hundred degrees for thirty minutes.",
    "The meeting will take place on Thursday in the main conference room on the second floor. Please bring "
    "your laptop, the quarterly report and your notes from the last meeting. Lunch will be served after the "
    "meeting in the cafeteria on the ground floor.",
]
CODE = [
    "def area(width, height):\n    result = width * height\n    return result\n\n\ndef perimeter(width, height):\n"
    "    result = 2 * (width + height)\n    return result\n",
    "def count_words(text):\n    counts = {}\n    for word in text.split():\n        word = word.lower()\n"
    "        counts[word] = counts.get(word, 0) + 1\n    return counts\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n",
    "def mean(values):\n    total = 0\n    for value in values:\n        total = total + value\n"
    "    return total / len(values)\n",
]


def grounded_prompts(llm) -> list[list[int]]:
    asks = [f"Rewrite this text exactly, but in the past tense:\n\n{p}" for p in PASSAGES]
    asks += [f"Add type hints to this Python code and return the whole code:\n\n{c}" for c in CODE]
    return [llm.apply_chat_template([{"role": "user", "content": a}]) for a in asks]


def chat_prompts(n: int, hi: int, seed: int = 0) -> list[list[int]]:
    """The chat preset's prompts (seeded random ids below `hi`; lengths drawn from the same
    generator)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    lengths = rng.integers(*PRESETS["chat"].input_len, size=n)
    return [rng.integers(100, hi, size=int(k)).tolist() for k in lengths]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = script_parser(__doc__, "decoding.json")
    add_options(
        p,
        [
            ("--tokens", 64, "new tokens per request (sections 1, 2, 4)"),
            ("--spec-tokens", 160, "max new tokens per speculative-workload request"),
            ("--reps", 3, "timed runs (medians reported)"),
            ("--threads", 2, "torch threads"),
            ("--quick", False, "few tokens, 1 rep, speculation on the grounded workload only"),
        ],
    )
    args = p.parse_args(argv)
    if args.quick:
        args.tokens, args.spec_tokens, args.reps = 8, 24, 1
    return args


# Two warm-ups before each timing: the second run of a prompt hits the prefix cache and so has
# its own step shapes.
WARMUPS = 2


# ---------------------------------------------------------------------------------------- sections


def bench_generate(args, llm, hf, prompts: list[list[int]]) -> dict[str, Any]:
    """Functional generate vs engine vs HF at batch 1 and 8 (same prompts, greedy, forced length)."""
    from minivllm_jax import generate

    out: dict[str, Any] = {}
    n = args.tokens
    for batch in (1, 8):
        ps = prompts[:batch]
        run_fn = lambda: generate(llm.params, llm.model_config, ps, n, greedy(n))
        t_fn, fn_out = timed(run_fn, args.reps, WARMUPS)
        run_engine = lambda: llm.generate(ps, greedy(n), use_tqdm=False)
        t_engine, engine_out = timed(run_engine, args.reps, WARMUPS)
        # Same-length prompts: no padding, so HF's tokens are comparable.
        run_hf = lambda: peers.hf_generate(hf, ps, n, min_new_tokens=n)
        t_hf, hf_out = timed(run_hf, args.reps, WARMUPS)
        engine_ids = [o.outputs[0].token_ids for o in engine_out]
        out[f"batch_{batch}"] = {
            "functional_tok_s": batch * n / t_fn,
            "engine_tok_s": batch * n / t_engine,
            "hf_tok_s": batch * n / t_hf,
            "functional_equals_engine": [o.token_ids for o in fn_out] == engine_ids,
            "hf_equals_engine_rows": sum(
                h[len(p) :].tolist() == e for h, p, e in zip(hf_out, ps, engine_ids)
            ),
        }
        print(f"generate batch {batch}: {out[f'batch_{batch}']}")
    return out


def bench_multi_step(
    args, prompt: list[int], bytes_per_token: int, bandwidth_gb_s: float
) -> dict[str, Any]:
    """Batch-1 engine decode rate (tokens after the first, per second of their arrival) per k."""
    bound = bandwidth_gb_s * 1e9 / bytes_per_token
    out: dict[str, Any] = {"bound_tok_s": bound}
    tokens = 2 * args.tokens
    for k in (1, 4, 8):
        llm = build_llm(
            args.model,
            max_num_seqs=1,
            max_model_len=len(prompt) + tokens + 8,
            max_num_batched_tokens=64,
            num_scheduler_steps=k,
            warmup=False,
        )

        def run(engine=llm.engine) -> tuple[float, list[int]]:
            stamps, ids = stream_one(engine, prompt, greedy(tokens))
            return decode_rate(stamps), ids

        # Compile what this k uses (the second run hits the prefix cache: other shapes).
        run()
        run()
        rates = [run() for _ in range(max(args.reps, 1))]
        rate = statistics.median(r for r, _ in rates)
        out[f"k_{k}"] = {
            "decode_tok_s": rate,
            "share_of_bound": rate / bound,
            "token_ids": rates[-1][1],
        }
        print(
            f"multi-step k={k}: {rate:.1f} tok/s, {100 * rate / bound:.0f}% of the bound ({bound:.0f} tok/s)"
        )
        del llm, run
    out["identical_tokens"] = (
        out["k_1"]["token_ids"] == out["k_4"]["token_ids"] == out["k_8"]["token_ids"]
    )
    for k in (1, 4, 8):
        out[f"k_{k}"].pop("token_ids")
    return out


def bench_speculative(args, workloads: dict[str, list[list[int]]]) -> dict[str, Any]:
    """Each workload with and without speculation: float32 at batch 1 (the prompts one after
    another) and batch 8 (also with `disable_by_batch_size`), and int8 weights (the native
    quantized matmul, whose cost barely grows from 1 to 4 rows) at batch 1."""
    limited = {**SPECULATIVE, "disable_by_batch_size": BATCH_LIMIT}
    variants = {
        "fp32": (None, {1: ("off", "ngram"), 8: ("off", "ngram", "ngram_limited")}),
        "int8": ("int8", {1: ("off", "ngram")}),
    }
    configs = {"off": None, "ngram": SPECULATIVE, "ngram_limited": limited}
    out: dict[str, Any] = {}
    for variant, (quantization, batches) in variants.items():
        engines = {
            name: build_llm(
                args.model,
                max_num_seqs=8,
                max_model_len=1024,
                speculative_config=configs[name],
                quantization=quantization,
                warmup=False,
            )
            for name in dict.fromkeys(n for names in batches.values() for n in names)
        }
        for workload, prompts in workloads.items():
            for batch, names in batches.items():
                row: dict[str, Any] = {}
                tokens = {}
                for name in names:
                    llm, e = engines[name], engines[name].engine
                    groups = [prompts[i : i + batch] for i in range(0, len(prompts), batch)]
                    run = lambda: [
                        o
                        for g in groups
                        for o in llm.generate(g, greedy(args.spec_tokens, False), use_tqdm=False)
                    ]  # noqa: E731
                    before = e.stats()
                    seconds, outs = timed(run, args.reps, WARMUPS)
                    runs = args.reps + WARMUPS  # the warm-ups' drafts count too
                    generated = sum(len(o.outputs[0].token_ids) for o in outs)
                    tokens[name] = [o.outputs[0].token_ids for o in outs]
                    after = e.stats()
                    d = (after.draft_tokens - before.draft_tokens) / runs
                    a = (after.accepted_tokens - before.accepted_tokens) / runs
                    row[name] = {
                        "tok_s": generated / seconds,
                        "decode_tok_s": output_decode_rate(outs),
                        "output_tokens": generated,
                        "draft_tokens_per_run": d,
                        "acceptance_rate": a / d if d else None,
                    }
                for name in names[1:]:
                    suffix = name.removeprefix("ngram")
                    row["speedup" + suffix] = row[name]["tok_s"] / row["off"]["tok_s"]
                    row["decode_speedup" + suffix] = (
                        row[name]["decode_tok_s"] / row["off"]["decode_tok_s"]
                    )
                row["identical_tokens"] = all(tokens[name] == tokens["off"] for name in names)
                key = f"{workload}_batch_{batch}" + ("" if variant == "fp32" else f"_{variant}")
                out[key] = row
                speeds = ", ".join(
                    f"{n} {row[n]['tok_s']:.1f} / {row[n]['decode_tok_s']:.1f}" for n in names
                )
                print(
                    f"speculative {key}: output / decode tok/s {speeds} (ngram {row['speedup']:.2f}x / "
                    f"{row['decode_speedup']:.2f}x), acceptance {row['ngram']['acceptance_rate']}, "
                    f"identical {row['identical_tokens']}"
                )
        del engines
    return out


def bench_beam(args, llm, hf, prompts: list[list[int]]) -> dict[str, Any]:
    from minivllm_jax import BeamSearchParams

    out: dict[str, Any] = {}
    n, k = args.tokens, 4
    params = BeamSearchParams(beam_width=k, max_tokens=n, ignore_eos=True)
    for batch in (1, 4):
        ps = prompts[:batch]
        t_ours, ours = timed(lambda: llm.beam_search(ps, params), args.reps, WARMUPS)
        run_hf = lambda: peers.hf_generate(hf, ps, n, min_new_tokens=n, num_beams=k)
        t_hf, hf_out = timed(run_hf, args.reps, WARMUPS)
        same = sum(o.sequences[0].tokens == h.tolist() for o, h in zip(ours, hf_out))
        out[f"batch_{batch}"] = {
            "ours_tok_s": batch * n / t_ours,
            "hf_tok_s": batch * n / t_hf,
            "ours_beam_tok_s": batch * k * n / t_ours,
            "hf_beam_tok_s": batch * k * n / t_hf,
            "best_beam_equal_rows": same,
        }
        print(f"beam search batch {batch}: {out[f'batch_{batch}']}")
    return out


# ---------------------------------------------------------------------------------------- report


def plot(result: dict[str, Any], out: str | Path) -> Path:
    fig, axes = new_figure(3, width=5.0)
    gen, names = result["generate"], ["functional", "engine", "hf"]
    for j, b in enumerate((1, 8)):
        tok_s = [gen[f"batch_{b}"][f"{n}_tok_s"] for n in names]
        axes[0][0].bar([x + 0.3 * j for x in range(3)], tok_s, 0.3, label=f"batch {b}")
    axes[0][0].set_xticks([x + 0.15 for x in range(3)], names)
    axes[0][0].set(ylabel="generated tok/s", title="greedy generate")
    axes[0][0].legend()
    ms = result["multi_step"]
    axes[0][1].bar(["k=1", "k=4", "k=8"], [100 * ms[f"k_{k}"]["share_of_bound"] for k in (1, 4, 8)])
    axes[0][1].set(ylabel="% of the bandwidth bound", title="batch-1 decode, multi-step")
    spec = result["speculative"]
    keys = list(spec)
    axes[0][2].bar(range(len(keys)), [spec[key]["decode_speedup"] for key in keys])
    axes[0][2].axhline(1.0, color="gray", lw=0.8)
    ticks = [key.replace("_batch_", "\nb") for key in keys]
    axes[0][2].set_xticks(range(len(keys)), ticks, fontsize=8)
    axes[0][2].set(ylabel="decode tok/s with / without speculation", title="n-gram speculation")
    return save_plot(fig, out)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    llm = build_llm(args.model, max_num_seqs=16, max_model_len=1024, warmup=False)
    hf = peers.load_hf_model(args.model, threads=args.threads)
    hi = vocab_hi(args.model)
    same_len = random_prompts([32] * 8, 0, hi)
    bandwidth = measure_bandwidth(64 if args.quick else 512, args.reps)
    result: dict[str, Any] = {
        "model": args.model,
        "tokens": args.tokens,
        "reps": args.reps,
        "speculative_config": SPECULATIVE,
    }
    result["generate"] = bench_generate(args, llm, hf, same_len)
    result["beam_search"] = bench_beam(args, llm, hf, same_len)
    grounded = grounded_prompts(llm)
    del llm
    bandwidth_after = measure_bandwidth(64 if args.quick else 512, args.reps)
    best = max(*bandwidth.values(), *bandwidth_after.values())
    result["bandwidth"] = {"before": bandwidth, "after": bandwidth_after, "best_gb_s": best}
    bytes_per_token = decode_bytes_per_token(load_model(args.model)[1])
    result["multi_step"] = bench_multi_step(args, same_len[0], bytes_per_token, best)
    result["multi_step"]["weight_bytes_per_token"] = bytes_per_token
    workloads = {"grounded": grounded, "chat": chat_prompts(len(grounded), hi)}
    if args.quick:  # one workload runs every speculative path; the chat one only adds numbers
        del workloads["chat"]
    result["speculative"] = bench_speculative(args, workloads)
    path = write_result(result, args.out)
    plot(result, path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
