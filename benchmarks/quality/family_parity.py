"""Parity of every model family (`minivllm_jax.models.registry`) with HF transformers, float32.

For each family a tiny random-weight HF model (`make_tiny_family`: GQA, head_dim 16, sliding
windows of 8 tokens where the family has them, norms and biases perturbed so that none is an
identity) is saved with `save_pretrained`, read by our converter and compared with HF on a
40-token prompt (five windows long): the largest |logit difference| over every position, and
whether our 32 greedy tokens after an 11-token prompt are HF `generate`'s. Writes
results/family_parity.json and prints the table. About two minutes on 2 cores (compiles).
tests/test_families.py checks the same models, and the engine's batched tokens too.

    python benchmarks/quality/family_parity.py [--families qwen3 gemma2 ...] [--quick] [--out PATH]
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402

from benchmarks.lib.peers import hf_generate  # noqa: E402
from benchmarks.lib.report import script_parser, write_result  # noqa: E402

PAGE_SIZE = 4
PROMPT_LEN = 40  # longer than every window below, so windows change the answer
GREEDY_PROMPT_LEN = 11
GREEDY_TOKENS = 32
LOGIT_TOLERANCE = 1e-4

# initializer_range 5x HF's default: attention scores big enough for soft-capping and windows to matter.
TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    initializer_range=0.1,
)


@dataclasses.dataclass(frozen=True)
class FamilySpec:
    config_class: str  # transformers' config class
    overrides: dict[str, Any]  # on top of TINY
    # What each family feature's absence would look like: HF config overrides that turn it off.
    # tests/test_families.py checks that each changes HF's logits, so parity proves it is honoured.
    controls: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)


GEMMA = dict(
    sliding_window=8, query_pre_attn_scalar=32, attn_implementation="eager"
)  # eager: HF's soft-capping path

FAMILIES: dict[str, FamilySpec] = {
    "llama": FamilySpec("LlamaConfig", {}),
    "qwen2": FamilySpec("Qwen2Config", {}),
    "qwen2-sliding": FamilySpec(
        "Qwen2Config",
        dict(use_sliding_window=True, sliding_window=8, max_window_layers=1),
        {"sliding window": dict(use_sliding_window=False)},
    ),
    "qwen3": FamilySpec("Qwen3Config", {}),
    "mistral": FamilySpec(
        "MistralConfig", dict(sliding_window=8), {"sliding window": dict(sliding_window=4096)}
    ),
    "gemma2": FamilySpec(
        "Gemma2Config",
        dict(**GEMMA, attn_logit_softcapping=1.0, final_logit_softcapping=2.0),
        {
            "sliding window": dict(sliding_window=4096),
            "attention soft-capping": dict(attn_logit_softcapping=None),
            "final soft-capping": dict(final_logit_softcapping=None),
            "query_pre_attn_scalar": dict(query_pre_attn_scalar=16),
        },
    ),
    # Six layers: Gemma 3's five local layers and one global; the global layer's RoPE scaled.
    "gemma3": FamilySpec(
        "Gemma3TextConfig",
        dict(
            **GEMMA,
            num_hidden_layers=6,
            rope_local_base_freq=100.0,
            rope_scaling={"rope_type": "linear", "factor": 4.0},
        ),
        {
            "sliding window": dict(sliding_window=4096),
            "query_pre_attn_scalar": dict(query_pre_attn_scalar=16),
            "local RoPE base": dict(rope_local_base_freq=1e6),
            "global RoPE scaling": dict(rope_scaling=None),
        },
    ),
}


def make_tiny_family(name: str, path: str | Path | None = None, seed: int = 0, **overrides: Any):
    """A random tiny HF model of family `name` (`FAMILIES`), float32, eval; saved to `path` if given.
    Norm weights and biases get noise added (HF starts them at 1 or 0, which would hide an
    RMSNorm offset or a missing bias)."""
    import torch
    import transformers

    spec = FAMILIES[name]
    config = getattr(transformers, spec.config_class)(**{**TINY, **spec.overrides, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "norm" in param_name or "bias" in param_name:
                param.add_(0.2 * torch.randn_like(param))
    if path is not None:
        model.save_pretrained(path)
    return model


def hf_logits(model, ids: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor(ids[None])).logits[0].numpy()


def our_logits(params, cfg, ids: np.ndarray) -> np.ndarray:
    """Our logits at every token of `ids`, one prefill over shuffled pages of `PAGE_SIZE`."""
    import jax.numpy as jnp

    from minivllm_jax.engine.step import StepSpec, forward_jit
    from minivllm_jax.ops.batch import single_sequence_batch
    from minivllm_jax.ops.kv_cache import init_kv_cache

    num_pages = -(-len(ids) // PAGE_SIZE)
    pages = list(
        np.random.default_rng(0).permutation(np.arange(1, num_pages + 1))
    )  # the block table decides
    cache = init_kv_cache(cfg, num_pages + 1, PAGE_SIZE, jnp.float32)
    logits, _ = forward_jit(
        params,
        cache,
        single_sequence_batch(ids, 0, pages, PAGE_SIZE),
        StepSpec(cfg),
        all_logits=True,
    )
    return np.asarray(logits)


def parity(name: str, workdir: str | Path) -> dict[str, Any]:
    """One row of the table: family `name` built, saved under `workdir`, converted and compared."""
    from convert import read_checkpoint
    from minivllm_jax.models.hf_config import config_from_hf
    from minivllm_jax.models.params import unstack_layers
    from minivllm_jax.ops.attention import resolve_attention
    from minivllm_jax.reference.greedy import greedy_generate

    path = Path(workdir) / name
    model = make_tiny_family(name, path)
    hf_config, params = read_checkpoint(path, progress=False)
    cfg = config_from_hf(hf_config)
    params = unstack_layers(params)
    rng = np.random.default_rng(1)
    ids = rng.integers(3, cfg.vocab_size, PROMPT_LEN)
    start = time.perf_counter()
    diff = float(np.abs(our_logits(params, cfg, ids) - hf_logits(model, ids)).max())
    prompt = rng.integers(3, cfg.vocab_size, GREEDY_PROMPT_LEN).tolist()
    ours = greedy_generate(params, cfg, prompt, GREEDY_TOKENS, page_size=PAGE_SIZE)
    theirs = hf_generate(model, [prompt], GREEDY_TOKENS)[0, len(prompt) :].tolist()
    same = [a == b for a, b in zip(ours, theirs)] + [False]
    return {
        "family": name,
        "architecture": hf_config["architectures"][0],
        "registry_family": cfg.family,
        "attention_extras": list(cfg.attention_extras),
        "layer_windows": list(cfg.layer_windows),
        "engine_attention": resolve_attention("auto", cfg),
        "max_abs_logit_diff": diff,
        "logits_within_tolerance": diff <= LOGIT_TOLERANCE,
        "greedy_tokens_identical": ours == theirs,
        "greedy_tokens_matching": same.index(False),
        "seconds": round(time.perf_counter() - start, 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = script_parser(__doc__, "family_parity.json", model=None)
    p.add_argument("--families", nargs="+", choices=sorted(FAMILIES), default=list(FAMILIES))
    p.add_argument(
        "--quick", action="store_true", help="Gemma 3 only (the family with the most extras)"
    )
    args = p.parse_args(argv)
    if args.quick:
        args.families = ["gemma3"]
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for name in args.families:
            rows.append(parity(name, workdir))
            r = rows[-1]
            print(
                f"{name:14s} {r['architecture']:20s} max |logit diff| {r['max_abs_logit_diff']:.2e}  "
                f"greedy {r['greedy_tokens_matching']}/{GREEDY_TOKENS} identical  "
                f"attention {r['engine_attention']}  ({r['seconds']} s)",
                flush=True,
            )
    write_result(
        {
            "benchmark": "family_parity",
            "prompt_len": PROMPT_LEN,
            "greedy_tokens": GREEDY_TOKENS,
            "page_size": PAGE_SIZE,
            "tiny_config": TINY,
            "rows": rows,
        },
        args.out,
    )
    return (
        0 if all(r["logits_within_tolerance"] and r["greedy_tokens_identical"] for r in rows) else 1
    )


if __name__ == "__main__":
    sys.exit(main())
