"""minivllm-jax: a small, fast, readable LLM inference engine in JAX."""

from minivllm_jax.engine.decoding.beam_search import (
    BeamSearchOutput,
    BeamSearchParams,
    BeamSearchSequence,
)
from minivllm_jax.llm import LLM
from minivllm_jax.outputs import CompletionOutput, RequestOutput
from minivllm_jax.reference.functional import generate
from minivllm_jax.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = [
    "LLM",
    "SamplingParams",
    "StructuredOutputsParams",
    "RequestOutput",
    "CompletionOutput",
    "generate",
    "BeamSearchParams",
    "BeamSearchOutput",
    "BeamSearchSequence",
]
