"""Structured output: decode speed constrained (JSON schema) against unconstrained, same run (JSON + PNG).

For each batch size, the same chat prompts are run twice on one warmed-up engine:
1. constrained: each with a JSON schema (`StructuredOutputsParams(json=...)`), greedy, until the
   grammar completes (or `--max-tokens`); every output is parsed and validated with `jsonschema`;
2. unconstrained: greedy, `ignore_eos`, each request forced to the token count its constrained
   run produced, so both runs generate exactly the same number of tokens.
Output tok/s of each (medians of `--repeats` alternated runs) and their ratio; the host time spent filling token masks (per constrained
token); the grammar compile time of each distinct schema (cold, then cached).

    python benchmarks/engine/bench_structured.py              # SmolLM2, a few minutes
    python benchmarks/engine/bench_structured.py --quick      # batch sizes 1 and 4, fewer prompts
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.lib.harness import build_llm, run_batches, timed  # noqa: E402
from benchmarks.lib.report import new_figure, save_plot, script_parser, write_result  # noqa: E402

SCHEMAS = [
    {
        "type": "object",
        "additionalProperties": False,
        "required": ["name", "age", "city"],
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "age": {"type": "integer", "minimum": 0, "maximum": 130},
            "city": {"type": "string", "enum": ["Paris", "London", "Tokyo", "Lima"]},
        },
    },
    {
        "type": "object",
        "additionalProperties": False,
        "required": ["title", "author", "year"],
        "properties": {
            "title": {"type": "string", "maxLength": 60},
            "year": {"type": "integer"},
            "author": {
                "type": "object",
                "additionalProperties": False,
                "required": ["first", "last"],
                "properties": {
                    "first": {"type": "string", "maxLength": 20},
                    "last": {"type": "string", "maxLength": 20},
                },
            },
        },
    },
    {
        "type": "object",
        "additionalProperties": False,
        "required": ["items", "total"],
        "properties": {
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 5,
                "items": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["item", "price"],
                    "properties": {
                        "item": {"type": "string", "maxLength": 24},
                        "price": {"type": "number"},
                    },
                },
            },
            "total": {"type": "number"},
        },
    },
]
QUESTIONS = [
    "Describe a person who lives in {city}, as JSON.",
    "Name a book you like about {city}, with its author and year, as JSON.",
    "Write a shopping list for a trip to {city} with prices, as JSON.",
]
CITIES = ["Paris", "London", "Tokyo", "Lima", "Oslo", "Cairo", "Quito", "Delhi"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = script_parser(__doc__, "structured.json")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument(
        "--prompts", type=int, default=32, help="requests per batch size (at least one round of it)"
    )
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument(
        "--repeats", type=int, default=3, help="timed runs of each kind per batch size (medians)"
    )
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.batch_sizes, args.prompts, args.max_tokens, args.repeats = [1, 4], 4, 120, 1
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    import jsonschema

    from minivllm_jax import SamplingParams, StructuredOutputsParams
    from minivllm_jax.engine.decoding.structured_output import Grammar

    llm = build_llm(args.model, max_num_seqs=max(args.batch_sizes), max_model_len=512)
    engine = llm.engine
    compiler = engine.grammar_compiler
    once_ms = lambda spec: 1e3 * timed(lambda: compiler.compile(spec), 1, warmups=0)[0]
    tokenizer_ms = once_ms(StructuredOutputsParams(regex="a"))  # llguidance's tokenizer view
    compile_ms = []
    for schema in SCHEMAS:  # cold compile, then cached
        spec = StructuredOutputsParams(json=schema)
        cold_ms = once_ms(spec)
        compile_ms.append({"cold_ms": cold_ms, "cached_ms": once_ms(spec)})

    def in_rounds(prompts: list, params: list, batch: int):
        """`batch` requests at a time, one round after another."""
        groups = range(0, len(prompts), batch)
        return run_batches(
            engine, [(prompts[i : i + batch], params[i : i + batch]) for i in groups]
        )

    warm_compiles = engine.stats().compiles
    mask_seconds = [0.0, 0]  # host time filling masks, masks filled
    fill = Grammar.fill_bitmask

    def timed_fill(self, bitmask, row):  # the host's share of a constrained token
        t0 = time.perf_counter()
        fill(self, bitmask, row)
        mask_seconds[0] += time.perf_counter() - t0
        mask_seconds[1] += 1

    Grammar.fill_bitmask = timed_fill
    rows, example = [], None
    try:
        for batch in args.batch_sizes:
            rounds = max(1, args.prompts // batch)  # `batch` requests at a time: the concurrency
            picks = [(i % len(SCHEMAS), CITIES[i % len(CITIES)]) for i in range(batch * rounds)]
            prompts = [
                llm.apply_chat_template([{"role": "user", "content": QUESTIONS[s].format(city=c)}])
                for s, c in picks
            ]
            constrained = [
                SamplingParams(
                    temperature=0.0,
                    max_tokens=args.max_tokens,
                    structured_outputs=StructuredOutputsParams(json=SCHEMAS[s]),
                )
                for s, _ in picks
            ]
            mask_seconds[:] = [0.0, 0]
            run_c = in_rounds(prompts, constrained, batch)  # also this batch size's warm-up
            masks = tuple(mask_seconds)
            finished = sum(1 for t in run_c.token_ids if len(t) < args.max_tokens)
            texts = [llm.tokenizer.decode(t, skip_special_tokens=True) for t in run_c.token_ids]
            valid = 0
            for (s, _), text in zip(picks, texts):
                try:
                    jsonschema.validate(json.loads(text), SCHEMAS[s])
                    valid += 1
                except (ValueError, jsonschema.ValidationError):
                    pass
            example = example or {
                "schema": SCHEMAS[picks[0][0]],
                "prompt": QUESTIONS[picks[0][0]].format(city=picks[0][1]),
                "output": texts[0],
            }
            plain = [
                SamplingParams(temperature=0.0, max_tokens=max(1, len(t)), ignore_eos=True)
                for t in run_c.token_ids
            ]
            speeds: dict[str, list[float]] = {"constrained": [], "unconstrained": []}
            for _ in range(args.repeats):  # alternated, so the machine's drift hits both alike
                for name, params in (("constrained", constrained), ("unconstrained", plain)):
                    run = in_rounds(prompts, params, batch)
                    speeds[name].append(run.output_tokens / run.elapsed_s)
            n = len(prompts)
            row = {
                "batch_size": batch,
                "requests": n,
                "output_tokens": run_c.output_tokens,
                "constrained_tok_s": statistics.median(speeds["constrained"]),
                "unconstrained_tok_s": statistics.median(speeds["unconstrained"]),
                "runs_tok_s": speeds,
                "valid_json": valid,
                "finished_by_grammar": finished,
                "mask_fill_ms_per_token": 1e3 * masks[0] / max(masks[1], 1),
            }
            row["ratio"] = row["constrained_tok_s"] / row["unconstrained_tok_s"]
            rows.append(row)
            print(
                f"batch {batch:>3}: constrained {row['constrained_tok_s']:.1f} tok/s, unconstrained "
                f"{row['unconstrained_tok_s']:.1f} tok/s ({row['ratio']:.2f}x, medians of {args.repeats}), "
                f"{valid}/{n} valid JSON, {finished}/{n} completed by the grammar, "
                f"mask fill {row['mask_fill_ms_per_token']:.2f} ms/token",
                flush=True,
            )
    finally:
        Grammar.fill_bitmask = fill
    print(
        f"llguidance tokenizer view {tokenizer_ms:.0f} ms once; schema compiles (cold/cached, ms): "
        + ", ".join(f"{c['cold_ms']:.1f}/{c['cached_ms']:.3f}" for c in compile_ms)
    )
    print("example:", json.dumps(example, indent=1))
    result = {
        "benchmark": "structured",
        "model": args.model,
        "rows": rows,
        "tokenizer_view_ms": tokenizer_ms,
        "compile": compile_ms,
        "example": example,
        "compiles_after_warmup": engine.stats().compiles - warm_compiles,
    }
    out = write_result(result, args.out)
    fig, axes = new_figure()
    ax = axes[0, 0]
    xs = [str(r["batch_size"]) for r in rows]
    for j, (key, label) in enumerate(
        [("unconstrained", "unconstrained"), ("constrained", "JSON schema")]
    ):
        tok_s = [r[f"{key}_tok_s"] for r in rows]
        ax.bar([i + (j - 0.5) * 0.4 for i in range(len(xs))], tok_s, 0.4, label=label)
    ax.set_xticks(range(len(xs)), xs)
    ax.set(xlabel="concurrent requests", ylabel="output tok/s")
    ax.set(title=f"Structured output on {args.model}")
    ax.legend()
    save_plot(fig, out.with_suffix(".png"))
    return result


if __name__ == "__main__":
    main()
