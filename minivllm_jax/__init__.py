"""minivllm-jax: a small, fast, readable LLM inference engine in JAX."""

from minivllm_jax.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from minivllm_jax.functional import generate
from minivllm_jax.llm import LLM
from minivllm_jax.outputs import CompletionOutput, RequestOutput
from minivllm_jax.sampling_params import SamplingParams
from minivllm_jax.structured_output import StructuredOutputsParams

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
