"""The peers our engine is measured against, in the same process and run.

HF transformers (PyTorch): `load_hf_model` and `hf_generate`, one left-padded batch through
`generate` with EOS disabled, so outputs have exactly the requested lengths.

llama.cpp (llama-cpp-python): one place that loads a GGUF and runs requests through llama.cpp's
multi-sequence batch API (batch 1 is one sequence), the F32/F16 GGUF of the shipped Q4_1 weights
that gives a like-for-like fp32 row, and the scripts' --no-llamacpp / --llamacpp-variants
options with their skip reasons. What each script measures from a run (decode tok/s,
throughput, latency) stays in that script.

Both llama.cpp and our engine get the same work: prompts as token ids, exactly the drawn number
of output tokens (EOS ignored), greedy argmax on the logits, 2 threads. Batching is continuous,
as in llama.cpp's `parallel` example: up to `n_parallel` sequences each in its own KV stream
(`n_seq_max`), every step one `llama_decode` of each running sequence's next token plus prompt
chunks under an `n_batch` token budget, and a finished sequence's slot is refilled at once.

`llama_cpp` is an optional extra (`pip install -e '.[peer]'`, or `make bench`, which builds it
once); `available()` says whether it imports and why not, so scripts skip with a reason.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from minivllm_jax.loading.aliases import MODEL_ALIASES, alias_source
from minivllm_jax.loading.resolve import _cache_key, cache_root

# ------------------------------------------------------------------ HF transformers (PyTorch)


def load_hf_model(model: str, dtype: str = "float32", threads: int = 2):
    """HF transformers' model for `model` (alias, HF folder or .gguf), eval mode, no EOS."""
    import torch
    import transformers

    torch.set_num_threads(threads)
    torch_dtype = getattr(torch, dtype)
    path = alias_source(model) if model in MODEL_ALIASES else Path(model)
    if path.suffix == ".gguf":
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent),
            gguf_file=path.name,
            dtype=torch_dtype,
            quantization_config=transformers.GgufConfig(dequantize=True),
        )
    else:
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype)
    # Benchmarks force output lengths; `generate` fills an unset eos_token_id from the model's
    # generation_config, so EOS must be cleared there too or the peer may stop early.
    hf.generation_config.eos_token_id = None
    return hf.eval()


def hf_generate(
    model: Any,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float = 0.0,
    pad_id: int = 0,
    **kwargs: Any,
):
    """One batch through HF `generate`, left padded with `pad_id`, EOS disabled; greedy, or
    plain temperature sampling as ours does (no top-k/top-p from generation_config). `kwargs`
    go to `generate` (a streamer, num_beams, ...). Returns its output ids."""
    import torch

    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    sampling: dict[str, Any] = {"do_sample": False}
    if temperature > 0:
        sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
    with torch.inference_mode():
        return model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            eos_token_id=None,
            pad_token_id=pad_id,
            **sampling,
            **kwargs,
        )


@dataclasses.dataclass
class TokenTimes:
    """A `transformers` streamer that only notes when each generated step reached the host."""

    times: list[float] = dataclasses.field(default_factory=list)
    seen_prompt: bool = False

    def put(self, value: Any) -> None:
        if self.seen_prompt:  # generate's first put is the prompt itself
            self.times.append(time.perf_counter())
        self.seen_prompt = True

    def end(self) -> None:
        pass


# ------------------------------------------------------------------ llama.cpp


INSTALL_HINT = "llama-cpp-python is not installed: pip install -e '.[peer]' or make bench"
VARIANTS = ("q4_1", "f16", "f32")  # q4_1: the shipped file; f16/f32: its weights dequantized
THREADS = 2


def available() -> tuple[bool, str]:
    """(True, version) when `llama_cpp` imports, else (False, why not)."""
    try:
        import llama_cpp
    except ImportError as e:
        return False, f"{INSTALL_HINT} ({e})"
    return True, getattr(llama_cpp, "__version__", "?")


def _llama_cpp():
    ok, why = available()
    if not ok:
        raise RuntimeError(why)
    import llama_cpp

    return llama_cpp


def add_peer_args(p: argparse.ArgumentParser) -> None:
    """--no-llamacpp and --llamacpp-variants, shared by the scripts that run the peer."""
    p.add_argument("--no-llamacpp", action="store_true", help="skip the llama.cpp peer")
    p.add_argument(
        "--llamacpp-variants",
        nargs="+",
        default=["q4_1", "f32"],
        choices=VARIANTS,
        help="GGUF weights for llama.cpp: q4_1 (the shipped file), f16/f32 (dequantized "
        "from it; written once into the model cache)",
    )


def peer_models(args: argparse.Namespace) -> tuple[dict[str, Path], str | None]:
    """{variant: GGUF path} for the llama.cpp runs, or ({}, the reason printed for skipping)."""
    if args.no_llamacpp:
        return {}, "--no-llamacpp"
    ok, why = available()
    if not ok:
        return {}, why
    src = source_gguf(args.model)
    if src is None:
        return {}, f"{args.model} is not a GGUF model (llama.cpp needs one)"
    return {
        v: src if v == "q4_1" else dequantized_gguf(src, v) for v in args.llamacpp_variants
    }, None


def run_variants(
    args: argparse.Namespace, result: dict[str, Any], measure: Callable[[str, Path], dict]
) -> dict:
    """`measure(variant, gguf_path)` for each requested variant, into `result["llamacpp"]`; or
    why the peer was skipped, printed and kept in `result["llamacpp_skipped"]`."""
    paths, why = peer_models(args)
    if why:
        result["llamacpp_skipped"] = f"llama.cpp peer skipped: {why}"
        print(result["llamacpp_skipped"])
    for variant, path in paths.items():
        result.setdefault("llamacpp", {})[variant] = measure(variant, path)
    return result.get("llamacpp", {})


# ------------------------------------------------------------------ GGUF files


def source_gguf(model: str) -> Path | None:
    """The GGUF behind `model` (an alias of a shipped GGUF, or a .gguf path), else None."""
    path = alias_source(model) if model in MODEL_ALIASES else Path(model)
    return path if path.suffix == ".gguf" and path.is_file() else None


def write_dequantized_gguf(src: str | Path, dst: str | Path, variant: str = "f32") -> Path:
    """Copy GGUF `src` to `dst` with every tensor dequantized (`gguf.quants.dequantize`) to F32,
    or to F16 for `variant="f16"` (1-D norm weights stay F32, as llama.cpp's converter keeps
    them). All metadata, tokenizer included, is copied; `general.file_type` says the new type."""
    import gguf

    if variant not in ("f16", "f32"):
        raise ValueError(f"variant must be f16 or f32, not {variant!r}")
    reader = gguf.GGUFReader(str(src))
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(str(dst), arch)
    skip = {
        "general.architecture",
        "general.alignment",
        "general.file_type",
    }  # the writer sets these
    for field in reader.fields.values():
        if field.name in skip or field.name.startswith("GGUF."):
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub_type)
    ftype = gguf.LlamaFileType.MOSTLY_F16 if variant == "f16" else gguf.LlamaFileType.ALL_F32
    writer.add_file_type(int(ftype))
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(
            tuple(int(n) for n in reversed(t.shape))
        )
        writer.add_tensor(
            t.name, w.astype(np.float16 if variant == "f16" and w.ndim > 1 else np.float32)
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(dst)


def dequantized_gguf(src: Path, variant: str = "f32", cache_dir: str | Path | None = None) -> Path:
    """`src` dequantized to `variant`, written once into the model cache and reused."""
    dst = cache_root(cache_dir) / "gguf" / f"{_cache_key(src)}-{variant.upper()}.gguf"
    if not dst.is_file():
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_suffix(f".tmp{os.getpid()}")
        print(f"writing {dst} ({variant} copy of {src.name}) ...", flush=True)
        write_dequantized_gguf(src, tmp, variant)
        os.replace(tmp, dst)  # atomic: concurrent callers never see half a file
    return dst


# ------------------------------------------------------------------ runs


@dataclasses.dataclass
class PeerRun:
    """One workload through llama.cpp: each request's arrival, output tokens and the host time
    each token was available, plus the wall time from the first arrival to the last token."""

    arrival: list[float]
    token_ids: list[list[int]]
    token_times: list[list[float]]
    elapsed_s: float


@dataclasses.dataclass
class _Slot:
    request: int
    pending: list[int]  # prompt tokens not yet decoded
    pos: int = 0
    last: int | None = None  # the sampled token to feed next


class LlamaCppPeer:
    """A GGUF loaded once through `llama_cpp.Llama`; each `run` decodes on a fresh context with
    one KV stream per parallel sequence. Use as a context manager, or call `close()`."""

    def __init__(self, model_path: str | Path, threads: int = THREADS, n_batch: int = 512) -> None:
        self.lib = _llama_cpp()
        self.threads, self.n_batch = threads, n_batch
        self.llm = self.lib.Llama(
            str(model_path),
            n_threads=threads,
            n_threads_batch=threads,
            n_ctx=256,
            n_batch=n_batch,
            logits_all=False,
            verbose=False,
        )
        self.n_vocab = self.lib.llama_vocab_n_tokens(self.lib.llama_model_get_vocab(self.llm.model))

    def __enter__(self) -> LlamaCppPeer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self.llm.close()

    def _context(self, n_parallel: int, seq_len: int):
        """A context with `n_parallel` KV streams of at least `seq_len` tokens each."""
        params = self.lib.llama_context_default_params()
        seq_ctx = -(-seq_len // 256) * 256
        params.n_ctx, params.n_seq_max, params.kv_unified = seq_ctx * n_parallel, n_parallel, False
        params.n_batch = params.n_ubatch = self.n_batch
        params.n_threads = params.n_threads_batch = self.threads
        params.no_perf = True
        ctx = self.lib.llama_init_from_model(self.llm.model, params)
        if not ctx:
            raise RuntimeError(
                f"llama.cpp could not create a context for {n_parallel} x {seq_ctx} tokens"
            )
        return ctx

    def run(
        self,
        prompts: list[list[int]],
        output_lens: list[int],
        n_parallel: int,
        closed_loop: bool = False,
        warmup: bool = True,
    ) -> PeerRun:
        """Serve the requests in order, `n_parallel` at a time (continuous batching); greedy,
        exactly `output_lens[i]` tokens each. Offline, every request arrives at the start; with
        `closed_loop`, a request arrives when the one before it in its slot finishes (C users)."""
        seq_len = max(len(p) + o for p, o in zip(prompts, output_lens))
        ctx = self._context(n_parallel, seq_len)
        batch = self.lib.llama_batch_init(self.n_batch, 0, 1)
        try:
            if warmup:  # first-call costs (thread pool, buffers), as the other engines warm up
                self._serve(
                    ctx, batch, [prompts[0][:8]] * n_parallel, [2] * n_parallel, n_parallel, False
                )
            return self._serve(ctx, batch, prompts, output_lens, n_parallel, closed_loop)
        finally:
            self.lib.llama_batch_free(batch)
            self.lib.llama_free(ctx)

    def _serve(self, ctx, batch, prompts, output_lens, n_parallel, closed_loop) -> PeerRun:
        lib = self.lib
        mem = lib.llama_get_memory(ctx)
        for s in range(n_parallel):
            lib.llama_memory_seq_rm(mem, s, -1, -1)
        n = len(prompts)
        queue = deque(range(n))
        slots: list[_Slot | None] = [None] * n_parallel
        tokens: list[list[int]] = [[] for _ in range(n)]
        times: list[list[float]] = [[] for _ in range(n)]
        start = time.perf_counter()
        arrival = [start] * n
        while queue or any(slots):
            for s in range(n_parallel):
                if slots[s] is None and queue:
                    i = queue.popleft()
                    slots[s] = _Slot(i, list(prompts[i]))
                    if closed_loop:
                        arrival[i] = time.perf_counter()
            # Decodes first (one token each), then prompt chunks in the remaining budget.
            rows: list[int] = []  # slot of each logits row, in batch order
            k = 0
            for s, slot in enumerate(slots):
                if slot is not None and not slot.pending:
                    k = self._put(batch, k, slot.last, slot.pos, s, True)
                    slot.pos += 1
                    rows.append(s)
            for s, slot in enumerate(slots):
                if slot is not None and slot.pending and k < self.n_batch:
                    chunk, slot.pending = (
                        slot.pending[: self.n_batch - k],
                        slot.pending[self.n_batch - k :],
                    )
                    for j, tok in enumerate(chunk):
                        done = not slot.pending and j == len(chunk) - 1
                        k = self._put(batch, k, tok, slot.pos, s, done)
                        slot.pos += 1
                    if not slot.pending:
                        rows.append(s)
            batch.n_tokens = k
            rc = lib.llama_decode(ctx, batch)
            if rc != 0:
                raise RuntimeError(
                    f"llama_decode failed with {rc} ({k} tokens, {len(rows)} outputs)"
                )
            if not rows:
                continue
            logits = np.ctypeslib.as_array(
                lib.llama_get_logits(ctx), shape=(len(rows), self.n_vocab)
            )
            nxt = logits.argmax(axis=1).tolist()
            now = time.perf_counter()
            for s, tok in zip(rows, nxt):
                slot = slots[s]
                tokens[slot.request].append(tok)
                times[slot.request].append(now)
                slot.last = tok
                if len(tokens[slot.request]) == output_lens[slot.request]:
                    lib.llama_memory_seq_rm(mem, s, -1, -1)
                    slots[s] = None
        return PeerRun(arrival, tokens, times, time.perf_counter() - start)

    @staticmethod
    def _put(batch, k: int, token: int, pos: int, seq: int, logits: bool) -> int:
        batch.token[k], batch.pos[k], batch.n_seq_id[k] = token, pos, 1
        batch.seq_id[k][0], batch.logits[k] = seq, logits
        return k + 1


# ------------------------------------------------------------------ what the scripts report


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two greedy outputs share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
