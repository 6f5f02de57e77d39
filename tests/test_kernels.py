"""Native CPU kernels: built by the install (CI checks they are), equal to their pure-JAX
reference on random ragged batches, selected by the registry, and the engine on the native
attention keeps HF greedy parity and batch invariance."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minivllm_jax import LLM, SamplingParams, kernels
from minivllm_jax.ops.attention import get_attention, resolve_attention
from minivllm_jax.ops.batch import Chunk, build_step_batch
from minivllm_jax.ops.kv_cache import KVCache
from tests.conftest import in_ci, requires_smollm2

# (kv heads, group size, head_dim, page_size): GQA and MHA on small shapes (the general code
# path) and SmolLM2's shape (the fixed-shape path: head_dim 64, page_size 16).
SHAPES = [(2, 3, 16, 4), (4, 1, 16, 4), (3, 3, 64, 16), (1, 2, 128, 16)]


def test_a_failed_build_warns_keeps_the_library_and_leaves_nothing(monkeypatch, tmp_path, capsys):
    """A compiler that fails (here `false`) makes `build` print why and return False; the
    library it would have replaced and the folder's other files are untouched."""
    from minivllm_jax.kernels import build

    library = tmp_path / "_build" / "lib.so"
    library.parent.mkdir()
    library.write_bytes(b"old")
    monkeypatch.setattr(build, "LIBRARY", library)
    monkeypatch.setenv("CXX", "false")
    assert build.build(verbose=False) is False
    assert "building the native kernels failed" in capsys.readouterr().err
    assert library.read_bytes() == b"old" and list(library.parent.iterdir()) == [library]


def test_native_library_is_built_in_ci():
    """`make test` builds the kernels; under CI a missing library is an error, not a quiet
    fallback that would leave the native path untested."""
    if not in_ci() and not kernels.native_available():
        pytest.skip("native kernels not available (not built, or MINIVLLM_KERNELS=reference)")
    assert kernels.native_available()


def random_pages(rng, kvh, hd, ps, num_pages, layers, pages) -> KVCache:
    """Random float32 pages, or int8 pages with a random scale per token and kv head."""
    if pages == "float32":
        k_cache = rng.standard_normal((layers, num_pages, kvh, hd, ps)).astype(np.float32)
        v_cache = rng.standard_normal((layers, num_pages, kvh, ps, hd)).astype(np.float32)
        return KVCache(jnp.asarray(k_cache), jnp.asarray(v_cache))
    k_q = rng.integers(-127, 128, (layers, num_pages, kvh, hd, ps), dtype=np.int8)
    v_q = rng.integers(-127, 128, (layers, num_pages, kvh, ps, hd), dtype=np.int8)
    k_scale, v_scale = (
        rng.uniform(0.002, 0.02, (layers, num_pages, kvh, ps)).astype(np.float32) for _ in range(2)
    )
    return KVCache(*map(jnp.asarray, (k_q, v_q, k_scale, v_scale)))


def random_step(
    rng,
    kvh,
    g,
    hd,
    ps,
    specs,
    num_pages=160,
    layers=2,
    extra_tokens=5,
    extra_seqs=3,
    pages="float32",
):
    cache = random_pages(rng, kvh, hd, ps, num_pages, layers, pages)
    free = list(rng.permutation(np.arange(1, num_pages)))
    chunks = []
    for context, n in specs:
        pages = [int(free.pop()) for _ in range(-(-(context + n) // ps))]
        chunks.append(Chunk(rng.integers(0, 10, n).tolist(), context, pages))
    num_tokens = sum(n for _, n in specs) + extra_tokens
    listed = sum(-(-c // ps) for c, _ in specs) + 7
    batch = build_step_batch(chunks, ps, num_tokens, len(specs) + extra_seqs, listed)
    q = rng.standard_normal((num_tokens, kvh * g, hd)).astype(np.float32)
    k_new, v_new = (rng.standard_normal((num_tokens, kvh, hd)).astype(np.float32) for _ in range(2))
    return q, k_new, v_new, cache, batch


@pytest.mark.skipif(
    not kernels.native_available(),
    reason="native kernels not available (not built, or MINIVLLM_KERNELS=reference)",
)
@pytest.mark.parametrize("kvh,g,hd,ps", SHAPES)
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("decodes", ["many", "few"])
@pytest.mark.parametrize("pages", ["float32", "int8"])
def test_native_attention_equals_reference(kvh, g, hd, ps, seed, decodes, pages):
    """Random ragged steps: decodes at and around page boundaries, fresh prompts, chunks after
    cached context that span several blocks of new keys, padding tokens and padded sequences.
    With many decodes the kernel reads all kv heads of a sequence in one work item, with few
    one head per item: both must agree, on float32 pages and on int8 pages with scales."""
    rng = np.random.default_rng(seed)
    boundary = [(ps * k + d, 1) for k in (1, 3) for d in (-1, 0, 1)]
    if decodes == "few":
        boundary = boundary[1:3]
    specs = boundary + [
        (0, 1),
        (0, 7),
        (2 * ps, 37),
        (5 * ps + 1, 20),
        (int(rng.integers(1, 90)), 1),
        (0, 18),
    ]
    q, k_new, v_new, cache, batch = random_step(rng, kvh, g, hd, ps, specs, pages=pages)
    native, reference = jax.jit(get_attention("native")), jax.jit(get_attention("reference"))
    real = sum(n for _, n in specs)
    for layer in range(2):
        got = np.asarray(native(q, k_new, v_new, cache, jnp.int32(layer), batch))
        want = np.asarray(reference(q, k_new, v_new, cache, jnp.int32(layer), batch))
        np.testing.assert_allclose(got[:real], want[:real], rtol=1e-5, atol=1e-5)
        assert not np.any(got[real:])  # padding tokens give zeros


def test_registry_auto_and_forced_reference(monkeypatch):
    monkeypatch.delenv(kernels.FORCE_REFERENCE_ENV, raising=False)
    assert resolve_attention("auto") == ("native" if kernels.native_available() else "reference")
    assert resolve_attention("reference") == "reference"
    monkeypatch.setenv(kernels.FORCE_REFERENCE_ENV, "reference")
    assert resolve_attention("auto") == resolve_attention("native") == "reference"
    with pytest.raises(ValueError, match="unknown attention implementation 'flash'"):
        resolve_attention("flash")


def test_forced_reference_is_one_rule_for_attention_and_matmul(monkeypatch):
    """MINIVLLM_KERNELS=reference turns an explicit "native" into the reference for both ops
    (no raise, no custom call), and both say why with the same words."""
    from minivllm_jax.ops.matmul import matmul

    monkeypatch.setenv(kernels.FORCE_REFERENCE_ENV, "reference")
    reason = kernels.unavailable_reason()
    assert reason is not None and kernels.FORCE_REFERENCE_ENV in reason
    assert not kernels.native_available()
    assert resolve_attention("native") == "reference"
    x, w = jnp.ones((3, 64), jnp.float32), jnp.ones((64, 64), jnp.float32)
    forced = jax.jit(functools.partial(matmul, impl="native"))
    assert "custom_call" not in forced.lower(x, w).as_text()
    np.testing.assert_array_equal(np.asarray(forced(x, w)), np.full((3, 64), 64.0, np.float32))
    with pytest.raises(RuntimeError, match=f"{kernels.FORCE_REFERENCE_ENV}=reference forces"):
        kernels.require_native("matmul", "matmul='reference'")


@requires_smollm2
@pytest.mark.skipif(
    not kernels.native_available(),
    reason="native kernels not available (not built, or MINIVLLM_KERNELS=reference)",
)
def test_engine_on_native_attention_matches_hf_and_is_batch_invariant(smollm2_greedy):
    prompts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time, in a small village by the sea, there lived an old fisherman who " * 4,
        "Q: What is 2 + 2?\nA:",
    ]
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    llm = LLM(
        "smollm2-135m",
        max_num_seqs=4,
        max_model_len=256,
        max_num_batched_tokens=32,
        num_pages=64,
        attention="native",
        use_tqdm=False,
        warmup=False,
    )  # 32-token budget: the long prompt is chunked; compiles what it runs
    assert llm.engine.config.attention == "native"
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    alone = [llm.generate([p], greedy, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert batched == alone
    for prompt, ours in zip(prompts, batched):
        assert ours == smollm2_greedy(llm.tokenizer(prompt)["input_ids"], 32)[0], prompt


@pytest.mark.skipif(
    not kernels.native_available(),
    reason="native kernels not available (not built, or MINIVLLM_KERNELS=reference)",
)
@pytest.mark.parametrize(
    "scheme,group_size", [("int8", 32), ("int4", 32), ("int4", 64), ("int4", 128)]
)
@pytest.mark.parametrize("rows", [1, 3, 4, 6, 16, 64])
def test_native_quantized_matmul_equals_reference(scheme, group_size, rows):
    """Every row-pass size (1-4, and passes of 4 with a remainder), each scheme and int4 group."""
    from minivllm_jax.kernels.quantized_matmul import TARGETS
    from minivllm_jax.ops.matmul import matmul
    from minivllm_jax.ops.quantization import quantize_weight, to_panels

    rng = np.random.default_rng(rows)
    w = rng.standard_normal((256, 192)).astype(np.float32)
    p = to_panels(quantize_weight(w, scheme, group_size))  # the layout the kernel reads
    x = jnp.asarray(rng.standard_normal((rows, 256)).astype(np.float32))
    native = jax.jit(functools.partial(matmul, impl="native"))
    assert TARGETS[scheme] in native.lower(x, p).as_text()
    got = np.asarray(native(x, p))
    want = np.asarray(jax.jit(matmul)(x, p))  # the reference
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.skipif(
    not kernels.native_available(),
    reason="native kernels not available (not built, or MINIVLLM_KERNELS=reference)",
)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9])
@pytest.mark.parametrize("n_in,n_out", [(256, 192), (37, 64)])
def test_native_float_matmul_equals_reference(rows, n_in, n_out):
    """Every row-pass size (2-4, a pass of 4 and a remainder) of a float projection; one row, rows
    past the native limit and an output size that is not a multiple of 64 stay with XLA."""
    from minivllm_jax.kernels.float_matmul import MAX_NATIVE_ROWS
    from minivllm_jax.ops.matmul import matmul

    rng = np.random.default_rng(rows)
    w = jnp.asarray(rng.standard_normal((n_in, n_out)).astype(np.float32))
    x = jnp.asarray(rng.standard_normal((rows, n_in)).astype(np.float32))
    native = jax.jit(functools.partial(matmul, impl="native"))
    got, want = np.asarray(native(x, w)), np.asarray(x @ w)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    uses_kernel = "minivllm_matmul_f32" in native.lower(x, w).as_text()
    assert uses_kernel == (1 < rows <= MAX_NATIVE_ROWS)
    odd = w[:, :40]  # not a multiple of 64 columns: 'native' refuses it where it would run
    auto = jax.jit(functools.partial(matmul, impl="auto"))
    assert "minivllm_matmul_f32" not in auto.lower(x, odd).as_text()
    np.testing.assert_allclose(
        np.asarray(auto(x, odd)), want[:, :40], rtol=1e-5, atol=1e-5 * np.abs(want).max()
    )
    if uses_kernel:
        with pytest.raises(ValueError, match="matmul='native': .*multiple of 64"):
            matmul(x, odd, "native")


@pytest.mark.skipif(
    not kernels.native_available(),
    reason="native kernels not available (not built, or MINIVLLM_KERNELS=reference)",
)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9])
def test_native_transposed_float_matmul_equals_reference(rows):
    """A tied output head (`x @ embedding.T`) for every row-pass size; 1 row and rows past the
    native limit stay with XLA."""
    from minivllm_jax.kernels.float_matmul import MAX_NATIVE_ROWS
    from minivllm_jax.ops.matmul import head_matmul

    rng = np.random.default_rng(rows)
    w = jnp.asarray(rng.standard_normal((200, 96)).astype(np.float32))  # [vocab, hidden]
    x = jnp.asarray(rng.standard_normal((rows, 96)).astype(np.float32))
    native = jax.jit(functools.partial(head_matmul, transposed=True, impl="native"))
    got, want = np.asarray(native(x, w)), np.asarray(x @ w.T)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert ("minivllm_matmul_f32_t" in native.lower(x, w).as_text()) == (
        1 < rows <= MAX_NATIVE_ROWS
    )


@requires_smollm2
@pytest.mark.skipif(
    not kernels.native_available(),
    reason="native kernels not available (not built, or MINIVLLM_KERNELS=reference)",
)
def test_engine_quantized_native_matmul_matches_reference_matmul(monkeypatch):
    """SmolLM2 on int4 (its own Q4_1 grid) through the engine: the native matmul gives the
    reference's greedy tokens (int8 has the same code path; its kernel is checked above)."""
    outs = {}
    for impl in ("native", "reference"):
        if impl == "reference":
            monkeypatch.setenv(kernels.FORCE_REFERENCE_ENV, "reference")
        llm = LLM(
            "smollm2-135m",
            quantization="int4",
            max_num_seqs=2,
            max_model_len=128,
            max_num_batched_tokens=32,
            use_tqdm=False,
            warmup=False,
        )  # compiles what it runs
        assert llm.engine.runner.matmul == ("auto" if impl == "native" else impl)
        prompts = ["The capital of France is", "def fibonacci(n):"]
        res = llm.generate(
            prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False
        )
        outs[impl] = [o.outputs[0].token_ids for o in res]
        monkeypatch.delenv(kernels.FORCE_REFERENCE_ENV, raising=False)
    assert outs["native"] == outs["reference"]
