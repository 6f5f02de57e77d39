"""Single-sequence greedy decoding: the simplest path through the model and the paged cache.

It is the reference the engine is checked against and the batch-1 baseline in benchmarks.
One sequence owns pages 1..n of a private cache; prefill runs at the prompt's exact length
and decode at a fixed block-table width, so a run compiles two programs.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from minivllm_jax.config import ModelConfig
from minivllm_jax.engine.step import StepSpec, forward_jit
from minivllm_jax.models.params import ServingParams, model_dtype
from minivllm_jax.ops.batch import single_sequence_batch
from minivllm_jax.ops.kv_cache import init_kv_cache


def greedy_stream(
    params: ServingParams,
    cfg: ModelConfig,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    stop_ids: Sequence[int] = (),
    page_size: int = 16,
) -> Iterator[int]:
    """Yield greedy tokens one by one until `max_new_tokens` or a token in `stop_ids`. `params`:
    serving params (`models.params.unstack_layers` of the loaded ones)."""
    if not prompt_ids:
        raise ValueError("prompt_ids must not be empty")
    total = len(prompt_ids) + max_new_tokens
    num_seq_pages = -(-total // page_size)
    pages = list(range(1, num_seq_pages + 1))
    dtype = model_dtype(params)
    cache = init_kv_cache(cfg, num_seq_pages + 1, page_size, dtype)

    spec = StepSpec(cfg)  # the reference attention and matmuls, one device
    batch = single_sequence_batch(np.asarray(prompt_ids), 0, pages, page_size)
    for step in range(max_new_tokens):
        logits, cache = forward_jit(params, cache, batch, spec)
        token = int(np.argmax(np.asarray(logits[0])))  # host argmax: XLA's is slow on CPU
        yield token
        if token in stop_ids:
            return
        batch = single_sequence_batch(np.array([token]), len(prompt_ids) + step, pages, page_size)


def greedy_generate(
    params: ServingParams,
    cfg: ModelConfig,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    stop_ids: Sequence[int] = (),
    page_size: int = 16,
) -> list[int]:
    """All greedy tokens of `greedy_stream` as a list (the stop token included, like HF)."""
    return list(greedy_stream(params, cfg, prompt_ids, max_new_tokens, stop_ids, page_size))
