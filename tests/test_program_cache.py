"""The whole-program cache: a warm start loads every step program instead of tracing it, the
loaded programs compute the same tokens, and a bad file is a miss (recompiled), never a crash."""

from __future__ import annotations

import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minivllm_jax import LLM, SamplingParams, kernels
from minivllm_jax.engine.compilation import ProgramCache, program_key


def _scale_and_add(x, y, *, factor):
    return x * factor + y, x.sum()


scale_and_add = jax.jit(_scale_and_add, static_argnames=("factor",), donate_argnames=("y",))


def _args(n: int = 8):
    return (jnp.arange(n, dtype=jnp.float32), jnp.ones(n, jnp.float32))


def test_stored_program_loads_and_computes_the_same(tmp_path):
    first, loaded = ProgramCache(tmp_path).load_or_compile(
        ("f",), scale_and_add, _args(), {"factor": 3.0}
    )
    assert not loaded and len(list(tmp_path.glob("*.program"))) == 1
    again, loaded = ProgramCache(tmp_path).load_or_compile(
        ("f",), scale_and_add, _args(), {"factor": 3.0}
    )
    assert loaded
    for out_a, out_b in zip(first(*_args()), again(*_args())):
        np.testing.assert_array_equal(out_a, out_b)
    np.testing.assert_array_equal(again(*_args())[0], np.arange(8) * 3.0 + 1)


def test_donation_survives_the_round_trip(tmp_path):
    ProgramCache(tmp_path).load_or_compile(("f",), scale_and_add, _args(), {"factor": 2.0})
    program, loaded = ProgramCache(tmp_path).load_or_compile(
        ("f",), scale_and_add, _args(), {"factor": 2.0}
    )
    x, y = _args()
    assert loaded
    program(x, y)
    assert y.is_deleted() and not x.is_deleted()


def test_key_separates_shapes_statics_and_names():
    base = program_key(("f",), _args(8), {"factor": 2.0})
    assert base == program_key(("f",), _args(8), {"factor": 2.0})
    assert base != program_key(("f",), _args(16), {"factor": 2.0})
    assert base != program_key(("f",), _args(8), {"factor": 3.0})
    assert base != program_key(("g",), _args(8), {"factor": 2.0})
    as_int = (jnp.arange(8, dtype=jnp.int32), jnp.ones(8, jnp.float32))
    assert base != program_key(("f",), as_int, {"factor": 2.0})


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_corrupt_file_is_a_logged_miss(tmp_path, caplog, damage):
    ProgramCache(tmp_path).load_or_compile(("f",), scale_and_add, _args(), {"factor": 2.0})
    (path,) = tmp_path.glob("*.program")
    blob = bytearray(path.read_bytes())
    if damage == "truncate":
        blob = blob[: len(blob) // 2]
    else:
        blob[len(blob) // 2] ^= 0xFF
    path.write_bytes(bytes(blob))
    with caplog.at_level(logging.WARNING, logger="minivllm_jax.engine.compilation"):
        program, loaded = ProgramCache(tmp_path).load_or_compile(
            ("f",), scale_and_add, _args(), {"factor": 2.0}
        )
    assert not loaded and "checksum mismatch" in caplog.text
    np.testing.assert_array_equal(program(*_args())[0], np.arange(8) * 2.0 + 1)
    assert ProgramCache(tmp_path).load_or_compile(("f",), scale_and_add, _args(), {"factor": 2.0})[
        1
    ]  # rewritten


def test_without_a_directory_it_only_compiles(tmp_path):
    program, loaded = ProgramCache(None).load_or_compile(
        ("f",), scale_and_add, _args(), {"factor": 2.0}
    )
    assert not loaded
    np.testing.assert_array_equal(program(*_args())[0], np.arange(8) * 2.0 + 1)


@pytest.mark.parametrize("attention", ["reference", "native"])
def test_engine_warm_start_loads_every_program(tiny_model_with_tokenizer, tmp_path, attention):
    """A second LLM over the same cache folder loads all its programs (none traced) and gives
    the same greedy and seeded tokens as the first, which compiled them. With the native
    attention too: its kernels must be registered before a program that calls them loads."""
    if attention == "native" and not kernels.native_available():
        pytest.skip("native kernels not available (not built, or MINIVLLM_KERNELS=reference)")
    kwargs = dict(
        max_num_seqs=4,
        max_model_len=128,
        max_num_batched_tokens=32,  # six step programs, not ten: what a start does is the same
        num_pages=24,
        use_tqdm=False,
        compilation_cache_dir=str(tmp_path),
        attention=attention,
    )
    prompts = [[5, 6, 7, 8, 9], list(range(10, 40))]
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True),
    ]
    cold = LLM(str(tiny_model_with_tokenizer), **kwargs)
    assert cold.engine.stats().programs_loaded == 0 and cold.engine.stats().compiles > 0
    expected = [o.outputs[0].token_ids for o in cold.generate(prompts, params, use_tqdm=False)]
    warm = LLM(str(tiny_model_with_tokenizer), **kwargs)
    assert (
        warm.engine.stats().programs_loaded
        == warm.engine.stats().compiles
        == cold.engine.stats().compiles
    )
    assert [
        o.outputs[0].token_ids for o in warm.generate(prompts, params, use_tqdm=False)
    ] == expected
    assert (
        warm.engine.stats().compiles == cold.engine.stats().compiles
    )  # nothing compiled after warm-up


XLA_CACHE_SCRIPT = """
import sys, jax, jax.numpy as jnp
from minivllm_jax.engine.compilation import ProgramCache
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
f = jax.jit(lambda x: jnp.cumsum(x * jnp.arange(x.shape[0])) + jnp.sort(x))
x = jnp.ones(100)
if sys.argv[2] == "xla-only":
    f.lower(x).compile()
else:
    program, loaded = ProgramCache(sys.argv[3]).load_or_compile(("f",), f, (x,), {})
    print(loaded, float(program(x)[-1]))
"""


def test_program_from_xlas_cache_is_used_not_stored(tmp_path):
    """An executable XLA loaded from its own persistent cache has lost its kernels when
    serialized again (it fails when run), so if a user turned that cache on, a program it
    served runs but is never stored; one compiled afresh is stored."""
    import subprocess
    import sys

    def run(*argv: str) -> str:
        cmd = [sys.executable, "-c", XLA_CACHE_SCRIPT, str(tmp_path / "xla"), *argv]
        proc = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "JAX_PLATFORMS": "cpu"},
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stdout.split()

    fresh = tmp_path / "fresh"
    run("xla-only", "")  # XLA's cache now holds f
    assert run("program-cache", str(tmp_path / "programs")) == ["False", "4951.0"]
    assert (
        list((tmp_path / "programs").glob("*.program")) == []
    )  # came from XLA's cache: not stored
    (tmp_path / "xla").rename(tmp_path / "xla-old")  # now XLA compiles it afresh: stored, and loads
    assert run("program-cache", str(fresh)) == ["False", "4951.0"]
    assert run("program-cache", str(fresh)) == ["True", "4951.0"]
