"""`ServerState`: what the HTTP and WebSocket handlers share (the model once loaded, the
engine loop, the tokenizer worker, metrics) and the request steps they have in common."""

from __future__ import annotations

import logging
import time
from typing import Any, Protocol

from minivllm_jax.beam_search import BeamSearchOutput, BeamSearchParams
from minivllm_jax.sampling_params import SamplingParams
from minivllm_jax.structured_output import StructuredOutputsParams
from server.engine_loop import AsyncEngine, DataParallelEngine, EngineStopped, QueueFull, RequestFailed, RequestStream
from server.metrics import ServerMetrics
from server.preprocess import Preprocessor, TokenTable
from server.protocol import APIError, ChatMessage, beam_search_error, invalid, param_from_message

logger = logging.getLogger(__name__)

RETRY_AFTER_S = "1"


def queue_full(detail: str) -> APIError:
    return APIError(429, f"server is busy: {detail}; retry later", type="rate_limit_error", code="queue_full",
                    headers={"Retry-After": RETRY_AFTER_S})  # fmt: skip


def admission_error(e: QueueFull | EngineStopped) -> APIError:
    """Work the engine did not take: a full queue (429) or a stopped engine (503), both retryable."""
    if isinstance(e, QueueFull):
        return queue_full(str(e))
    return APIError(503, str(e), type="service_unavailable", code="engine_unavailable",
                    headers={"Retry-After": RETRY_AFTER_S})  # fmt: skip


def stream_error(e: EngineStopped | RequestFailed) -> APIError:
    """The error for a stream that ended early: a failed step is the server's fault (500; the
    cause is in the server log, not sent), a stopped engine is unavailable (503)."""
    if isinstance(e, RequestFailed):
        return APIError(500, "the engine step serving this request failed", type="server_error",
                        code="engine_step_failed")  # fmt: skip
    return APIError(503, str(e), type="service_unavailable", code="engine_unavailable")


class LLMLike(Protocol):
    """What the server needs from `minivllm_jax.LLM` (tests may pass a stand-in)."""

    engine: Any
    tokenizer: Any


class ServerState:
    def __init__(self, model_name: str, *, api_key: str | None, max_queue: int, max_body_bytes: int) -> None:
        self.model_name = model_name
        self.api_key = api_key
        self.max_queue = max_queue
        self.max_body_bytes = max_body_bytes
        self.status = "loading"  # loading -> ready | failed
        self.error: str | None = None
        self.metrics = ServerMetrics()
        self.created = int(time.time())
        self.llm: LLMLike | None = None
        self.engine: AsyncEngine | DataParallelEngine | None = None
        self.pre: Preprocessor | None = None
        self.table: TokenTable | None = None

    # ------------------------------------------------------------------ lifecycle

    def attach(self, llm: LLMLike) -> None:
        """Wrap a loaded, warmed-up LLM and start its engine loop (any thread may call this)."""
        self.table = TokenTable(llm.tokenizer)
        compiler = getattr(llm.engine, "grammar_compiler", None)  # stand-in engines in tests may have none
        self.pre = Preprocessor(llm.tokenizer, llm.engine.config.max_model_len, self.table.max_token_bytes, compiler)
        replicas = getattr(llm, "engines", [llm.engine])  # data parallelism: several
        if len(replicas) > 1:
            engine = DataParallelEngine(replicas, llm.engine.config.page_size, max_queue=self.max_queue,
                                        metrics=self.metrics)  # fmt: skip
        else:
            engine = AsyncEngine(llm.engine, max_queue=self.max_queue, metrics=self.metrics)
        engine.start()
        self.llm, self.engine = llm, engine
        self.status = "ready"  # last: handlers check it before touching the fields above

    def fail(self, error: BaseException) -> None:
        self.error = f"{type(error).__name__}: {error}"
        self.status = "failed"

    def close(self) -> None:
        if self.engine is not None:
            self.engine.stop()
        if self.pre is not None:
            self.pre.close()

    @property
    def healthy(self) -> bool:
        return self.status == "ready" and self.engine is not None and self.engine.alive

    # ------------------------------------------------------------------ request steps

    def require_ready(self) -> None:
        if self.healthy:
            return
        if self.status == "loading":
            message, code = "the model is still loading and warming up; retry shortly", "model_loading"
        elif self.status == "failed":
            message, code = f"the model failed to load: {self.error}", "model_load_failed"
        else:
            message, code = "the engine is not running", "engine_unavailable"
        raise APIError(503, message, type="service_unavailable", code=code, headers={"Retry-After": RETRY_AFTER_S})

    def check_capacity(self) -> None:
        """Refuse early when the queue is full, before reading and tokenizing the body
        (`AsyncEngine.add` checks again, exactly, at admission)."""
        if self.engine is not None and self.engine.num_in_flight >= self.max_queue:
            raise queue_full(f"{self.engine.num_in_flight} requests in flight (max_queue={self.max_queue})")

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(
                404, f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                param="model", code="model_not_found",
            )  # fmt: skip

    async def prompt_ids(
        self,
        prompt: str | list[int] | None,
        messages: list[ChatMessage] | None,
        tools: list[dict[str, Any]] | None = None,
        parallel_tool_calls: bool = True,
    ) -> list[int]:
        assert self.pre is not None
        if messages is not None:
            return await self.pre.chat([m.as_template_dict() for m in messages], tools, parallel_tool_calls)
        if prompt is None:
            raise invalid("prompt is required", "prompt")
        return await self.pre.encode(prompt)

    async def check_constraints(self, constraints: list[tuple[str, StructuredOutputsParams]]) -> None:
        """Compile the request's output constraints before it is admitted (400 for a bad one)."""
        assert self.pre is not None
        await self.pre.compile(constraints)

    async def start(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str,
        arrival: float,
        renames: dict[str, str] | None = None,
    ) -> RequestStream:
        """Admit a request into the engine, or raise the matching APIError (400/429/503)."""
        assert self.engine is not None
        try:
            return await self.engine.add(prompt_ids, params, request_id, arrival)
        except (QueueFull, EngineStopped) as e:
            raise admission_error(e) from None
        except (ValueError, TypeError) as e:
            code = "context_length_exceeded" if "max_model_len" in str(e) else None
            raise invalid(str(e), param_from_message(str(e), renames) or "prompt", code) from None

    async def beam_search(self, prompt_ids: list[int], params: BeamSearchParams, arrival: float,
                          cache_salt: str | None = None) -> BeamSearchOutput:  # fmt: skip
        """Run one beam search on the engine (`AsyncEngine.beam_search`), or raise the matching
        APIError: 429/503 as `start` (429 also past the concurrent beam rows), 400 for a search
        that refuses the request, 500 if it failed. `cache_salt` as `start`'s."""
        assert self.engine is not None
        try:
            return await self.engine.beam_search(prompt_ids, params, arrival, cache_salt)
        except (QueueFull, EngineStopped) as e:
            raise admission_error(e) from None
        except RequestFailed as e:
            raise stream_error(e) from None
        except ValueError as e:
            raise beam_search_error(e) from None

    def render_metrics(self) -> str:
        engine = self.engine
        return self.metrics.render(
            engine.stats if engine is not None else None,
            ready=self.healthy,
            in_flight=engine.num_in_flight if engine is not None else 0,
        )
