"""The native kernels give the same bits however their work is split between threads.

Each kernel spreads its work over XLA's CPU thread pool (`kernels/parallel.h`), and which thread
takes which run of items depends on timing and on the pool's size. The result must not: every
output element is summed by one work item, over its reduction axis in a fixed order, so it is the
same float whichever thread computed it. This runs every FFI target on fixed inputs in pools of 1
and 7 threads (`PJRT_NPROC` sizes XLA's CPU pool; 7 on fewer cores still splits the work 7 ways)
and in this process's own pool 20 times over, and wants identical bits every time. Inputs are
random bytes in each kernel's layout: the bits are the point here, not their meaning (the
kernels' values are `test_kernels.py`'s and `test_quantization.py`'s)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from minivllm_jax import kernels

pytestmark = pytest.mark.skipif(
    not kernels.native_available(),
    reason="native kernels not available (not built, or MINIVLLM_KERNELS=reference)",
)

ROOT = Path(__file__).resolve().parents[1]
ROWS = (1, 3, 37, 200)  # one row, a part pass, several passes, several 96-row w8a8 tiles


def kernel_inputs() -> dict[str, tuple[tuple[int, ...], list[np.ndarray]]]:
    """FFI target -> (output shape, its arguments), for several row counts each; fixed seed."""
    rng = np.random.default_rng(0)
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    s8 = lambda *s: rng.integers(-127, 128, s).astype(np.int8)  # noqa: E731
    n_in, n_out, groups = 192, 320, 6  # 5 panels of 64 columns; int4 groups of 32
    cases = {}
    for t in ROWS:
        x = f32(t, n_in)
        cases[f"minivllm_matmul_f32/{t}"] = ((t, n_out), [x, f32(n_in, n_out)])
        cases[f"minivllm_matmul_f32_t/{t}"] = ((t, n_out), [x, f32(n_out, n_in)])
        cases[f"minivllm_matmul_int8_f32/{t}"] = (
            (t, n_out),
            [x, s8(n_out // 64, n_in, 64), f32(n_out) * 0.01],
        )
        cases[f"minivllm_matmul_int4_f32/{t}"] = (
            (t, n_out),
            [
                x,
                rng.integers(0, 256, (n_out // 64, n_in // 2, 64)).astype(np.uint8),
                f32(n_out // 64, groups, 2, 64) * 0.01,
            ],
        )
        cases[f"minivllm_matmul_w8a8_f32/{t}"] = (
            (t, n_out),
            [x, s8(-(-n_out // 64), n_in // 4, 256), np.abs(f32(n_out)) * 0.01],
        )
    # Attention: a long prompt chunk after cached pages (many query tiles), decodes of 9
    # sequences (heads grouped), and a mixed batch, over float32 and int8 pages.
    L, P, kvh, g, hd, ps = 2, 64, 2, 3, 16, 8
    seqs = [(70, 13), *[(1, 9 + 5 * i) for i in range(9)]]  # (new tokens, cached tokens)
    T = sum(n for n, _ in seqs)
    query_start = np.cumsum([0] + [n for n, _ in seqs[:-1]]).astype(np.int32)
    n_pages = [-(-(c + n) // ps) for n, c in seqs]
    page_start = np.cumsum([0] + n_pages[:-1]).astype(np.int32)
    page_ids = rng.permutation(P)[: sum(n_pages)].astype(np.int32)
    batch = [
        np.array([1], np.int32),  # layer
        query_start,
        np.array([n for n, _ in seqs], np.int32),
        np.array([c for _, c in seqs], np.int32),
        page_start,
        page_ids,
    ]
    q, k_new, v_new = f32(T, kvh * g, hd), f32(T, kvh, hd), f32(T, kvh, hd)
    cases["minivllm_ragged_paged_attention_f32"] = (
        (T, kvh * g, hd),
        [q, k_new, v_new, f32(L, P, kvh, hd, ps), f32(L, P, kvh, ps, hd), *batch],
    )
    cases["minivllm_ragged_paged_attention_int8kv"] = (
        (T, kvh * g, hd),
        [
            q,
            k_new,
            v_new,
            s8(L, P, kvh, hd, ps),
            s8(L, P, kvh, ps, hd),
            np.abs(f32(L, P, kvh, ps)) * 0.02,
            np.abs(f32(L, P, kvh, ps)) * 0.02,
            *batch,
        ],
    )
    return cases


def run_kernels(repeats: int = 1) -> dict[str, np.ndarray]:
    """Every case's output; with `repeats` > 1, a ValueError unless every run gave the same bits."""
    import jax

    assert kernels.native_available()
    out = {}
    for name, (shape, args) in kernel_inputs().items():
        call = jax.jit(
            jax.ffi.ffi_call(name.split("/")[0], jax.ShapeDtypeStruct(shape, np.float32))
        )
        first = np.asarray(call(*args))
        for _ in range(repeats - 1):
            again = np.asarray(call(*args))
            if not np.array_equal(first.view(np.uint32), again.view(np.uint32)):
                raise ValueError(f"{name}: two runs in one process gave different bits")
        out[name] = first
    return out


CHILD = """
import sys
import numpy as np
from tests.test_kernel_determinism import run_kernels
np.savez(sys.argv[1], **{k.replace("/", "@"): v for k, v in run_kernels().items()})
"""


@pytest.fixture(scope="module")
def here() -> dict[str, np.ndarray]:
    """This process's results (XLA's pool: a thread per core), each the same in 20 runs: the
    dynamic split differs from run to run."""
    return run_kernels(repeats=20)


@pytest.mark.parametrize("threads", [1, 7])
def test_kernels_give_the_same_bits_with_any_number_of_threads(threads, here, tmp_path):
    env = {**os.environ, "PJRT_NPROC": str(threads), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path / "out.npz")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with np.load(tmp_path / "out.npz") as there:
        assert sorted(there.files) == sorted(k.replace("/", "@") for k in here)
        for name, ours in here.items():
            theirs = there[name.replace("/", "@")]
            assert np.isfinite(ours).all() and np.abs(ours).max() > 0, name  # a real result
            np.testing.assert_array_equal(ours.view(np.uint32), theirs.view(np.uint32), name)
