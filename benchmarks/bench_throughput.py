"""Offline throughput, nano-vllm style: N requests with random input/output lengths (seeded),
our engine vs HF transformers `generate` (PyTorch, batched with left padding), same run.

Outputs are forced to their drawn lengths (`ignore_eos`; HF with no EOS), so both sides
produce exactly the same useful tokens. HF runs its batches in input order and decodes each
batch to its longest request; only requested tokens count as useful.

    python benchmarks/bench_throughput.py [--num-prompts 64] [--hf-batch 8] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).parent / "results"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, nargs=2, default=[16, 512], metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=[16, 256], metavar=("MIN", "MAX"))
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--hf-batch", type=int, default=8, help="HF generate batch size (0 skips the PyTorch peer)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="8 short requests, for smoke tests")
    p.add_argument("--out", default=str(RESULTS / "throughput.json"))
    return p.parse_args(argv)


def workload(args: argparse.Namespace, vocab_hi: int = 10000) -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(args.seed)
    lo_in, hi_in = args.input_len
    lo_out, hi_out = args.output_len
    prompts = [rng.integers(100, vocab_hi, size=int(rng.integers(lo_in, hi_in + 1))).tolist() for _ in range(args.num_prompts)]
    outputs = [int(rng.integers(lo_out, hi_out + 1)) for _ in range(args.num_prompts)]
    return prompts, outputs


def run_ours(args, prompts, out_lens) -> dict:
    from minivllm_jax import LLM, SamplingParams

    max_len = max(len(p) + o for p, o in zip(prompts, out_lens))
    start = time.perf_counter()
    llm = LLM(args.model, max_num_seqs=args.max_num_seqs, max_model_len=max_len,
              max_num_batched_tokens=args.max_num_batched_tokens, use_tqdm=False)  # fmt: skip
    startup = time.perf_counter() - start
    params = [SamplingParams(temperature=args.temperature, max_tokens=o, ignore_eos=True, seed=i)
              for i, o in enumerate(out_lens)]  # fmt: skip
    compiles = llm.engine.num_compiles
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == sum(out_lens), (produced, sum(out_lens))
    return {
        "startup_s": startup,
        "warmup_s": llm.warmup_seconds,
        "compiled_programs": compiles,
        "compiles_during_run": llm.engine.num_compiles - compiles,
        "preemptions": llm.engine.scheduler.num_preemptions,
        "num_pages": llm.engine.config.num_pages,
        "elapsed_s": elapsed,
        "output_tok_s": produced / elapsed,
        "total_tok_s": (produced + sum(map(len, prompts))) / elapsed,
    }


def run_hf(args, prompts, out_lens) -> dict:
    import torch
    import transformers

    from convert.resolve import MODEL_ALIASES, alias_source

    torch.set_num_threads(args.threads)
    if args.model in MODEL_ALIASES:
        path = alias_source(args.model)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32,
            quantization_config=transformers.GgufConfig(dequantize=True),
        )  # fmt: skip
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model.eval()
    start = time.perf_counter()
    with torch.no_grad():
        for i in range(0, len(prompts), args.hf_batch):
            batch, lens = prompts[i : i + args.hf_batch], out_lens[i : i + args.hf_batch]
            width = max(map(len, batch))
            ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(lens), do_sample=True,
                           temperature=args.temperature, top_k=0, eos_token_id=None, pad_token_id=0)  # fmt: skip
    elapsed = time.perf_counter() - start
    return {
        "batch_size": args.hf_batch,
        "elapsed_s": elapsed,
        "output_tok_s": sum(out_lens) / elapsed,
        "total_tok_s": (sum(out_lens) + sum(map(len, prompts))) / elapsed,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.quick:
        args.num_prompts, args.input_len, args.output_len, args.max_num_seqs = 8, [8, 48], [4, 16], 8
    prompts, out_lens = workload(args)
    result = {
        "benchmark": "offline_throughput",
        "model": args.model,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "input_tokens": sum(map(len, prompts)),
        "output_tokens": sum(out_lens),
        "temperature": args.temperature,
        "cpu_count": os.cpu_count(),
        "ours": run_ours(args, prompts, out_lens),
    }
    print(f"ours: {result['ours']['output_tok_s']:.1f} output tok/s, {result['ours']['total_tok_s']:.1f} total tok/s "
          f"({result['ours']['elapsed_s']:.1f} s; warm-up {result['ours']['warmup_s']:.1f} s, "
          f"{result['ours']['compiled_programs']} programs)")  # fmt: skip
    if args.hf_batch:
        result["hf"] = run_hf(args, prompts, out_lens)
        result["speedup"] = result["ours"]["output_tok_s"] / result["hf"]["output_tok_s"]
        print(f"HF:   {result['hf']['output_tok_s']:.1f} output tok/s, {result['hf']['total_tok_s']:.1f} total tok/s "
              f"({result['hf']['elapsed_s']:.1f} s)\nspeedup {result['speedup']:.2f}x")  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
