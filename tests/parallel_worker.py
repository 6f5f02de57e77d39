"""Runs in a subprocess for tests/test_parallel.py: JAX must see several (virtual) devices or
join other processes before it starts, which the test process cannot do any more.

    python tests/parallel_worker.py engines MODEL      # TP/DP configs: greedy tokens, compiles
    python tests/parallel_worker.py server MODEL       # the HTTP server over DP=2
    python tests/parallel_worker.py hlo MODEL TP       # collectives in the compiled TP step
    python tests/parallel_worker.py process MODEL COORDINATOR NUM ID   # one process of a TP run
    python tests/parallel_worker.py refusals MODEL     # what tensor parallelism refuses
    python tests/parallel_worker.py smollm2            # the shipped model, TP=1 against TP=3

Prints one line `RESULT <json>`.
"""

from __future__ import annotations

import json
import sys

# Small buckets: the programs compile in seconds (6 of them).
ENGINE = dict(
    max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128, num_pages=64, use_tqdm=False
)
PROMPTS = [[1] + list(range(3 + i, 30 + 3 * i)) for i in range(5)]
TOKENS = 16


def greedy(llm) -> list[list[int]]:
    outs = llm.generate(PROMPTS, _greedy_params(), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def engines(model: str) -> dict:
    from minivllm_jax import LLM

    out = {}
    for tp, dp in [(1, 1), (4, 1), (1, 2), (2, 2)]:
        llm = LLM(model, tensor_parallel_size=tp, data_parallel_size=dp, **ENGINE)
        warm = [e.stats().compiles for e in llm.engines]
        tokens = greedy(llm)
        out[f"{tp}x{dp}"] = {
            "tokens": tokens,
            "warm_compiles": warm,
            "compiles_after": [e.stats().compiles for e in llm.engines],
            "requests_per_replica": [e.stats().generated_tokens // TOKENS for e in llm.engines],
            "cache_devices": [
                sorted(d.id for d in e.runner.cache.k.sharding.device_set) for e in llm.engines
            ],
        }
    return out


def server(model: str) -> dict:
    """The HTTP server over two data-parallel replicas: completions, and where they ran."""
    from fastapi.testclient import TestClient

    from minivllm_jax import LLM
    from server.app import create_app

    llm = LLM(model, data_parallel_size=2, **ENGINE)
    app = create_app(llm, model_name="tiny", max_queue=16)
    with TestClient(app) as client:
        responses = [
            client.post(
                "/v1/completions",
                json={
                    "model": "tiny",
                    "prompt": prompt,
                    "max_tokens": TOKENS,
                    "temperature": 0,
                    "ignore_eos": True,
                },
            )
            for prompt in PROMPTS
        ]
        metrics = client.get("/metrics").text
    return {
        "status": [r.status_code for r in responses],
        "texts": [r.json()["choices"][0]["text"] for r in responses],
        "reference": [
            o.outputs[0].text for o in llm.generate(PROMPTS, _greedy_params(), use_tqdm=False)
        ],
        "tokens_per_replica": [e.stats().generated_tokens for e in llm.engines],
        "metrics_compiles": [
            line for line in metrics.splitlines() if line.startswith("minivllm_compiles")
        ],
    }


def _greedy_params():
    from minivllm_jax import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)


def hlo(model: str, tp: int) -> dict:
    """The collectives of one compiled decode step (`benchmarks/engine/bench_scaling.py` counts them)."""
    from benchmarks.engine.bench_scaling import expected, measured
    from minivllm_jax import LLM

    llm = LLM(model, tensor_parallel_size=tp, warmup=False, **ENGINE)
    cfg = llm.engine.model_config
    return {
        "measured": measured(llm.engine.runner.step_program(1, 1)),
        "expected": expected(cfg.num_layers, cfg.hidden_size, cfg.vocab_size, tokens=1, seqs=1),
    }


def process(model: str, coordinator: str, num: int, pid: int) -> dict:
    from minivllm_jax.parallel import distributed

    distributed.initialize(coordinator, num, pid)
    import jax

    from minivllm_jax import LLM

    llm = LLM(
        model, tensor_parallel_size=jax.device_count(), warmup=False, **ENGINE
    )  # compiles what it runs
    if pid != 0:
        llm.follow()
        return {"followed": True, "devices": jax.device_count()}
    tokens = greedy(llm)
    llm.shutdown()
    return {
        "tokens": tokens,
        "devices": jax.device_count(),
        "compiles": llm.engine.stats().compiles,
    }


def smollm2() -> dict:
    """The shipped model on one device and split 3 ways, and the 2-way refusal."""
    from minivllm_jax import LLM, SamplingParams

    prompts = ["The capital of France is", "Write a haiku about the sea.", "def fibonacci(n):"]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    settings = dict(
        ENGINE, max_model_len=256, num_pages=48, max_num_seqs=2, warmup=False
    )  # compiles what it runs
    out = {}
    for tp in (1, 3):
        llm = LLM("smollm2-135m", tensor_parallel_size=tp, **settings)
        out[f"tp{tp}"] = [
            o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)
        ]
        del llm
    try:
        LLM("smollm2-135m", tensor_parallel_size=2, **settings)
        out["tp2_error"] = None
    except ValueError as e:
        out["tp2_error"] = str(e)
    return out


def refusals(model: str) -> dict:
    from minivllm_jax import LLM

    errors = {}
    for name, kwargs in {
        "tp3": dict(tensor_parallel_size=3),
        "int8": dict(tensor_parallel_size=2, quantization="int8"),
        "too_many": dict(tensor_parallel_size=4, data_parallel_size=2),
    }.items():
        try:
            LLM(model, warmup=False, **kwargs, **ENGINE)
            errors[name] = None
        except ValueError as e:
            errors[name] = str(e)
    return errors


if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "engines":
        result = engines(args[0])
    elif mode == "hlo":
        result = hlo(args[0], int(args[1]))
    elif mode == "process":
        result = process(args[0], args[1], int(args[2]), int(args[3]))
    elif mode == "server":
        result = server(args[0])
    elif mode == "smollm2":
        result = smollm2()
    elif mode == "refusals":
        result = refusals(args[0])
    else:
        raise SystemExit(f"unknown mode {mode}")
    print("RESULT " + json.dumps(result), flush=True)
