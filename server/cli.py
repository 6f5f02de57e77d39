"""`minivllm-serve` / `python -m server`: load a model, warm it up and serve it with uvicorn.

Every engine knob is a flag of `minivllm_jax.args.EngineArgs` (`--max-num-seqs` ...), with the
server's own defaults in `SERVER_DEFAULTS`; `--model` is also the name the API serves it under.

uvicorn starts first, so `/health` answers 503 while the model loads and compiles, then 200.
SIGTERM/SIGINT stop accepting connections, let in-flight requests (HTTP and WebSocket) finish
for up to `--shutdown-timeout` seconds, cancel (abort) the rest, and exit with status 0. If the
engine loop goes down for good (its restart budget spent), the server exits with status 1 so a
supervisor restarts it.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import signal
import sys
import threading
from typing import TYPE_CHECKING, Any

from minivllm_jax import LLM
from minivllm_jax.args import EngineArgs
from minivllm_jax.parallel import distributed
from server.app import create_app
from server.connections import (
    CONNECTION_HEADROOM,
    HUNG_STEP_TIMEOUT_S,
    SEND_TIMEOUT_S,
    WS_IDLE_TIMEOUT_S,
    ConnectionLimits,
    DrainingServer,
    HeaderDeadlineProtocol,
    default_limit_concurrency,
)
from server.security import origin_key

if TYPE_CHECKING:
    from server.state import ServerState

API_KEY_ENV = "MINIVLLM_API_KEY"
MAX_HEADER_BYTES = (
    16 * 1024
)  # request line + headers (h11's own default, set explicitly); past it: 400
LOOPBACK = {"127.0.0.1", "localhost", "::1"}

# The engine knobs whose server default differs from `EngineArgs`' (every other engine flag
# has `EngineArgs`' default), each with the reason.
SERVER_DEFAULTS: dict[str, Any] = {
    # Clients read tokens as they come: a step of 16 sequences keeps each stream's time per
    # token low, where the offline LLM's 64 trade that latency for throughput.
    "max_num_seqs": 16,
    # Progress bars only on a terminal: a supervisor's log would get every redraw.
    "use_tqdm": sys.stderr.isatty(),
}


def positive_float(text: str) -> float:
    """A timeout flag: seconds, > 0 (and finite)."""
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text}")
    return value


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text}")
    return value


def comma_list(text: str) -> list[str]:
    """'a, b,,c' -> ['a', 'b', 'c'] (the form of --allowed-hosts and --allowed-origins). An
    empty list is refused: as --allowed-hosts it would lock every client out."""
    items = [part.strip() for part in text.split(",") if part.strip()]
    if not items:
        raise argparse.ArgumentTypeError("expected a comma-separated list, got nothing")
    return items


def origin_list(text: str) -> list[str]:
    """--allowed-origins: each one a plain origin ('http://localhost:3000') or '*'."""
    origins = comma_list(text)
    bad = [o for o in origins if o != "*" and origin_key(o) is None]
    if bad:
        raise argparse.ArgumentTypeError(
            f"origins look like 'http://host:port' (or '*'), got {', '.join(bad)}"
        )
    return origins


def allowed_hosts_for(bind_host: str, allowed: list[str] | None) -> list[str] | None:
    """The Host names to accept (None: any). By default a loopback bind answers only to
    loopback names, which closes DNS rebinding; any other bind checks nothing unless
    --allowed-hosts says so (a LAN or proxy setup has names we cannot guess)."""
    if allowed is not None:
        return None if "*" in allowed else allowed
    if _is_loopback(bind_host):
        return sorted(LOOPBACK | {bind_host.strip("[]").lower()})
    return None


def _is_loopback(host: str) -> bool:
    try:
        return host in LOOPBACK or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name other than localhost
        return False


def engine_failure(state: ServerState) -> str | None:
    """Why the engine loop is down for good (restart budget spent), or None while it serves
    (or is still loading, or was stopped on purpose)."""
    engine = state.engine
    if engine is None or engine.error is None:
        return None
    return f"{type(engine.error).__name__}: {engine.error}"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="minivllm-serve",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        action="extend",
        type=comma_list,
        default=None,
        metavar="KEY[,KEY...]",
        help=f"require 'Authorization: Bearer KEY' on /v1/* and /metrics; repeat it or separate keys "
        f"with commas for several (each key then gets its own prefix-cache salt) "
        f"(default: ${API_KEY_ENV}, same form)",
    )
    p.add_argument(
        "--metrics-api-key",
        default=None,
        metavar="KEY",
        help="the key /metrics requires instead of an --api-key (default: any --api-key; /metrics is "
        "open only when no key is set)",
    )
    p.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help="serve a non-loopback --host without --api-key or --allowed-hosts (refused otherwise: "
        "anyone who can reach the port, or a web page by DNS rebinding, could use the model)",
    )
    p.add_argument(
        "--allowed-hosts",
        type=comma_list,
        default=None,
        metavar="HOST,...",
        help="Host header names to answer, others get 421; '*' for any (default: the loopback "
        "names when bound to loopback, else no check)",
    )
    p.add_argument(
        "--allowed-origins",
        type=origin_list,
        default=[],
        metavar="ORIGIN,...",
        help="origins such as http://localhost:3000 whose pages may open WS /v1/stream besides "
        "the server's own; '*' for any (default: none)",
    )
    p.add_argument(
        "--coordinator-address",
        default=None,
        metavar="HOST:PORT",
        help="several processes (hosts): process 0's address (also MINIVLLM_COORDINATOR)",
    )
    p.add_argument(
        "--num-processes",
        type=int,
        default=None,
        help="several processes: how many (also MINIVLLM_NUM_PROCESSES)",
    )
    p.add_argument(
        "--process-id",
        type=int,
        default=None,
        help="several processes: this one's id; 0 serves the API, the others follow its steps "
        "(also MINIVLLM_PROCESS_ID)",
    )
    p.add_argument(
        "--max-queue", type=int, default=256, help="requests in flight before new ones get 429"
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=1 << 20,
        help="largest request body / WebSocket message",
    )
    p.add_argument(
        "--shutdown-timeout", type=float, default=30.0, help="seconds to drain requests on SIGTERM"
    )
    p.add_argument(
        "--send-timeout",
        type=positive_float,
        default=SEND_TIMEOUT_S,
        help="seconds a stream may wait for a client that reads nothing before its request is aborted "
        "and its connection dropped (SSE and WebSocket)",
    )
    p.add_argument(
        "--max-websockets",
        type=positive_int,
        default=None,
        help="open WebSockets; past it a new one is closed with 1013 (default: --max-queue)",
    )
    p.add_argument(
        "--ws-idle-timeout",
        type=positive_float,
        default=WS_IDLE_TIMEOUT_S,
        help="seconds a WebSocket may stay open with no request before it is closed with 1000",
    )
    p.add_argument(
        "--limit-concurrency",
        type=positive_int,
        default=None,
        help="open connections (and tasks) before uvicorn answers 503 to everything, /health included "
        f"(default: --max-queue + --max-websockets + {CONNECTION_HEADROOM})",
    )
    p.add_argument(
        "--hung-step-timeout",
        type=positive_float,
        default=HUNG_STEP_TIMEOUT_S,
        help="/health answers 503 once one engine step has run this many seconds (a hung device)",
    )
    p.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    return EngineArgs.add_cli_args(p, defaults=SERVER_DEFAULTS)


def load_llm(args: argparse.Namespace) -> LLM:
    """The engine the flags describe (its knobs are `EngineArgs` fields; see `SERVER_DEFAULTS`)."""
    return LLM.from_engine_args(EngineArgs.from_cli_args(args))


def resolve_api_keys(args: argparse.Namespace, environ: dict[str, str] | None = None) -> None:
    """`args.api_key`: the keys from --api-key, else from $MINIVLLM_API_KEY ('a,b' for several),
    as a list (empty: no key)."""
    environ = os.environ if environ is None else environ
    if args.api_key is None:
        args.api_key = [k.strip() for k in environ.get(API_KEY_ENV, "").split(",") if k.strip()]


def exposure_error(args: argparse.Namespace) -> str | None:
    """Why these arguments must not start a server, or None. A non-loopback bind with no API key
    and no Host check is open to anyone who can reach the port and, by DNS rebinding, to any web
    page its users open; it takes --allow-unauthenticated (as Jupyter asks for) to run one."""
    if _is_loopback(args.host) or args.api_key or args.allow_unauthenticated:
        return None
    if args.allowed_hosts is not None and "*" not in args.allowed_hosts:
        return None
    return (
        f"refusing to serve --host {args.host} without --api-key or --allowed-hosts: anyone who can reach "
        "the port (or a web page, by DNS rebinding) could use the model; set a key (--api-key or "
        f"${API_KEY_ENV}), name the Host names to answer (--allowed-hosts), or pass --allow-unauthenticated"
    )


# Libraries that log routine steps at INFO: orbax (through absl) a dozen lines per checkpoint
# save or load, JAX a line per accelerator backend it did not find. At INFO they buried the
# server's own lines; they show from WARNING, and everything shows at --log-level debug.
CHATTY_LIBRARY_LOGGERS = ("absl", "orbax", "jax._src.xla_bridge")


def configure_logging(log_level: str) -> None:
    """The server's log: our lines at `log_level`, the chatty libraries' from WARNING."""
    level = getattr(logging, log_level.upper())
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger().setLevel(level)  # also where a handler was there already
    for name in CHATTY_LIBRARY_LOGGERS:
        logging.getLogger(name).setLevel(
            level if level <= logging.DEBUG else max(level, logging.WARNING)
        )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    resolve_api_keys(args)
    if (error := exposure_error(args)) is not None:
        parser.error(error)  # exit status 2, as for any bad argument
    configure_logging(args.log_level)
    log = logging.getLogger("server")
    if not _is_loopback(args.host) and not args.api_key:
        log.warning(
            "binding %s without --api-key: anyone who can reach this port can use the model",
            args.host,
        )

    # Several processes: join them before anything uses JAX; all but process 0 only follow.
    if (
        distributed.initialize(args.coordinator_address, args.num_processes, args.process_id)
        and not distributed.is_leader()
    ):
        log.info("process %d: loading the model, then following process 0's steps", args.process_id)
        load_llm(args).follow()
        return 0

    import uvicorn

    load_errors: list[BaseException] = []

    def on_load_error(error: BaseException) -> None:
        load_errors.append(error)
        server.should_exit = True

    limits = ConnectionLimits(
        send_timeout_s=args.send_timeout,
        ws_idle_timeout_s=args.ws_idle_timeout,
        hung_step_timeout_s=args.hung_step_timeout,
        max_websockets=args.max_queue if args.max_websockets is None else args.max_websockets,
    )
    app = create_app(
        lambda: load_llm(args),
        model_name=args.model,
        api_key=args.api_key,
        metrics_api_key=args.metrics_api_key,
        max_queue=args.max_queue,
        max_body_bytes=args.max_body_bytes,
        on_load_error=on_load_error,
        allowed_hosts=allowed_hosts_for(args.host, args.allowed_hosts),
        allowed_origins=args.allowed_origins,
        limits=limits,
    )
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        lifespan="on",
        timeout_graceful_shutdown=args.shutdown_timeout,
        ws_max_size=args.max_body_bytes,
        limit_concurrency=args.limit_concurrency
        or default_limit_concurrency(args.max_queue, limits.max_websockets),
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        http=HeaderDeadlineProtocol,
    )
    state = app.state.minivllm
    server = DrainingServer(
        config, drain=app.state.sockets.drain, engine_error=lambda: engine_failure(state)
    )
    # uvicorn re-raises the signal that stopped it once its own handlers are removed; these
    # no-op handlers make that a clean exit (status 0) instead of death by signal.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run()

    code = 1 if load_errors or server.engine_failure or not server.started else 0
    if any(t.name == "model-loader" and t.is_alive() for t in threading.enumerate()):
        # Stopped during warm-up: don't wait for XLA to finish compiling.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
