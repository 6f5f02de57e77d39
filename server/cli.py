"""`minivllm-serve` / `python -m server`: load a model, warm it up and serve it with uvicorn.

uvicorn starts first, so `/health` answers 503 while the model loads and compiles, then 200.
SIGTERM/SIGINT stop accepting connections, let in-flight requests (HTTP and WebSocket) finish
for up to `--shutdown-timeout` seconds, cancel (abort) the rest, and exit with status 0. If the
engine loop goes down for good (its restart budget spent), the server exits with status 1 so a
supervisor restarts it.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import logging
import os
import signal
import sys
import threading
from typing import TYPE_CHECKING

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
    p.add_argument(
        "--model",
        default="smollm2-135m",
        help="alias, converted dir, HF folder or .gguf; also the served model name",
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
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="the model's float dtype (weights left full precision, activations, KV pages)",
    )
    p.add_argument(
        "--quantization",
        default=None,
        choices=["int8", "int4", "w8a8", "gguf"],
        help="quantization of every layer's projections (default: none; int8/int4 weight-only, w8a8: "
        "int8 weights and activations; gguf: a GGUF model's own Q4_0/Q4_1 blocks as int4; see "
        "minivllm_jax/ops/quantization.py for the schemes "
        "and what stays full precision)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "int8"],
        help="KV pages in the model's dtype (auto) or int8 with a scale per token and head "
        "(3.8x smaller at head_dim 64: more sequences fit)",
    )
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=16,
        help="sequences decoded together (largest batch bucket)",
    )
    p.add_argument(
        "--max-model-len", type=int, default=2048, help="prompt + output tokens per sequence"
    )
    p.add_argument(
        "--num-pages",
        type=int,
        default=None,
        help="KV cache pages (default: sized from free memory)",
    )
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=512,
        help="hard cap on the tokens of one step (decodes + prompt chunks)",
    )
    p.add_argument(
        "--target-tpot-ms",
        type=float,
        default=None,
        help="limit prompt work added to steps with streams decoding so each step stays under this "
        "(default: auto, about 2x a decode-only step)",
    )
    p.add_argument(
        "--target-ttft-ms",
        type=float,
        default=None,
        help="a prompt waiting this long gets the whole token budget (default: off)",
    )
    p.add_argument(
        "--max-batch-wait-ms",
        type=float,
        default=0.0,
        help="hold new admissions up to this long to gather a bigger batch (default: 0, run now)",
    )
    p.add_argument(
        "--attention",
        default="auto",
        choices=["auto", "native", "reference"],
        help="attention implementation: the pure-JAX reference, the native CPU kernel, or auto "
        "(native where built); MINIVLLM_KERNELS=reference forces the reference",
    )
    p.add_argument(
        "--no-async-scheduling",
        action="store_true",
        help="read each step's tokens before scheduling the next (default: the next step is "
        "dispatched while the current one runs)",
    )
    p.add_argument(
        "--num-scheduler-steps",
        type=int,
        default=1,
        help="decode steps run in one device program when only decodes run (default: 1; e.g. 4 or "
        "8 cut host round trips, streams then get up to that many tokens at a time)",
    )
    p.add_argument(
        "--speculative-config",
        type=json.loads,
        default=None,
        metavar="JSON",
        help='speculative decoding, as vLLM: \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\' (default: off)',
    )
    p.add_argument(
        "--preemption-mode",
        default="recompute",
        choices=["recompute", "swap", "auto"],
        help="a preempted sequence's KV: recomputed later, swapped to a host pool and back, or "
        "whichever a cost model says is cheaper for that sequence (default: recompute)",
    )
    p.add_argument(
        "--swap-space-gb", type=float, default=4.0, help="host pool for swapped-out KV pages (GiB)"
    )
    p.add_argument(
        "--kv-disk-dir",
        default=None,
        metavar="DIR",
        help="disk tier of the prefix cache: evicted (and, at a clean shutdown, all) cached pages "
        "are written here and found again, also after a restart (default: off)",
    )
    p.add_argument(
        "--kv-disk-gb", type=float, default=10.0, help="size budget of --kv-disk-dir (GiB, LRU)"
    )
    p.add_argument(
        "--kv-compression",
        type=json.loads,
        default=None,
        metavar="JSON",
        help='drop KV pages of long sequences, for every request: \'{"policy": "sink_window", '
        '"window_tokens": 512}\' or \'{"policy": "page_scores", "budget_tokens": 1024}\' '
        "(default: off)",
    )
    p.add_argument(
        "--allow-request-kv-compression",
        action="store_true",
        help="let a request ask for its own policy with a kv_compression field (its programs are "
        "compiled at warm-up; refused with several processes; default: a 400)",
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="split the model over this many devices (heads, MLP and vocabulary; docs/scaling.md)",
    )
    p.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="serve this many replicas (each on tensor-parallel-size devices) behind one API; a "
        "request goes to the replica that cached its prefix, else the least loaded",
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
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--seed", type=int, default=0)
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
    return p


def load_llm(args: argparse.Namespace):
    from minivllm_jax import LLM

    return LLM(
        args.model,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        page_size=args.page_size,
        num_pages=args.num_pages,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=not args.no_prefix_caching,
        seed=args.seed,
        use_tqdm=sys.stderr.isatty(),
        target_tpot_ms=args.target_tpot_ms,
        target_ttft_ms=args.target_ttft_ms,
        max_batch_wait_ms=args.max_batch_wait_ms,
        attention=args.attention,
        quantization=args.quantization,
        async_scheduling=not args.no_async_scheduling,
        kv_cache_dtype=args.kv_cache_dtype,
        num_scheduler_steps=args.num_scheduler_steps,
        speculative_config=args.speculative_config,
        preemption_mode=args.preemption_mode,
        swap_space_gb=args.swap_space_gb,
        kv_disk_dir=args.kv_disk_dir,
        kv_disk_gb=args.kv_disk_gb,
        kv_compression=args.kv_compression,
        allow_request_kv_compression=args.allow_request_kv_compression,
        tensor_parallel_size=args.tensor_parallel_size,
        data_parallel_size=args.data_parallel_size,
    )


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


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    resolve_api_keys(args)
    if (error := exposure_error(args)) is not None:
        parser.error(error)  # exit status 2, as for any bad argument
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    log = logging.getLogger("server")
    if not _is_loopback(args.host) and not args.api_key:
        log.warning(
            "binding %s without --api-key: anyone who can reach this port can use the model",
            args.host,
        )

    from minivllm_jax.parallel import distributed

    # Several processes: join them before anything uses JAX; all but process 0 only follow.
    if (
        distributed.initialize(args.coordinator_address, args.num_processes, args.process_id)
        and not distributed.is_leader()
    ):
        log.info("process %d: loading the model, then following process 0's steps", args.process_id)
        load_llm(args).follow()
        return 0

    import uvicorn

    from server.app import create_app

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
