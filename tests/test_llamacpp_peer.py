"""The llama.cpp benchmark peer: the F32/F16 GGUF copies of the shipped Q4_1 weights (no
llama_cpp needed), the skip reasons, and, when llama_cpp is installed, its batched runs."""

from __future__ import annotations

import argparse
import sys

import numpy as np
import pytest

from benchmarks.lib import peers
from minivllm_jax.loading.reader import read_checkpoint
from tests.conftest import make_tiny_llama, requires_smollm2
from tests.test_convert import write_tiny_gguf

has_llama_cpp = pytest.mark.skipif(not peers.available()[0], reason=peers.INSTALL_HINT)


def _leaves(params) -> dict:
    import jax

    return {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(params)}


@requires_smollm2
def test_f32_gguf_loads_to_the_same_params_as_q4_1(tmp_path):
    import gguf

    src = peers.source_gguf("smollm2-135m")
    dst = peers.write_dequantized_gguf(src, tmp_path / "m-F32.gguf", "f32")
    reader, copy = gguf.GGUFReader(str(src)), gguf.GGUFReader(str(dst))
    assert {t.tensor_type.name for t in copy.tensors} == {"F32"}
    assert copy.fields["general.file_type"].contents() == gguf.LlamaFileType.ALL_F32
    for key in (
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.merges",
        "tokenizer.chat_template",
        "llama.rope.freq_base",
    ):
        assert copy.fields[key].contents() == reader.fields[key].contents(), key
    want_cfg, want = read_checkpoint(src, progress=False)
    got_cfg, got = read_checkpoint(dst, progress=False)
    assert got_cfg == want_cfg
    want, got = _leaves(want), _leaves(got)
    assert want.keys() == got.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_f16_gguf_keeps_norms_f32(tmp_path):
    import gguf

    src = write_tiny_gguf(make_tiny_llama(tmp_path / "hf", seed=5), tmp_path / "tiny.gguf")
    dst = peers.write_dequantized_gguf(src, tmp_path / "tiny-F16.gguf", "f16")
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(dst)).tensors}
    assert types["blk.0.attn_norm.weight"] == "F32" and types["blk.0.attn_q.weight"] == "F16"
    want, got = (
        _leaves(read_checkpoint(src, progress=False)[1]),
        _leaves(read_checkpoint(dst, progress=False)[1]),
    )
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-3, atol=1e-4, err_msg=name)
    with pytest.raises(ValueError, match="f16 or f32"):
        peers.write_dequantized_gguf(src, tmp_path / "x.gguf", "q8_0")


def test_dequantized_gguf_is_cached(tmp_path):
    src = write_tiny_gguf(make_tiny_llama(tmp_path / "hf", seed=6), tmp_path / "tiny.gguf")
    first = peers.dequantized_gguf(src, "f32", cache_dir=tmp_path / "cache")
    mtime = first.stat().st_mtime_ns
    assert peers.dequantized_gguf(src, "f32", cache_dir=tmp_path / "cache") == first
    assert first.stat().st_mtime_ns == mtime and first.name.endswith("-F32.gguf")


def _peer_args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--model")
    peers.add_peer_args(p)
    return p.parse_args(argv)


def test_peer_skip_reasons(tmp_path, monkeypatch):
    assert peers.peer_models(_peer_args("--model", "x", "--no-llamacpp")) == (
        {},
        "--no-llamacpp",
    )
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # as if not installed
    paths, why = peers.peer_models(_peer_args("--model", str(tmp_path)))
    assert paths == {} and "pip install -e '.[peer]' or make bench" in why
    with pytest.raises(RuntimeError, match=r"pip install -e '\.\[peer\]' or make bench"):
        peers.LlamaCppPeer(tmp_path / "m.gguf")


@has_llama_cpp
def test_peer_skips_non_gguf_models(tmp_path):
    paths, why = peers.peer_models(_peer_args("--model", str(tmp_path)))
    assert paths == {} and "is not a GGUF model" in why


@has_llama_cpp
@requires_smollm2
def test_batched_run_gives_exact_lengths_and_batch1_tokens():
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 10000, size=n).tolist() for n in (5, 40, 12)]
    lens = [6, 3, 9]
    # One thread: ggml's spinning thread barrier crawls when the test shares the cores.
    with peers.LlamaCppPeer(peers.source_gguf("smollm2-135m"), threads=1) as peer:
        batched = peer.run(prompts, lens, n_parallel=2)
        single = [peer.run([p], [n], n_parallel=1).token_ids[0] for p, n in zip(prompts, lens)]
    assert [len(t) for t in batched.token_ids] == lens and [
        len(t) for t in batched.token_times
    ] == lens
    # Batched and single runs take different matmul paths; greedy tokens still start the same.
    assert [t[0] for t in batched.token_ids] == [t[0] for t in single]
    assert all(peers.common_prefix(a, b) >= 2 for a, b in zip(batched.token_ids, single))
