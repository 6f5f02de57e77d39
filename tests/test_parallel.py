"""Scale-out on JAX's runtime (`minivllm_jax.parallel.sharding`, `minivllm_jax.parallel.distributed`, the router):
tensor parallelism, data parallelism and several processes give the same greedy tokens as one
device, with zero recompiles, and refuse what they cannot split.

Several devices need a fresh JAX, so those tests run `tests/parallel_worker.py` in a
subprocess: 4 virtual CPU devices (`--xla_force_host_platform_device_count`), or two
processes joined by `jax.distributed` over 127.0.0.1 (gloo collectives)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from minivllm_jax.config import ModelConfig
from minivllm_jax.engine.router import PrefixRouter
from minivllm_jax.parallel.sharding import (
    check_tensor_parallel,
    kv_replicas,
    local_config,
    stored_config,
)
from tests.conftest import (
    make_tiny_llama,
    requires_smollm2,
    save_tiny_tokenizer,
    xla_flags_with_host_devices,
)

WORKER = Path(__file__).with_name("parallel_worker.py")
ROOT = WORKER.parents[1]


def run_worker(*args: str, devices: int = 4, env: dict | None = None, timeout: float = 600) -> dict:
    environ = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": xla_flags_with_host_devices(devices),
        "PYTHONPATH": str(ROOT),
        **(env or {}),
    }
    proc = subprocess.run(
        [sys.executable, str(WORKER), *args],
        capture_output=True,
        text=True,
        env=environ,
        timeout=timeout,
        cwd=ROOT,
    )
    return _result(proc.returncode, proc.stdout, proc.stderr)


def _result(returncode: int, stdout: str, stderr: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert returncode == 0 and lines, (
        f"worker failed ({returncode}):\n{stdout[-3000:]}\n{stderr[-5000:]}"
    )
    return json.loads(lines[-1][len("RESULT ") :])


@pytest.fixture(scope="module")
def gqa_model(tmp_path_factory) -> str:
    """8 query heads over 2 KV heads: TP=4 has fewer KV heads than devices."""
    path = tmp_path_factory.mktemp("tp") / "tiny-gqa"
    make_tiny_llama(path, num_attention_heads=8, num_key_value_heads=2)
    save_tiny_tokenizer(path)
    return str(path)


def smollm2_config() -> ModelConfig:
    return ModelConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=1e5,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    )


# ------------------------------------------------------------------------ host-side units


def test_sizes_that_do_not_divide_the_heads_are_refused_naming_those_that_do():
    cfg = smollm2_config()
    check_tensor_parallel(cfg, 3)  # 3 query heads and 1 KV head a device
    with pytest.raises(
        ValueError,
        match=r"tensor_parallel_size=2 does not divide num_attention_heads=9.*splits \[1, 3\] ways",
    ):
        check_tensor_parallel(cfg, 2)
    with pytest.raises(
        ValueError, match="intermediate_size=1536"
    ):  # 9 divides the heads, not the MLP
        check_tensor_parallel(cfg, 9)


def test_fewer_kv_heads_than_devices_repeats_each_kv_head():
    cfg = ModelConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=8,
        num_kv_heads=2,
        head_dim=8,
        rms_norm_eps=1e-5,
        rope_theta=1e4,
        max_position_embeddings=512,
    )
    assert kv_replicas(cfg, 2) == 1 and kv_replicas(cfg, 4) == 2 and kv_replicas(cfg, 8) == 4
    stored = stored_config(cfg, 4)
    assert stored.num_kv_heads == 4
    local = local_config(stored, 4)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (2, 1, 32)
    with pytest.raises(ValueError, match="num_key_value_heads=2"):
        check_tensor_parallel(dict_replace(cfg, num_heads=6), 3)


def dict_replace(cfg: ModelConfig, **kw) -> ModelConfig:
    import dataclasses

    return dataclasses.replace(cfg, **kw)


def test_router_keeps_a_prefix_on_its_replica_and_balances_the_rest():
    router = PrefixRouter(2, page_size=4, slack=2)
    system = list(range(100, 112))  # three full pages
    first = router.pick(system + [1, 2], [0, 0])
    assert first == 0  # least loaded, lowest index
    # The same prefix follows its replica even when the other is a little less loaded ...
    assert router.pick(system + [7, 8, 9], [1, 0]) == 0
    # ... but not when it is much busier (beyond the slack): then the least loaded takes it.
    assert router.pick(system + [5], [5, 0]) == 1
    assert router.pick(system + [6], [5, 5]) == 1  # and now that replica owns the prefix
    # No shared full page: least loaded.
    assert router.pick([1, 2, 3], [3, 1]) == 1
    assert router.num_prefix_routed == 2 and router.num_load_routed == 3


def test_more_devices_than_exist_is_a_clear_error():
    from minivllm_jax.llm import replica_meshes

    with pytest.raises(
        ValueError, match="needs 2 devices; 1 cpu device.*xla_force_host_platform_device_count"
    ):
        replica_meshes(2, 1)
    with pytest.raises(ValueError, match="data_parallel_size must be >= 1"):
        replica_meshes(1, 0)


# ------------------------------------------------------------------- several devices (subprocess)


def test_tensor_and_data_parallel_greedy_tokens_equal_one_device(gqa_model):
    """TP=4 (KV heads repeated), DP=2 (one device each), TP=2 x DP=2: the same greedy tokens as
    one device, nothing compiled after warm-up, each replica on its own devices."""
    result = run_worker("engines", gqa_model)
    reference = result["1x1"]["tokens"]
    assert len(reference) == 5 and all(len(t) == 16 for t in reference)
    for name, run in result.items():
        assert run["tokens"] == reference, name
        assert run["compiles_after"] == run["warm_compiles"], f"{name} compiled after warm-up"
    assert result["4x1"]["cache_devices"] == [[0, 1, 2, 3]]
    assert result["1x2"]["cache_devices"] == [[0], [1]]
    assert result["2x2"]["cache_devices"] == [[0, 1], [2, 3]]
    for name in ("1x2", "2x2"):  # the router spread the 5 requests over both replicas
        assert sorted(result[name]["requests_per_replica"]) == [2, 3], name


def test_tensor_parallel_step_has_two_all_reduces_a_layer(gqa_model):
    """The compiled TP=2 decode step's collectives, against the Megatron count: per layer one
    all-reduce after o_proj and one after down_proj (a token's hidden vector each), one for the
    vocabulary-split embedding lookup, and one all-gather of the vocabulary-split logits."""
    result = run_worker("hlo", gqa_model, "2")
    measured, expected = result["measured"], result["expected"]
    assert (
        measured["all-reduce"]["count"] == expected["all-reduce"]["count"] == 2 * 2 + 1
    )  # 2 layers
    assert (
        measured["all-reduce"]["bytes_each"] == [expected["all-reduce"]["bytes_each"]] == [64 * 4]
    )
    assert measured["all-gather"]["count"] == expected["all-gather"]["count"] == 1
    assert (
        measured["all-gather"]["bytes_each"] == [expected["all-gather"]["bytes_each"]] == [128 * 4]
    )
    for op in ("reduce-scatter", "all-to-all", "collective-permute"):
        assert measured[op]["count"] == 0, op


def test_what_tensor_parallelism_refuses(gqa_model):
    errors = run_worker("refusals", gqa_model)
    assert "tensor_parallel_size=3 does not divide num_attention_heads=8" in errors["tp3"]
    assert "quantized weights cannot be split over devices" in errors["int8"]
    assert "needs 8 devices; 4 cpu device(s)" in errors["too_many"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_generate_the_tokens_of_one(gqa_model):
    """Two processes with one CPU device each, joined by jax.distributed on 127.0.0.1: process 0
    schedules, process 1 follows; TP=2 over both gives one process's greedy tokens."""
    from minivllm_jax import LLM

    coordinator = f"127.0.0.1:{_free_port()}"
    environ = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": xla_flags_with_host_devices(1),
        "PYTHONPATH": str(ROOT),
    }
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), "process", gqa_model, coordinator, "2", str(pid)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=environ,
            cwd=ROOT,
        )
        for pid in (0, 1)
    ]
    try:
        outputs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    leader, follower = (_result(p.returncode, out, err) for p, (out, err) in zip(procs, outputs))
    assert follower == {"followed": True, "devices": 2}
    assert leader["devices"] == 2

    from tests.parallel_worker import ENGINE, greedy

    assert leader["tokens"] == greedy(LLM(gqa_model, warmup=False, **ENGINE))


@pytest.mark.slow
@requires_smollm2
def test_smollm2_tensor_parallel_3_equals_one_device():
    """The shipped model split 3 ways (3 query heads and 1 KV head a device, vocabulary in
    thirds): greedy tokens identical to one device; 2 ways is refused."""
    result = run_worker("smollm2", devices=3)
    assert result["tp3"] == result["tp1"]
    assert "splits [1, 3] ways" in result["tp2_error"]


def test_server_over_two_replicas_answers_like_one_engine(gqa_model):
    """`/v1/completions` over DP=2: the same greedy text as `LLM.generate`, both replicas used,
    /metrics counting both replicas' programs."""
    result = run_worker("server", gqa_model)
    assert result["status"] == [200] * 5
    assert result["texts"] == result["reference"]
    assert all(n > 0 for n in result["tokens_per_replica"])
    (line,) = [m for m in result["metrics_compiles"] if m.startswith("minivllm_compiles_total ")]
    assert float(line.split()[-1]) == 12  # 6 programs a replica
