"""Connection limits: what one client's socket may hold, and how long.

- A send (SSE chunk or WebSocket message) that cannot go out for `send_timeout_s` means a
  client that stopped reading: its request is aborted (pages freed) and its connection is
  dropped at once, not closed gracefully (a graceful close would wait, fd and buffer held, for
  the peer to read what is queued).
- WebSockets: at most `max_websockets` open (past it a socket is accepted and closed with 1013,
  "try again later"); one with no request running for `ws_idle_timeout_s` is closed with 1000.
- A graceful shutdown drains WebSockets as uvicorn drains HTTP: the request a socket is running
  finishes, later ones get an error, then the socket is closed with 1001 ("going away").
- `/health` answers 503 while an engine iteration has run for `hung_step_timeout_s`.
- A request's headers must arrive within `HEADER_READ_TIMEOUT_S` of the connection opening (or
  of the previous response), its body within `BODY_READ_TIMEOUT_S` (app.py): a client trickling
  bytes (slowloris) cannot hold a connection, and with it a share of `--limit-concurrency`; nor
  can one that never reads a finished (non-streaming) response.

`DrainingServer` is the uvicorn server the CLI runs: it drains WebSockets before uvicorn closes
them, and exits when the engine loop is down for good so a supervisor restarts the process.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)

SEND_TIMEOUT_S = 30.0  # a send blocked this long (client not reading) aborts the request
WS_IDLE_TIMEOUT_S = 300.0  # a WebSocket with no request for this long is closed (1000)
HUNG_STEP_TIMEOUT_S = (
    120.0  # /health is 503 once one engine iteration runs this long (first compiles can be slow)
)
BODY_READ_TIMEOUT_S = 30.0  # a request body not fully received by then is a 408
HEADER_READ_TIMEOUT_S = (
    20.0  # a connection with no complete request by then (or no reader for its response) is dropped
)
CONNECTION_HEADROOM = (
    64  # --limit-concurrency: requests + WebSockets + this (probes, idle keep-alives)
)
# WebSocket close codes (RFC 6455 7.4.1).
WS_NORMAL, WS_GOING_AWAY, WS_TRY_AGAIN_LATER = 1000, 1001, 1013
TRANSPORT_KEY = "minivllm.transport"  # the scope key `record_transport` fills


@dataclasses.dataclass(frozen=True)
class ConnectionLimits:
    """The per-connection limits of one app (create_app's `limits`, the CLI's flags)."""

    send_timeout_s: float = SEND_TIMEOUT_S
    ws_idle_timeout_s: float = WS_IDLE_TIMEOUT_S
    max_websockets: int = (
        256  # create_app's default is its max_queue: one running request per socket
    )
    hung_step_timeout_s: float = HUNG_STEP_TIMEOUT_S

    def __post_init__(self) -> None:
        for name in ("send_timeout_s", "ws_idle_timeout_s", "hung_step_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_websockets < 1:
            raise ValueError(f"max_websockets must be >= 1, got {self.max_websockets}")


def default_limit_concurrency(max_queue: int, max_websockets: int) -> int:
    """uvicorn's connection cap (503 past it): room for every admitted HTTP request, every
    allowed WebSocket, and `CONNECTION_HEADROOM` more for probes and idle keep-alives."""
    return max_queue + max_websockets + CONNECTION_HEADROOM


class SlowReader(Exception):
    """A send could not complete within the send timeout: the client stopped reading."""


async def send_within(send: Awaitable[None], timeout_s: float) -> None:
    """Await one send; `SlowReader` if the client's buffers stay full for `timeout_s`."""
    try:
        await asyncio.wait_for(send, timeout_s)
    except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
        raise SlowReader(f"the client read nothing for {timeout_s:g} s") from None


def record_transport(scope: dict[str, Any], send: Any) -> None:
    """Remember the connection's transport in the scope (uvicorn's `send` is a method of the
    object holding it), so a stalled response can drop the connection; other servers: None."""
    scope[TRANSPORT_KEY] = getattr(getattr(send, "__self__", None), "transport", None)


async def drop_connection(scope: dict[str, Any]) -> None:
    """Abort the connection now, discarding what is queued for a client that does not read."""
    transport = scope.get(TRANSPORT_KEY)
    if transport is not None:
        transport.abort()
        await asyncio.sleep(0)  # let the server see the disconnect before the app returns


class OpenSockets:
    """The app's open WebSockets: the cap on their number, and the shutdown drain."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self.count = 0
        self.draining = (
            asyncio.Event()
        )  # set once: sockets finish their request, then close with 1001
        self._empty = asyncio.Event()
        self._empty.set()

    def enter(self) -> bool:
        """Count a new socket; False (do not serve it) past the cap or while draining."""
        if self.count >= self.limits.max_websockets or self.draining.is_set():
            return False
        self.count += 1
        self._empty.clear()
        return True

    def leave(self) -> None:
        self.count -= 1
        if self.count == 0:
            self._empty.set()

    async def drain(self, timeout_s: float | None) -> None:
        """Tell every socket to finish its running request and close; wait up to `timeout_s` (None: no limit)."""
        self.draining.set()
        try:
            await asyncio.wait_for(self._empty.wait(), timeout_s)
        except asyncio.TimeoutError:
            logger.warning(
                "%d WebSocket(s) still busy after %.0f s; closing them", self.count, timeout_s
            )


class DrainingServer(uvicorn.Server):
    """uvicorn's server, with two changes:

    - shutdown drains WebSockets: uvicorn closes them at once with 1012, so HTTP connections are
      told to finish first, then `drain(timeout)` lets each socket's request finish, and the rest
      of `timeout_graceful_shutdown` is left for HTTP requests;
    - `engine_error()` is polled on uvicorn's tick (0.1 s); once it returns a message (the engine
      loop is down for good) the server shuts down and `engine_failure` holds that message.
    """

    def __init__(
        self,
        config: uvicorn.Config,
        drain: Callable[[float | None], Awaitable[None]],
        engine_error: Callable[[], str | None],
    ) -> None:
        super().__init__(config)
        self._drain = drain
        self._engine_error = engine_error
        self.engine_failure: str | None = None

    async def on_tick(self, counter: int) -> bool:
        if self.engine_failure is None and (error := self._engine_error()) is not None:
            logger.error(
                "the engine loop is down (%s); exiting so a supervisor can restart the server",
                error,
            )
            self.engine_failure = error
        return self.engine_failure is not None or await super().on_tick(counter)

    async def shutdown(self, sockets: list[Any] | None = None) -> None:
        start = time.monotonic()
        for server in self.servers:
            server.close()  # no new connections (uvicorn's shutdown repeats this harmlessly)
        for connection in list(self.server_state.connections):
            if not _is_websocket(connection):
                connection.shutdown()  # HTTP: finish the current response, then close
        budget = self.config.timeout_graceful_shutdown
        await self._drain(budget)
        if budget is not None:  # one budget for both: what the WebSockets used is gone for HTTP
            self.config.timeout_graceful_shutdown = max(budget - (time.monotonic() - start), 0.1)
        await super().shutdown(sockets)


def _is_websocket(connection: Any) -> bool:
    """uvicorn's WebSocket protocols live in uvicorn.protocols.websockets (HTTP ones elsewhere)."""
    return type(connection).__module__.startswith("uvicorn.protocols.websockets")


class HeaderDeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol, dropping a connection whose request headers are not complete
    `header_timeout_s` after it opened or after its previous response (uvicorn times out only
    idle keep-alives: any byte cancels that, so a client trickling headers holds a connection).
    The same deadline drops a finished response the client has not taken: uvicorn's close
    waits for the client to read it, which one that never reads does not."""

    header_timeout_s = HEADER_READ_TIMEOUT_S

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._arm_header_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_header_deadline()  # the next request's headers get the same time

    def handle_websocket_upgrade(self, event: Any) -> None:
        self._disarm_header_deadline()  # the transport now belongs to the WebSocket protocol
        super().handle_websocket_upgrade(event)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        super().connection_lost(exc)

    def _arm_header_deadline(self) -> None:
        self._disarm_header_deadline()
        self._header_timer = self.loop.call_later(
            self.header_timeout_s, self._header_deadline_passed
        )

    def _disarm_header_deadline(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_deadline_passed(self) -> None:
        self._header_timer = None
        # No request being served: stalled in its headers, or closing with a response nobody reads.
        if self.cycle is None or self.cycle.response_complete:
            logger.info("dropping a connection with no request for %.0f s", self.header_timeout_s)
            self.transport.abort()
