"""Requests in: a tokenized prompt and its `SamplingParams` checked against the engine's
limits and made into the `Sequence`s of its samples (vLLM's InputProcessor).

Everything that can be wrong with a request raises here, as a ValueError naming the field at
fault (`ParamError`, `ContextLengthError`), so that a bad request is refused where it is
added and never fails inside a step.
"""

from __future__ import annotations

import dataclasses
import random
import time

from minivllm_jax.config import EngineConfig, KVCompressionConfig, ModelConfig
from minivllm_jax.engine.sequence import Sequence
from minivllm_jax.sampling_params import ContextLengthError, ParamError, SamplingParams


class InputProcessor:
    """Checks requests for one engine and builds their samples.

    Its one piece of state is the generator of the seeds of unseeded requests: drawn in
    arrival order from the engine seed, so a run is reproducible."""

    def __init__(self, model_config: ModelConfig, config: EngineConfig, seed: int) -> None:
        self.model_config = model_config
        self.config = config
        self._seed_rng = random.Random(seed)

    def samples(
        self,
        request_id: str,
        ids: list[int],
        params: SamplingParams,
        *,
        priority: int,
        arrival_time: float | None,
        streaming: bool,
        cache_salt: str | None,
        multiprocess: bool,
    ) -> list[Sequence]:
        """The request's `params.n` samples (`max_tokens` filled in if unset); raises ValueError
        if the prompt or its params do not fit the engine. `multiprocess`: the engine runs
        across several processes (no per-request KV compression there)."""
        params = self._with_max_tokens(ids, params)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        # Unseeded requests still get a seed: reproducible from the engine seed and arrival order.
        # The n samples share it; the sampler keys sample i by fold_in(key(seed), i).
        seed = params.seed if params.seed is not None else self._seed_rng.randrange(2**62)
        if params.kv_compression is not None:  # the engine's own was checked at start
            self._check_compression(params.kv_compression, multiprocess)
        compression = params.kv_compression or self.config.kv_compression
        seqs = []
        for i in range(params.n):
            seqs.append(
                Sequence(
                    request_id,
                    ids,
                    params,
                    index=i,
                    priority=priority,
                    seed=seed,
                    arrival_time=arrival,
                    streaming=streaming,
                    cache_salt=cache_salt,
                )
            )
            seqs[-1].kv_compression = compression
        return seqs

    def _with_max_tokens(self, ids: list[int], params: SamplingParams) -> SamplingParams:
        """The prompt must leave room for output within `max_model_len`, and so must
        `max_tokens` with it; unset, `max_tokens` is all the room left."""
        limit = self.config.max_model_len
        if len(ids) >= limit:
            raise ContextLengthError(
                "prompt",
                f"prompt has {len(ids)} tokens; max_model_len is {limit} (prompt must leave room for output)",
            )
        if params.max_tokens is None:
            return dataclasses.replace(params, max_tokens=limit - len(ids))
        if len(ids) + params.max_tokens > limit:
            raise ContextLengthError(
                "max_tokens",
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds max_model_len ({limit})",
            )
        return params

    def _check_compression(self, config: KVCompressionConfig, multiprocess: bool) -> None:
        """A request's own KV compression policy: only where the engine allows them (their
        programs compiled at warm-up) and in one process. Raises ValueError naming the field."""
        try:
            config.check_page_size(self.config.cache.page_size)
            config.check_model(self.model_config)
        except ValueError as e:
            raise ParamError("kv_compression", f"kv_compression: {e}") from e
        if not self.config.allow_request_kv_compression:
            raise ParamError(
                "kv_compression",
                "kv_compression: per-request KV compression is not enabled on this engine "
                "(allow_request_kv_compression=True; the server's --allow-request-kv-compression)",
            )
        if multiprocess:
            raise ParamError(
                "kv_compression",
                "kv_compression: per-request KV compression does not run across several processes",
            )
