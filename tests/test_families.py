"""Every model family (`minivllm_jax.models.registry`) against HF transformers in float32, on
tiny random models saved with `save_pretrained` (`benchmarks.quality.family_parity.make_tiny_family`:
GQA, head_dim 16, windows of 8 tokens, prompts several windows long): logits over a prompt and
over a chunk after cached pages, 32 greedy tokens, and prompts of different lengths batched
through `LLM` over pages of 4. Each family feature is shown to change HF's logits first (`controls`), so a
match proves it is implemented, not that it did not matter. Plus the config readers (4.x and
5.x layouts), the registry's errors, and the native attention refused where it would be wrong."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.lib.peers import hf_generate
from benchmarks.quality.family_parity import (
    FAMILIES,
    GREEDY_TOKENS,
    LOGIT_TOLERANCE,
    PAGE_SIZE,
    PROMPT_LEN,
    TINY,
    hf_logits,
    make_tiny_family,
    our_logits,
)
from convert import read_checkpoint
from minivllm_jax import LLM, SamplingParams, kernels
from minivllm_jax.config import KVCompressionConfig, ModelConfig, UnsupportedModelError
from minivllm_jax.engine.step import StepSpec, forward_jit
from minivllm_jax.models.hf_config import config_from_hf
from minivllm_jax.models.params import unstack_layers
from minivllm_jax.models.registry import families, supported_architectures
from minivllm_jax.ops.attention import resolve_attention
from minivllm_jax.ops.batch import single_sequence_batch
from minivllm_jax.ops.kv_cache import init_kv_cache
from minivllm_jax.reference.greedy import greedy_generate
from tests.conftest import save_tiny_tokenizer, xla_flags_with_host_devices

VOCAB = TINY["vocab_size"]
NEW_FAMILIES = [name for name in FAMILIES if name != "llama"]  # Llama has its own test files
ENGINE_PROMPT_LENS = (
    5,
    19,
    27,
    12,
)  # one prefill step (64 tokens), then 4-row decodes: two programs
MAX_LEN = 80
ROOT = Path(__file__).resolve().parents[1]
# The families whose tiny models attend plainly (no window, soft-capping or other scale), as
# FAMILIES builds them: the native kernel serves these, the reference the others. Named here,
# not derived from the config under test, so a reader that loses a feature fails.
PLAIN_ATTENTION = {"qwen2", "qwen3"}


def hf_greedy(model, ids, n: int) -> list[int]:
    """HF `generate`'s `n` greedy tokens after `ids` (no EOS stop)."""
    ids = [int(t) for t in ids]
    return hf_generate(model, [ids], n)[0, len(ids) :].tolist()


@pytest.fixture(scope="module", params=NEW_FAMILIES)
def family(request, tmp_path_factory):
    """(name, HF model, saved folder with a tokenizer, ModelConfig, params as converted and
    served)."""
    name = request.param
    path = tmp_path_factory.mktemp(name) / "hf"
    model = make_tiny_family(name, path)
    save_tiny_tokenizer(path, vocab_size=VOCAB)
    hf_config, params = read_checkpoint(path, progress=False)
    return name, model, path, config_from_hf(hf_config), unstack_layers(params)


def test_config_matches_hf_modules(family):
    """The family, head_dim, scale and per-layer windows, as HF's own attention modules hold them."""
    name, model, _, cfg, _ = family
    assert cfg.family == name.split("-")[0]
    assert cfg.head_dim == model.config.head_dim == 16 and cfg.num_kv_heads == 2
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        # HF's Mistral reads the window from its config in forward, for every layer.
        window = getattr(
            attn, "sliding_window", model.config.sliding_window if name == "mistral" else None
        )
        assert (cfg.layer_windows[i] if cfg.layer_windows else 0) == (window or 0)
        assert cfg.attention_scale == pytest.approx(attn.scaling, rel=1e-12)
    if name == "gemma3":
        assert cfg.layer_windows == (8, 8, 8, 8, 8, 0)  # five local layers to one global
        assert (cfg.local_rope_theta, cfg.rope_scaling) == (100.0, ("linear", (("factor", 4.0),)))


@pytest.mark.parametrize(
    "name, feature", [(n, f) for n in NEW_FAMILIES for f in FAMILIES[n].controls]
)
def test_each_feature_changes_hf_logits(name, feature):
    """Turning a family feature off changes HF's logits far beyond the parity tolerance, so the
    parity tests below would fail if we did not implement it (HF only: no compiles)."""
    ids = np.random.default_rng(1).integers(3, VOCAB, PROMPT_LEN)
    with_it = make_tiny_family(name)
    without = make_tiny_family(name, **FAMILIES[name].controls[feature])
    without.load_state_dict(with_it.state_dict())
    assert np.abs(hf_logits(with_it, ids) - hf_logits(without, ids)).max() > 100 * LOGIT_TOLERANCE


def test_logits_match_hf(family):
    """Every position of a prompt five windows long, in one prefill over shuffled pages; then a
    chunk and decodes over the cache it wrote (windows that end inside cached pages)."""
    _, model, _, cfg, params = family
    ids = np.random.default_rng(1).integers(3, VOCAB, PROMPT_LEN)
    ref = hf_logits(model, ids)
    np.testing.assert_allclose(our_logits(params, cfg, ids), ref, atol=LOGIT_TOLERANCE, rtol=0)
    pages = [5, 2, 9, 3, 7, 4, 1, 6, 8, 10]
    cache = init_kv_cache(cfg, num_pages=11, page_size=PAGE_SIZE, dtype=jnp.float32)
    logits, cache = forward_jit(
        params, cache, single_sequence_batch(ids[:13], 0, pages, PAGE_SIZE), StepSpec(cfg)
    )
    logits, cache = forward_jit(
        params, cache, single_sequence_batch(ids[13:30], 13, pages, PAGE_SIZE), StepSpec(cfg)
    )
    np.testing.assert_allclose(np.asarray(logits[0]), ref[29], atol=LOGIT_TOLERANCE, rtol=0)
    for t in range(30, 34):
        logits, cache = forward_jit(
            params, cache, single_sequence_batch(ids[t : t + 1], t, pages, PAGE_SIZE), StepSpec(cfg)
        )
        np.testing.assert_allclose(np.asarray(logits[0]), ref[t], atol=LOGIT_TOLERANCE, rtol=0)


def test_parity_script_quick(tmp_path):
    """`benchmarks/quality/family_parity.py --quick` (the README's parity table, Gemma 3 only) exits 0
    and records a passing row."""
    from benchmarks.quality import family_parity

    assert family_parity.main(["--quick", "--out", str(tmp_path / "parity.json")]) == 0
    (row,) = json.loads((tmp_path / "parity.json").read_text())["rows"]
    assert row["family"] == row["registry_family"] == "gemma3" and row["greedy_tokens_identical"]
    assert row["max_abs_logit_diff"] <= LOGIT_TOLERANCE and row["engine_attention"] == "reference"


def test_greedy_32_tokens_match_hf_generate(family):
    _, model, _, cfg, params = family
    prompt = np.random.default_rng(2).integers(3, VOCAB, 11).tolist()
    ours = greedy_generate(params, cfg, prompt, GREEDY_TOKENS, page_size=PAGE_SIZE)
    assert ours == hf_greedy(model, prompt, GREEDY_TOKENS)


@pytest.fixture(scope="module")
def llm(family, tmp_path_factory):
    """`LLM` on the saved HF folder: pages of 4, compiling only the steps it runs (the prompt
    chunks after cached tokens are `test_logits_match_hf`'s). Conversions go to a private cache."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MINIVLLM_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        yield LLM(
            str(family[2]),
            max_num_seqs=4,
            max_model_len=MAX_LEN,
            page_size=PAGE_SIZE,
            num_pages=1 + 4 * MAX_LEN // PAGE_SIZE,
            max_num_batched_tokens=64,
            warmup=False,
            use_tqdm=False,
        )


def test_engine_batched_prompts_match_hf(family, llm):
    """Prompts of different lengths at once through the engine: each one's 32 greedy tokens are
    HF `generate`'s for that prompt alone. The engine picks the reference attention for a model
    whose attention the native kernel lacks."""
    name, model, _, cfg, _ = family
    native = name in PLAIN_ATTENTION and kernels.native_available()
    assert llm.engine.runner.attention == ("native" if native else "reference")
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, VOCAB, n).tolist() for n in ENGINE_PROMPT_LENS]
    outs = llm.generate(
        prompts,
        SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True),
        use_tqdm=False,
    )
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, GREEDY_TOKENS), (
            f"{name}: prompt of {len(prompt)}"
        )


def test_kv_compression_refused_with_sliding_window(family, llm):
    name, _, path, cfg, _ = family
    policy = {"policy": "sink_window", "sink_tokens": 4, "window_tokens": 16}
    assert cfg.has_sliding_window == (name not in PLAIN_ATTENTION)  # every other family slides
    if not cfg.has_sliding_window:  # full attention keeps working with it
        KVCompressionConfig.from_dict(policy).check_model(cfg)
        return
    with pytest.raises(ValueError, match="KV compression is not supported .* sliding-window"):
        llm.generate(
            [[5, 6, 7]], SamplingParams(max_tokens=4, kv_compression=policy), use_tqdm=False
        )
    with pytest.raises(ValueError, match="KV compression is not supported .* sliding-window"):
        LLM(
            str(path),
            max_model_len=MAX_LEN,
            num_pages=64,
            kv_compression=policy,
            warmup=False,
            use_tqdm=False,
        )


def test_native_attention_refused_where_it_would_be_wrong(family):
    """A model whose attention has windows, soft-capping or another scale never runs the native
    kernel: 'auto' resolves to the reference, and asking for it by name is an error, both when
    resolving and inside the model (so no path silently computes plain attention)."""
    name, _, _, cfg, params = family
    if name in PLAIN_ATTENTION:  # nothing to refuse: the kernel serves it, by name or by "auto"
        assert cfg.attention_extras == ()
        if kernels.native_available():
            assert resolve_attention("native", cfg) == resolve_attention("auto", cfg) == "native"
        return
    assert cfg.attention_extras  # what the kernel lacks, named in the errors below
    assert resolve_attention("auto", cfg) == "reference"
    with pytest.raises(ValueError, match="native"):
        resolve_attention("native", cfg)
    cache = init_kv_cache(cfg, num_pages=3, page_size=PAGE_SIZE, dtype=jnp.float32)
    with pytest.raises(
        ValueError, match=f"attention='native' does not implement {cfg.attention_extras[0]}"
    ):
        forward_jit(
            params,
            cache,
            single_sequence_batch([5, 6], 0, [1], PAGE_SIZE),
            StepSpec(cfg, attention="native"),
        )


TP_SCRIPT = """
import json, sys
from minivllm_jax import LLM, SamplingParams
llm = LLM(sys.argv[1], tensor_parallel_size=2, max_num_seqs=2, max_model_len=64, page_size=4, num_pages=40,
          warmup=False, use_tqdm=False)
outs = llm.generate(json.loads(sys.argv[2]), SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                    use_tqdm=False)
print("RESULT " + json.dumps([o.outputs[0].token_ids for o in outs]))
"""


def test_tensor_parallel_gemma3_matches_hf(tmp_path):
    """Two-way tensor parallelism on the family with the most extras (q/k norms, sandwich norms,
    per-layer windows and RoPE bases): the engine's tokens are still HF's. Two virtual CPU
    devices need a fresh JAX: a subprocess."""
    path = tmp_path / "hf"
    model = make_tiny_family("gemma3", path)
    save_tiny_tokenizer(path, vocab_size=VOCAB)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, VOCAB, n).tolist() for n in (6, 21)]
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": xla_flags_with_host_devices(2),
        "PYTHONPATH": str(ROOT),
        "MINIVLLM_CACHE_DIR": str(tmp_path / "cache"),
    }
    proc = subprocess.run(
        [sys.executable, "-c", TP_SCRIPT, str(path), json.dumps(prompts)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (
        f"worker failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    )
    assert json.loads(lines[-1][len("RESULT ") :]) == [hf_greedy(model, p, 16) for p in prompts]


# ----------------------------------------------------------------------------- config readers

BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=12,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-6,
    max_position_embeddings=512,
)


def test_registry_covers_every_family_once():
    assert [f.name for f in families()] == [
        "llama",
        "qwen2",
        "qwen3",
        "mistral",
        "gemma2",
        "gemma3",
    ]
    archs = supported_architectures()
    assert len(set(archs)) == len(archs) and archs[0] == "LlamaForCausalLM"


@pytest.mark.parametrize(
    "hf",
    [
        {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"},
        {
            "architectures": ["Gemma3ForConditionalGeneration"],
            "model_type": "gemma3",
        },  # the multimodal Gemma 3
        {"model_type": "phi3"},
    ],
    ids=["gpt2", "gemma3-multimodal", "no-architectures"],
)
def test_unsupported_architecture_names_the_supported_ones(hf):
    supported = (
        "LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, MistralForCausalLM, Gemma2ForCausalLM, "
        "Gemma3ForCausalLM"
    )
    with pytest.raises(UnsupportedModelError, match=f"supported: {supported}"):
        config_from_hf({**BASE, **hf})


def test_model_type_alone_picks_the_family():
    assert config_from_hf({**BASE, "model_type": "qwen3"}).family == "qwen3"
    assert config_from_hf({**BASE, "model_type": "gemma3_text"}).family == "gemma3"


def test_qwen2_windows_from_max_window_layers_without_layer_types():
    """transformers 4.x configs have no `layer_types`: the layers from max_window_layers on slide,
    only with use_sliding_window (Qwen2.5's shipped configs set a window but leave it off)."""
    qwen = {
        **BASE,
        "architectures": ["Qwen2ForCausalLM"],
        "sliding_window": 32768,
        "max_window_layers": 9,
    }
    assert config_from_hf({**qwen, "use_sliding_window": False}).layer_windows == ()
    cfg = config_from_hf({**qwen, "use_sliding_window": True})
    assert cfg.layer_windows == (0,) * 9 + (32768,) * 3 and cfg.qkv_bias and not cfg.attention_bias


def test_gemma3_transformers4_layout():
    """4.x Gemma 3: rope_theta + rope_scaling for global layers, rope_local_base_freq for local
    ones, and the 5:1 pattern from sliding_window_pattern; HF's defaults for omitted keys."""
    cfg = config_from_hf(
        {
            **BASE,
            "architectures": ["Gemma3ForCausalLM"],
            "head_dim": 16,
            "rope_theta": 1e6,
            "rope_local_base_freq": 1e4,
            "sliding_window": 512,
            "sliding_window_pattern": 6,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        }
    )
    assert cfg.layer_windows == ((512,) * 5 + (0,)) * 2
    assert (cfg.rope_theta, cfg.local_rope_theta, cfg.rope_scaling) == (
        1e6,
        1e4,
        ("linear", (("factor", 8.0),)),
    )
    assert cfg.tie_word_embeddings and cfg.embedding_scale == 8.0 and cfg.norm_weight_offset == 1.0
    assert (
        cfg.attention_scale == 256**-0.5
        and cfg.attn_logit_softcap is None
        and cfg.final_logit_softcap is None
    )


def test_gemma2_defaults_and_mistral_without_window():
    gemma2 = config_from_hf({**BASE, "architectures": ["Gemma2ForCausalLM"], "head_dim": 16})
    assert (gemma2.attn_logit_softcap, gemma2.final_logit_softcap) == (50.0, 30.0)  # HF's defaults
    assert gemma2.layer_windows == (4096, 0) * 6 and gemma2.hidden_act == "gelu_pytorch_tanh"
    mistral = config_from_hf(
        {**BASE, "architectures": ["MistralForCausalLM"], "sliding_window": None}
    )
    assert mistral.layer_windows == () and mistral.attention_extras == ()


@pytest.mark.parametrize(
    "hf, message",
    [
        (
            {"architectures": ["Gemma2ForCausalLM"], "use_bidirectional_attention": True},
            "bidirectional",
        ),
        (
            {"architectures": ["Qwen3ForCausalLM"], "hidden_act": "relu"},
            "unsupported hidden_act 'relu'",
        ),
        (
            {
                "architectures": ["MistralForCausalLM"],
                "layer_types": None,
                "sliding_window": 8,
                "rope_parameters": {"rope_type": "yarn", "factor": 4.0},
            },
            "unsupported rope type 'yarn'",
        ),
        (
            {"architectures": ["Gemma3ForCausalLM"], "layer_types": ["global"] * 12},
            "layer_types must name one of",
        ),
    ],
    ids=["bidirectional", "activation", "rope", "layer-types"],
)
def test_unsupported_options_are_clear_errors(hf, message):
    with pytest.raises(UnsupportedModelError, match=message):
        config_from_hf({**BASE, **hf})


def test_llama_config_is_unchanged_by_the_registry():
    """Llama reads as it did: every family field at its default (the decoder adds nothing)."""
    cfg = config_from_hf({**BASE, "architectures": ["LlamaForCausalLM"], "rope_theta": 1e5})
    assert cfg == ModelConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_layers=12,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=1e5,
        max_position_embeddings=512,
    )
    assert cfg.attention_extras == ()
