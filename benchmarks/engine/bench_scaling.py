"""Tensor parallelism on virtual CPU devices: each mode's correctness and the communication of a
step, counted in the compiled HLO, against what Megatron-style sharding should cost.

For SmolLM2 split `--tp` ways (default 3: 3 query heads and 1 KV head a device) and one device,
in one process over `--devices` virtual CPU devices (the cores are shared, so speed is not the
point; tok/s is printed only to show it runs):
  - greedy tokens of a few prompts, TP against one device (identical is the target);
  - for steps of 1 and 16 tokens, every collective of the compiled step (kind, count, bytes)
    against the expected: 2 all-reduces a layer (after o_proj and down_proj) and 1 for the
    vocabulary-split embedding, each tokens x hidden x 4 bytes, and 1 all-gather of the logits
    (sequences x vocabulary x 4 bytes);
  - the same formulas for an 8B Llama (on paper) for docs/scaling.md.

    python benchmarks/engine/bench_scaling.py [--tp 3] [--devices 4] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

# No JAX before main() sets XLA_FLAGS: these import numpy at most.
from benchmarks.lib.report import script_parser, write_result  # noqa: E402
from benchmarks.lib.workloads import TEXT_PROMPTS  # noqa: E402

PROMPTS = TEXT_PROMPTS[:3]
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=256, num_pages=64)
LLAMA_8B = dict(layers=32, hidden=4096, vocab=128256, act_bytes=2)  # Llama-3-8B, bf16 (8 KV heads)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = script_parser(__doc__, "scaling.json")
    p.add_argument("--tp", type=int, default=3)
    p.add_argument(
        "--devices", type=int, default=4, help="virtual CPU devices (XLA_FLAGS), at least --tp"
    )
    p.add_argument("--tokens", type=int, default=32, help="greedy tokens a prompt")
    return p.parse_args(argv)


def expected(
    layers: int,
    hidden: int,
    vocab: int,
    tokens: int,
    seqs: int,
    act_bytes: int = 4,
    vocab_split: bool = True,
) -> dict:
    """Megatron collectives of one step: payload bytes of each kind (before the ring's 2(N-1)/N)."""
    all_reduces = 2 * layers + (1 if vocab_split else 0)
    return {
        "all-reduce": {
            "count": all_reduces,
            "bytes_each": tokens * hidden * act_bytes,
            "bytes": all_reduces * tokens * hidden * act_bytes,
        },
        "all-gather": {
            "count": 1 if vocab_split else 0,
            "bytes_each": seqs * vocab * 4,
            "bytes": seqs * vocab * 4,
        },
    }


def measured(program) -> dict:
    text = program.as_text()
    out = {}
    for op in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute"):
        sizes = [
            _bytes(dtype, dims)
            for dtype, dims in re.findall(rf"= (\w+)\[([\d,]*)\][^ ]* {op}\(", text)
        ]
        out[op] = {"count": len(sizes), "bytes_each": sorted(set(sizes)), "bytes": sum(sizes)}
    return out


def _bytes(dtype: str, dims: str) -> int:
    size = {"f32": 4, "s32": 4, "bf16": 2, "f16": 2, "pred": 1, "s8": 1, "u32": 4}[dtype]
    for d in filter(None, dims.split(",")):
        size *= int(d)
    return size


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.devices < args.tp:
        raise SystemExit("--devices must be at least --tp")
    os.environ["XLA_FLAGS"] = (
        f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={args.devices}"
    )
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    from benchmarks.lib.harness import build_llm, greedy

    params = greedy(args.tokens)
    runs = {}
    for tp in (1, args.tp):
        llm = build_llm(args.model, tensor_parallel_size=tp, **ENGINE)
        start = time.perf_counter()
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        cfg, shapes = llm.engine.model_config, llm.engine.config.scheduler.step_shapes()
        run = {
            "tokens": [o.outputs[0].token_ids for o in outs],
            "tok_s": len(PROMPTS) * args.tokens / seconds,
            "compiles_after_warmup": llm.engine.stats().compiles - len(shapes) - 1,
        }
        if tp > 1:
            steps = {}
            for tokens, seqs in ((1, 1), (16, 4)):
                got = measured(llm.engine.step_program(tokens, seqs))
                sizes = (cfg.num_layers, cfg.hidden_size, cfg.vocab_size, tokens, seqs)
                want = expected(*sizes, vocab_split=cfg.vocab_size % tp == 0)
                steps[f"{tokens} tokens, {seqs} seqs"] = {"measured": got, "expected": want}
            run["collectives"] = steps
        runs[f"tp{tp}"] = run
        del llm
    parity = runs[f"tp{args.tp}"]["tokens"] == runs["tp1"]["tokens"]
    result = {
        "benchmark": "scaling",
        "model": args.model,
        "devices": [str(d) for d in jax.devices()],
        "tp": args.tp,
        "greedy_identical": parity,
        "runs": runs,
        "llama_8b_on_paper": {
            f"tp decode, batch {b}": expected(**LLAMA_8B, tokens=b, seqs=b) for b in (1, 64)
        },
    }
    print(f"greedy tokens TP={args.tp} vs one device: {'identical' if parity else 'DIFFERENT'}")
    for tp_name, run in runs.items():
        print(
            f"{tp_name}: {run['tok_s']:.1f} tok/s (virtual devices on shared cores), "
            f"compiles after warm-up: {run['compiles_after_warmup']}"
        )
    for step, c in runs[f"tp{args.tp}"]["collectives"].items():
        shown = ("all-reduce", "all-gather")
        for op in shown:
            m, e = c["measured"][op], c["expected"][op]
            print(
                f"  {step}: {op}: {m['count']} x {m['bytes_each']} B measured, {e['count']} x {e['bytes_each']} B expected"
            )
        others = {
            op: v["count"] for op, v in c["measured"].items() if op not in shown and v["count"]
        }
        print(f"  {step}: other collectives: {others or 'none'}")
    write_result(result, args.out)
    return 0 if parity else 1


if __name__ == "__main__":
    sys.exit(main())
