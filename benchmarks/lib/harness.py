"""How a benchmark drives our engine: the engine built from its options, an offline run of a
workload step by step, batch-1 decode timing, and the machine probes (bandwidth) that bounds
are computed from."""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from benchmarks.lib.report import percentiles
from minivllm_jax import LLM, SamplingParams
from minivllm_jax.args import EngineArgs
from minivllm_jax.models.params import ServingParams
from minivllm_jax.ops.quantization import param_bytes

# ------------------------------------------------------------------ running the engine


def greedy(max_tokens: int, ignore_eos: bool = True) -> SamplingParams:
    """Greedy sampling forced to `max_tokens` (EOS ignored), so every config makes the same tokens."""
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)


def greedy_params(output_lens: list[int]) -> list[SamplingParams]:
    return [greedy(o) for o in output_lens]


@dataclasses.dataclass
class EngineRun:
    """One offline run: wall time, token counts, TTFTs (from the run's start) and the outputs."""

    elapsed_s: float
    input_tokens: int
    output_tokens: int
    ttft_s: list[float]
    token_ids: list[list[int]]

    def metrics(self) -> dict[str, Any]:
        return {
            **rates(self.elapsed_s, self.input_tokens, self.output_tokens),
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "ttft_s": percentiles(self.ttft_s),
        }


def run_requests(
    engine, prompts: list[list[int]], params: list, on_step=None, t0: float | None = None
) -> EngineRun:
    """Queue every request at once and step `engine` (an LLMEngine) until all finish.

    Offline semantics: all requests arrive at `t0` (default: now), so TTFT includes queueing.
    `on_step(engine)` runs after every step, which is how callers sample pages and batch sizes.
    """
    t0 = time.monotonic() if t0 is None else t0
    ids = [engine.add_request(p, sp, arrival_time=t0) for p, sp in zip(prompts, params)]
    done: dict[str, Any] = {}
    while len(done) < len(ids):
        if not engine.has_unfinished():
            raise RuntimeError(f"engine went idle with {len(ids) - len(done)} requests unfinished")
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if on_step is not None:
            on_step(engine)
    elapsed = time.monotonic() - t0
    outs = [done[i] for i in ids]
    token_ids = [o.outputs[0].token_ids for o in outs]
    return EngineRun(
        elapsed_s=elapsed,
        input_tokens=sum(map(len, prompts)),
        output_tokens=sum(map(len, token_ids)),
        ttft_s=[o.metrics.ttft for o in outs if o.metrics.ttft is not None],
        token_ids=token_ids,
    )


def run_batches(engine, batches: list[tuple[list, list]], on_step=None) -> EngineRun:
    """`run_requests` on each (prompts, params) group in turn, all arriving at the start: one
    EngineRun over the groups (wall time from the start, TTFTs and tokens in order)."""
    t0 = time.monotonic()
    runs = [run_requests(engine, p, sp, on_step=on_step, t0=t0) for p, sp in batches]
    return EngineRun(
        elapsed_s=time.monotonic() - t0,
        input_tokens=sum(r.input_tokens for r in runs),
        output_tokens=sum(r.output_tokens for r in runs),
        ttft_s=[t for r in runs for t in r.ttft_s],
        token_ids=[ids for r in runs for ids in r.token_ids],
    )


def stream_one(engine, prompt: list[int], params: SamplingParams) -> tuple[list[float], list[int]]:
    """Run one request alone on `engine`; the host time each of its tokens arrived, and the tokens."""
    engine.add_request(prompt, params)
    stamps: list[float] = []
    ids: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            new = out.outputs[0].token_ids[len(ids) :]
            stamps += [time.perf_counter()] * len(new)
            ids += new
    return stamps, ids


def decode_rate(stamps: list[float]) -> float:
    """Tokens per second after the first token (the first one includes prefill)."""
    return (len(stamps) - 1) / max(stamps[-1] - stamps[0], 1e-9)


def output_decode_rate(outs: list[Any]) -> float:
    """Tokens after each request's first over the time from its first token to its last, summed:
    the decode speed a stream sees (prefill left out), from `RequestOutput.metrics`."""
    tokens = sum(len(o.outputs[0].token_ids) - 1 for o in outs)
    return tokens / sum(o.metrics.last_token_time - o.metrics.first_token_time for o in outs)


def stream_greedy(params: Any, cfg: Any, prompt: list[int], tokens: int) -> dict[str, Any]:
    """One batch-1 run of the bare model loop (`reference.greedy.greedy_stream`): TTFT, decode
    tok/s and the tokens."""
    from minivllm_jax.reference.greedy import greedy_stream

    start, stamps, ids = time.perf_counter(), [], []
    for tok in greedy_stream(params, cfg, prompt, tokens):
        stamps.append(time.perf_counter())
        ids.append(tok)
    return {"ttft_s": stamps[0] - start, "decode_tok_s": decode_rate(stamps), "token_ids": ids}


def rates(elapsed_s: float, input_tokens: int, output_tokens: int) -> dict[str, float]:
    """Wall time and output and total (prompt + output) tokens per second of an offline run."""
    return {
        "elapsed_s": elapsed_s,
        "output_tok_s": output_tokens / elapsed_s,
        "total_tok_s": (input_tokens + output_tokens) / elapsed_s,
    }


ENGINE_FACTS = ("max_num_seqs", "max_model_len", "page_size", "num_pages", "max_num_batched_tokens")


def engine_facts(config: Any, *more: str) -> dict[str, Any]:
    """The engine knobs a result records (ENGINE_FACTS and `more`), from its `EngineConfig`."""
    knobs = config.knobs()
    return {k: knobs[k] for k in (*ENGINE_FACTS, *more)}


def timed(fn: Callable[[], Any], reps: int, warmups: int = 1) -> tuple[float, Any]:
    """Median seconds of `fn()` over `reps` runs after `warmups` untimed runs, and its last result."""
    out = None
    for _ in range(warmups):  # page faults, compiles, first-call costs
        out = fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def build_llm(model: str, **kwargs: Any) -> LLM:
    """Our engine for `model`, without progress bars unless asked."""
    return LLM(model, **{"use_tqdm": False, **kwargs})


def add_engine_args(
    p: argparse.ArgumentParser,
    exclude: tuple[str, ...] = (),
    only: tuple[str, ...] | None = None,
    **defaults: Any,
):
    """The engine's flags, one per `EngineArgs` field (`--model`, `--max-num-seqs`, ...), with
    this script's defaults; `exclude` leaves off the knobs the script sets itself, `only`
    keeps just these."""
    if only is not None:
        exclude += tuple(f.name for f in dataclasses.fields(EngineArgs) if f.name not in only)
    EngineArgs.add_cli_args(p, defaults=defaults, exclude=("use_tqdm", *exclude))


def llm_from_args(args: argparse.Namespace, **overrides: Any) -> LLM:
    """Our engine from the `add_engine_args` flags (`overrides` win), without progress bars."""
    return LLM.from_engine_args(EngineArgs.from_cli_args(args, **{"use_tqdm": False, **overrides}))


class PaddingCounter:
    """Counts real vs padded work of every step, as the engine's step listener (`StepEvent`).

    A ragged step pads its token count and its sequence count to a bucket; the waste is what
    the bucket computes beyond the real tokens and sequences (attention walks only real pages,
    see `minivllm_jax.ops.attention`). Steps with prompt tokens count as "mixed", the others as
    "decode". `uninstall()` stops counting.
    """

    def __init__(self, engine) -> None:
        self.engine = engine
        self.reset()
        engine.add_step_listener(self.record)

    def uninstall(self) -> None:
        self.engine.remove_step_listener(self.record)

    def reset(self) -> None:
        zero = {"steps": 0, "tokens": 0, "token_slots": 0, "rows": 0, "row_slots": 0, "pages": 0}
        self.counts = {"mixed": dict(zero), "decode": dict(zero)}

    def record(self, event) -> None:
        c = self.counts[event.kind]
        c["steps"] += 1
        c["tokens"] += event.num_tokens
        c["token_slots"] += event.token_slots
        c["rows"] += event.num_seqs
        c["row_slots"] += event.seq_slots
        c["pages"] += event.num_pages

    def summary(self) -> dict[str, Any]:
        """Per step kind: counts and % padded token slots and sequence rows."""

        def pct(used: int, slots: int) -> float | None:
            return round(100.0 * (1 - used / slots), 2) if slots else None

        out: dict[str, Any] = {}
        for kind, c in self.counts.items():
            out[kind] = {
                **c,
                "padded_token_pct": pct(c["tokens"], c["token_slots"]),
                "padded_row_pct": pct(c["rows"], c["row_slots"]),
            }
        total = sum(c["tokens"] for c in self.counts.values())
        slots = sum(c["token_slots"] for c in self.counts.values())
        out["padded_token_pct"] = pct(total, slots)
        return out


# ------------------------------------------------------------------ model and machine facts


def load_model(model: str, dtype: str = "float32") -> tuple[Any, Any]:
    """`model`'s config and params as the engine serves them (converted on first use, layers
    unstacked: no weight copies per step), without an engine."""
    from minivllm_jax.loading.checkpoint import load_converted
    from minivllm_jax.loading.resolve import resolve_model
    from minivllm_jax.models.params import unstack_layers

    cfg, _, params = load_converted(resolve_model(model, dtype=dtype, progress=False), dtype)
    return cfg, unstack_layers(params)


def tiny_model_config(**overrides: Any):
    """A tiny random-weights model (2 layers, 64 wide, vocabulary 256), for smoke runs."""
    from minivllm_jax.config import ModelConfig

    sizes = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2)
    heads = dict(num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=1e4)
    return ModelConfig(**{**sizes, **heads, "max_position_embeddings": 4096, **overrides})


def embed_and_head(params: Any) -> tuple[Any, Any]:
    """The input embedding and the untied output head (None when tied) of stored (a dict) or
    served (`ServingParams`) params."""
    if isinstance(params, ServingParams):
        return params.embed_tokens, params.lm_head
    return params["embed_tokens"], params.get("lm_head")


def decode_bytes_per_token(params: Any) -> int:
    """Weight bytes a batch-1 decode step reads: every param byte, less an untied input embedding
    (a step gathers one row of it; tied, it is the output head and read whole)."""
    embed, head = embed_and_head(params)
    return param_bytes(params) - (param_bytes(embed) if head is not None else 0)


def measure_bandwidth(array_mb: int, reps: int) -> dict[str, float]:
    """GB/s of a large read (sum) and copy (read + write), numpy and jitted JAX."""
    import jax
    import jax.numpy as jnp

    a = np.full(array_mb * 2**20 // 4, 1.0, np.float32)
    b = np.empty_like(a)
    x, total = jnp.asarray(a), jax.jit(jnp.sum)
    reps = max(reps, 5)
    gb_s = lambda nbytes, fn: nbytes / timed(fn, reps)[0] / 1e9
    return {
        "numpy_read_gb_s": gb_s(a.nbytes, lambda: a.sum()),
        "numpy_copy_gb_s": gb_s(2 * a.nbytes, lambda: np.copyto(b, a)),
        "jax_read_gb_s": gb_s(x.nbytes, lambda: total(x).block_until_ready()),
    }
