"""`LLM`: the offline facade (`generate`, `stream`, `chat`), like vLLM's and nano-vllm's."""

from __future__ import annotations

import atexit
import dataclasses
import inspect
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
from jax.sharding import Mesh
from tqdm.auto import tqdm

from minivllm_jax.args import EngineArgs
from minivllm_jax.config import ModelConfig
from minivllm_jax.engine.decoding.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from minivllm_jax.engine.engine import LLMEngine
from minivllm_jax.engine.kv.compression import needs_scores
from minivllm_jax.engine.router import PrefixRouter
from minivllm_jax.engine.runtime import enable_compilation_cache, keep_freed_memory
from minivllm_jax.loading.checkpoint import load_converted
from minivllm_jax.loading.quantize import quantize_model_params
from minivllm_jax.loading.resolve import resolve_model
from minivllm_jax.models.params import ServingParams, unstack_layers
from minivllm_jax.ops.quantization import CHECKPOINT_KEY
from minivllm_jax.outputs import RequestOutput
from minivllm_jax.parallel import distributed
from minivllm_jax.parallel.sharding import check_tensor_parallel, make_mesh
from minivllm_jax.prompts import chat_ids
from minivllm_jax.sampling_params import SamplingParams

Prompt = str | Sequence[int]


def replica_meshes(tensor_parallel_size: int, data_parallel_size: int) -> list[Mesh | None]:
    """The devices of each data-parallel replica: consecutive slices of `tensor_parallel_size`
    devices, `data_parallel_size` of them (`[None]`, the default device, for 1 x 1)."""
    if data_parallel_size < 1:
        raise ValueError(f"data_parallel_size must be >= 1, got {data_parallel_size}")
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
    devices = jax.devices()
    if distributed.is_multiprocess():  # one engine, its mesh over every process's devices
        if data_parallel_size != 1 or tensor_parallel_size != len(devices):
            raise ValueError(
                f"a run of {jax.process_count()} processes serves one tensor-parallel model over all "
                f"{len(devices)} devices: use tensor_parallel_size={len(devices)} and data_parallel_size=1 "
                f"(got {tensor_parallel_size} and {data_parallel_size})"
            )
        return [make_mesh(tensor_parallel_size, devices)]
    if tensor_parallel_size == data_parallel_size == 1:
        return [None]
    need = tensor_parallel_size * data_parallel_size
    if need > len(devices):
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} x data_parallel_size={data_parallel_size} needs "
            f"{need} devices; {len(devices)} {devices[0].platform} device(s) available (on CPU, "
            f"XLA_FLAGS=--xla_force_host_platform_device_count=N makes N)"
        )
    tp = tensor_parallel_size
    return [make_mesh(tp, devices[r * tp : (r + 1) * tp]) for r in range(data_parallel_size)]


def _eos_ids(cfg: ModelConfig, model_dir: Path, tokenizer: Any) -> set[int]:
    ids = set(cfg.eos_token_ids)
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


class LLM:
    """Load a model (alias, converted dir, HF folder or .gguf), warm up every bucket, generate.

    `LLM(model, **knobs)`: each keyword is a field of `minivllm_jax.args.EngineArgs`, which
    declares its default and what it does (`LLM("smollm2-135m", max_num_seqs=16,
    kv_cache_dtype="int8")`); an unknown keyword is a TypeError naming the closest knob.
    `LLM.from_engine_args` takes an `EngineArgs` as a command line builds it."""

    def __init__(self, model: str, **kwargs: Any) -> None:
        self._start(EngineArgs.from_kwargs({"model": model, **kwargs}, "LLM"))

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLM:
        """An LLM of these knobs (as `EngineArgs.from_cli_args` reads them from a command line)."""
        llm = cls.__new__(cls)
        llm._start(args)
        return llm

    def _start(self, args: EngineArgs) -> None:
        from transformers import AutoTokenizer

        meshes = replica_meshes(args.tensor_parallel_size, args.data_parallel_size)
        enable_compilation_cache(args.compilation_cache_dir)
        keep_freed_memory()
        model, quantization = args.model, args.quantization
        model_dir = resolve_model(model, dtype=args.dtype, progress=args.use_tqdm)
        cfg, hf_config, params = load_converted(model_dir, args.dtype)
        saved = hf_config.get(CHECKPOINT_KEY)  # a quantized checkpoint loads as it was stored
        if saved is not None and quantization not in (None, saved["scheme"]):
            raise ValueError(
                f"{model} is a checkpoint quantized as {saved['scheme']!r}; load it with "
                f"quantization=None (or {saved['scheme']!r}), or convert the float model again"
            )
        if saved is None:  # weight-only quantization; the full-precision kernels are dropped here
            params = quantize_model_params(params, quantization, model, cfg.num_layers)
        if args.tensor_parallel_size > 1:  # before anything is built: says which sizes would work
            check_tensor_parallel(cfg, args.tensor_parallel_size)
        params = unstack_layers(params)  # the serving layout (merged projections, one tree a layer)
        self.engine_args = args
        self.quantization = saved["scheme"] if saved is not None else quantization
        self.model_dir = model_dir
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        config = args.create_engine_config(cfg)
        multiprocess = distributed.is_multiprocess()
        if multiprocess and (
            config.scheduler.preemption_mode != "recompute" or config.cache.kv_disk_dir is not None
        ):
            raise ValueError(
                "preemption_mode swap/auto and kv_disk_dir run in one process, not across several"
            )
        if multiprocess and (
            config.allow_request_kv_compression
            or (config.kv_compression is not None and needs_scores(config.kv_compression))
        ):
            raise ValueError(
                "KV compression by page scores and per-request policies run in one process, not several"
            )
        eos = _eos_ids(cfg, model_dir, self.tokenizer)
        # Data parallelism: one engine per replica, each on its own slice of the devices; the
        # replicas' seeds differ so that unseeded sampling does not repeat across them.
        self.engines = [
            LLMEngine(
                cfg,
                config,
                params,
                self.tokenizer,
                eos_token_ids=eos,
                seed=args.seed + r,
                mesh=mesh,
            )
            for r, mesh in enumerate(meshes)
        ]
        del params  # each engine placed its own copy on its devices
        self.engine = self.engines[0]
        self.router = PrefixRouter(len(self.engines), config.cache.page_size)
        self.warmup_seconds = (
            sum(e.warmup(progress=args.use_tqdm) for e in self.engines) if args.warmup else 0.0
        )
        if (multiprocess and distributed.is_leader()) or config.cache.kv_disk_dir is not None:
            # Followers must not wait for a leader that is gone; cached pages go to the disk tier.
            atexit.register(self.shutdown)

    # ------------------------------------------------------------------ several processes

    def follow(self) -> None:
        """On every process but the leader of a multi-process run (`minivllm_jax.parallel.distributed`):
        run the leader's steps until the leader calls `shutdown()` (or exits)."""
        self.engine.follow()

    def shutdown(self) -> None:
        """Write the cached pages to the disk tier (`kv_disk_dir`) and, on the leader of a
        multi-process run, release the followers. Also done at exit; safe to call twice."""
        for engine in self.engines:
            engine.close()
        self.engine.stop_followers()

    @property
    def params(self) -> ServingParams:
        """The loaded params in the serving layout (`unstack_layers`), as the first replica holds them."""
        return self.engine.params

    @property
    def model_config(self) -> ModelConfig:
        return self.engine.model_config

    def _route(self, prompt: Prompt) -> LLMEngine:
        if len(self.engines) == 1:
            return self.engine
        ids = self.engine.tokenize(prompt)[1]
        return self.engines[self.router.pick(ids, [len(e.requests) for e in self.engines])]

    # ------------------------------------------------------------------ generation

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: Sequence[int] | None = None,
        use_tqdm: bool = True,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """Run all prompts to completion together; outputs come back in input order.
        `cache_salt`: these prompts share prefix-cache pages only with requests of the same salt.

        This is offline work: nobody reads tokens as they come, so the scheduler gives prompt
        chunks the whole token budget (no TPOT to protect) and only finished outputs are built."""
        prompts = _as_prompt_list(prompts)
        params = sampling_params or SamplingParams()
        params_list = (
            [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        )
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
        self._check_grammars(params_list)

        ids: list[tuple[LLMEngine, str]] = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params_list)):
                engine = self._route(prompt)
                ids.append(
                    (
                        engine,
                        engine.add_request(
                            prompt,
                            p,
                            priority=priority[i] if priority else 0,
                            streaming=False,
                            cache_salt=cache_salt,
                        ),
                    )
                )
        except Exception:
            for engine, request_id in ids:  # all or nothing: don't leave half a batch queued
                engine.abort(request_id)
            raise
        finished: dict[tuple[int, str], RequestOutput] = {}
        busy = [e for e in self.engines if any(e is engine for engine, _ in ids)]
        with tqdm(total=len(ids), desc="generate", disable=not use_tqdm) as bar:
            while len(finished) < len(ids):
                # Steps are dispatched asynchronously: the replicas' devices run side by side.
                for engine in busy:
                    for out in engine.step(only_finished=True):
                        if out.finished:
                            finished[id(engine), out.request_id] = out
                            bar.update(1)
        return [finished[id(engine), i] for engine, i in ids]

    def _check_grammars(self, params_list: Sequence[SamplingParams]) -> None:
        """Compile every distinct structured-output constraint first (in parallel with nothing
        queued yet), so that a bad one raises its ValueError here rather than failing a request."""
        specs = {
            p.structured_outputs.key: p.structured_outputs
            for p in params_list
            if p.structured_outputs is not None
        }
        for engine in self.engines:
            for future in [engine.grammar_compiler.submit(spec) for spec in specs.values()]:
                future.result()

    def stream(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None
    ) -> Iterator[str]:
        """Yield text deltas of one prompt as they are generated (first sample when n > 1)."""
        engine = self._route(prompt)
        self._check_grammars([sampling_params or SamplingParams()])
        request_id = engine.add_request(prompt, sampling_params or SamplingParams())
        sent = 0
        try:
            while True:
                for out in engine.step():
                    if out.request_id != request_id:
                        continue
                    if out.error is not None:  # its step failed; the engine serves on
                        raise RuntimeError(f"generation failed: {out.error}")
                    text = out.outputs[0].text
                    if len(text) > sent:
                        yield text[sent:]
                        sent = len(text)
                    if out.finished:
                        return
        finally:
            engine.abort(request_id)  # no-op when finished; frees pages if the caller stopped early

    def chat(
        self,
        messages: list[dict[str, str]] | Sequence[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation (or several) and generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.apply_chat_template(c) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        """One conversation -> its prompt's token ids (`minivllm_jax.prompts.chat_ids`, as the
        server and the CLI build them); a bad conversation raises a ValueError (`ParamError`)."""
        return chat_ids(self.tokenizer, messages)

    def beam_search(
        self, prompts: Prompt | dict | Sequence[Prompt | dict], params: BeamSearchParams
    ) -> list[BeamSearchOutput]:
        """Beam search with HF transformers' rules (`minivllm_jax.engine.decoding.beam_search`): prompts as text,
        token ids or `{"prompt": ...}` / `{"prompt_token_ids": ...}`; one `BeamSearchOutput` per
        prompt, its `sequences` best first. Runs on the first replica, as ordinary requests it
        steps itself, so no other request may be unfinished; raises RuntimeError otherwise."""
        prompts = [prompts] if isinstance(prompts, dict) else _as_prompt_list(prompts)
        return beam_search(self.engine, prompts, params)


def _init_signature() -> inspect.Signature:
    """`LLM.__init__`'s signature as `inspect.signature` and `help()` show it: `model`, then
    every other `EngineArgs` field with its default, keyword-only (what `**kwargs` accepts)."""
    kinds = inspect.Parameter
    params = [
        kinds("self", kinds.POSITIONAL_OR_KEYWORD),
        kinds("model", kinds.POSITIONAL_OR_KEYWORD),
    ]
    params += [
        kinds(f.name, kinds.KEYWORD_ONLY, default=f.default, annotation=f.type)
        for f in dataclasses.fields(EngineArgs)
        if f.name != "model"
    ]
    return inspect.Signature(params, return_annotation="None")


LLM.__init__.__signature__ = _init_signature()


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and isinstance(prompts[0], int):  # one prompt given as token ids
        return [prompts]
    return prompts
