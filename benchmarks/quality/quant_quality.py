"""Quality against a reference, in one place (bench_quant.py): perplexity and
KL of the next-token distributions scored through an engine's own served params and KV cache,
and the comparison of greedy outputs (agreement, vLLM's top-5 rule)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

TOP_K = 5  # vLLM's check_logprobs_close rule


def score_text(
    runner, ids: list[int], window: int, chunk: int, ref_dir: Path, is_reference: bool
) -> dict[str, Any]:
    """Perplexity, and KL / top-1 agreement against the reference's saved logprobs, of `ids` in
    non-overlapping windows, each fed in `chunk`-token steps through the runner's own params,
    matmul, attention and KV cache (pages 1.. of the idle engine's cache): every chunk after
    the first reads the window's earlier tokens back from the cache, as serving does. The
    reference saves its `[window, vocab]` log-softmax per window under `ref_dir` instead."""
    import jax
    import numpy as np

    from minivllm_jax.engine.step import forward_jit
    from minivllm_jax.ops.batch import single_sequence_batch

    ps = runner.config.cache.page_size
    pages = list(range(1, -(-window // ps) + 1))
    log_softmax = jax.jit(lambda x: jax.nn.log_softmax(x.astype(jax.numpy.float32), axis=-1))
    nll, kl, agree = [], [], []
    start = time.perf_counter()
    for w in range(len(ids) // window):
        toks = np.asarray(ids[w * window : (w + 1) * window], np.int32)
        rows, cache = [], runner.cache
        for c in range(0, window, chunk):
            batch = single_sequence_batch(toks[c : c + chunk], c, pages, ps)
            logits, cache = forward_jit(runner.params, cache, batch, runner.spec, all_logits=True)
            rows.append(np.asarray(log_softmax(logits)))
        runner.cache = cache  # donated: the engine keeps the returned one
        lp = np.concatenate(rows)  # [window, vocab]
        nll.append(-lp[np.arange(window - 1), toks[1:]])
        ref_path = ref_dir / f"ref_logprobs_{w}.npy"
        if is_reference:
            np.save(ref_path, lp)
            continue
        ref = np.load(ref_path)
        kl.append(np.sum(np.exp(ref) * (ref - lp), axis=-1))
        agree.append(ref.argmax(-1) == lp.argmax(-1))
    nll_all = np.concatenate(nll)
    out = {
        "perplexity": float(np.exp(nll_all.mean())),
        "scored_predictions": int(nll_all.size),
        "scoring_s": time.perf_counter() - start,
    }
    if is_reference:  # against itself, by definition
        out.update(mean_kl=0.0, max_kl=0.0, top1_agreement=1.0)
    else:
        kls = np.concatenate(kl)
        top1 = float(np.concatenate(agree).mean())
        out.update(mean_kl=float(kls.mean()), max_kl=float(kls.max()), top1_agreement=top1)
    return out


def greedy_outputs(llm, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """Greedy token ids and each position's top-k token ids (with the chosen one) for every prompt."""
    from minivllm_jax import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=TOP_K)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return {
        "token_ids": [o.outputs[0].token_ids for o in outs],
        "top_ids": [[sorted(map(int, step)) for step in o.outputs[0].logprobs] for o in outs],
    }


def compare_greedy(ref: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """Greedy agreement of `other` with `ref` (each from `greedy_outputs`), prompt by prompt:
    positions equal, identical outputs, the first position where they differ, and vLLM's
    top-k rule (`check_logprobs_close`): at the first difference each chosen token must be in
    the other run's top-k there; outputs that never differ pass."""
    positions = matches = identical = passed = 0
    first_diff: list[int | None] = []
    for ref_ids, ids, ref_top, top in zip(
        ref["token_ids"], other["token_ids"], ref["top_ids"], other["top_ids"]
    ):
        positions += len(ref_ids)
        matches += sum(a == b for a, b in zip(ref_ids, ids))
        d = next((i for i, (a, b) in enumerate(zip(ref_ids, ids)) if a != b), None)
        first_diff.append(d)
        identical += d is None
        passed += d is None or (ref_ids[d] in top[d] and ids[d] in ref_top[d])
    n = len(first_diff)
    prefix = [len(r) if d is None else d for r, d in zip(ref["token_ids"], first_diff)]
    return {
        "prompts": n,
        "position_agreement": matches / positions,
        "identical_share": identical / n,
        "mean_common_prefix": sum(prefix) / n,
        "first_difference": first_diff,
        "top5_rule_pass_share": passed / n,
    }
