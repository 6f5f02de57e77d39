"""`python -m minivllm_jax --model smollm2-135m --prompt "..."`: stream one greedy completion."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from minivllm_jax.loading.checkpoint import load_converted
from minivllm_jax.loading.errors import ConversionError
from minivllm_jax.loading.resolve import resolve_model
from minivllm_jax.models.params import unstack_layers
from minivllm_jax.prompts import chat_ids, encode_text
from minivllm_jax.reference.greedy import greedy_stream


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minivllm_jax", description=__doc__)
    parser.add_argument(
        "--model", default="smollm2-135m", help="alias, converted dir, HF folder or .gguf"
    )
    parser.add_argument("--prompt", default="Write a haiku about the sea.")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--raw", action="store_true", help="do not apply the chat template")
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer  # heavy: only once the arguments are read

    try:
        model_dir = resolve_model(args.model)
    except ConversionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cfg, _, stored = load_converted(model_dir)
    params = unstack_layers(stored)  # the layout the model reads
    del stored  # held once
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    try:
        ids = prompt_ids(tokenizer, args.prompt, args.raw)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    stop = set(cfg.eos_token_ids) | ({tokenizer.eos_token_id} - {None})

    start, out = time.perf_counter(), []
    printed = ""
    for token in greedy_stream(params, cfg, ids, args.max_tokens, stop_ids=tuple(stop)):
        out.append(token)
        text = tokenizer.decode(out, skip_special_tokens=True)
        if not text.endswith("\ufffd"):
            print(text[len(printed) :], end="", flush=True)
            printed = text
    elapsed = time.perf_counter() - start
    print(f"\n[{len(out)} tokens in {elapsed:.1f}s, compile included]", file=sys.stderr)
    return 0


def prompt_ids(tokenizer: Any, prompt: str, raw: bool) -> list[int]:
    """`--prompt` as the library takes it: as one user message in the chat template, or (`raw`)
    as text with the tokenizer's special-token rule (`minivllm_jax.prompts`)."""
    if raw:
        return encode_text(tokenizer, prompt)
    return chat_ids(tokenizer, [{"role": "user", "content": prompt}])


if __name__ == "__main__":
    sys.exit(main())
