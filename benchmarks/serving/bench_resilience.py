"""Resilience: does good traffic keep its latency while abusive clients hit the same server?

One loopback server (`python -m server`, started here) serves good streaming completions at
`--concurrency` 16 (the shared client and text prompts of benchmarks/lib) in each phase, beside one kind of abuse:

  a. alone             good traffic only (the baseline)
  b. slow readers      SSE clients that never read (socket receive buffer shrunk), arriving
                       every `--slow-reader-interval` s
  c. oversized bodies  bodies just over --max-body-bytes, and ~800 KB prompts, in a loop
  d. tool bombs        chat requests with 15,000 minimal tools (~800 KB), in a loop
  e. overflow values   top_k 2**32, seed 2**63, n 2**32, token ids 2**32, ... in a loop
  f. disconnect storm  clients that start streams and drop them at once, in a loop
  g. SIGKILL + restart on a disk tier: a server with --kv-disk-dir is stopped cleanly (pages
                       written), restarted, SIGKILLed mid-run, two of its page files are torn
                       (one truncated, one given a 100k-deep JSON header), and it is started
                       again: it must come up and serve every good request

After b and f, once the engine is idle, requests still in flight and KV pages still in use are
read from /metrics (both must be 0: they would be held by clients that never read or that left).
Loopback sockets buffer about 4 MB, more than a 512-token stream's SSE (even with top-20
logprobs), so phase b's clients load the server but seldom block its sends; the queue slot
release itself is proven in tests/test_isolation_connections.py with a stand-in engine whose
tokens are megabytes wide.

For each phase: good-traffic goodput (the share of good requests with TTFT <= --slo-ttft-ms and
TPOT <= --slo-tpot-ms), TTFT p50/p95, lost good requests (an error or no answer; must be 0; in
phase g the requests in flight at the SIGKILL die with the process and are counted apart), the
abusive requests' answers, and /health's worst latency (polled every 50 ms through the phase).

    python benchmarks/serving/bench_resilience.py                       # every phase, 48 good requests each
    python benchmarks/serving/bench_resilience.py --phases alone tool_bombs --requests 16
    python benchmarks/serving/bench_resilience.py --duration 20         # 20 s of good traffic per phase
    python benchmarks/serving/bench_resilience.py --quick --model PATH --phases alone tool_bombs
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlparse

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402

from benchmarks.lib.report import (  # noqa: E402
    ROOT,
    add_options,
    add_slo_args,
    git_state,
    meets_slo,
    ms,
    nearest_rank,
    new_figure,
    percentiles,
    save_plot,
    script_parser,
    write_result,
)
from benchmarks.lib.serving import launched_server, metric, one_request  # noqa: E402
from benchmarks.lib.workloads import TEXT_PROMPTS  # noqa: E402

PHASES = "alone slow_readers oversized_bodies tool_bombs overflow_values disconnect_storm".split()
PHASES.append("sigkill_restart")
DEFAULT_SERVER_ARGS = "--max-num-seqs 16 --max-model-len 512 --max-queue 32"
SLO_TTFT_MS, SLO_TPOT_MS = 2000.0, 100.0  # the goodput SLO (looser TTFT than load_test's)
MAX_BODY_BYTES = 1 << 20  # the server's default --max-body-bytes
TOOL_BOMB_TOOLS = 15_000  # about 800 KB of minimal tools: under the body limit
HEALTH_POLL_S = 0.05
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
# Values that must each be a 400: out of every sane range, or of the int32/int64 arrays they end in.
OVERFLOW_FIELDS: list[dict[str, Any]] = [
    {"top_k": 2**32},
    {"top_k": 2**63},
    {"seed": 2**63},
    {"seed": 2**64},
    {"n": 2**32},
    {"logprobs": 2**32},
    {"max_tokens": 2**63},
    {"stop_token_ids": [2**63]},
    {"presence_penalty": 1e308},
    {"temperature": 1e308},
    {"repetition_penalty": 1e308},
    {"prompt": [2**32]},
    {"prompt": [-1]},
    {"logit_bias": {"1": 1e308}},
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = script_parser(__doc__, "resilience.json")
    p.add_argument(
        "--phases", nargs="+", choices=PHASES, default=PHASES, help="which phases to run (in order)"
    )
    add_options(
        p,
        [
            ("--requests", 48, "good requests per phase (unless --duration)"),
            ("--duration", float, "seconds of good traffic per phase instead"),
            ("--concurrency", 16, "good requests in flight"),
            ("--max-tokens", 32, "output tokens per good request (EOS ignored)"),
            ("--abusers", 4, "abusive client threads per looping phase"),
            ("--slow-readers", 48, "most slow readers opened in phase b"),
            ("--slow-reader-interval", 0.5, "seconds between slow readers"),
            ("--settle", 120.0, "after phases b and f: most seconds the abusers' requests take"),
            ("--server-args", DEFAULT_SERVER_ARGS, "flags for `python -m server`"),
            ("--launch-timeout", 900.0, "seconds to wait for a server to be ready"),
            ("--request-timeout", 120.0, "seconds per good request"),
        ],
    )
    add_slo_args(p)
    p.set_defaults(slo_ttft_ms=SLO_TTFT_MS, slo_tpot_ms=SLO_TPOT_MS)
    p.add_argument("--quick", action="store_true", help="smoke test: few, short requests")
    args = p.parse_args(argv)
    if args.quick:
        args.requests, args.concurrency, args.max_tokens, args.abusers = 4, 2, 4, 1
        args.slow_readers, args.slow_reader_interval, args.settle = 2, 0.2, 30.0
    if min(args.requests, args.concurrency, args.max_tokens, args.abusers) < 1:
        p.error("--requests, --concurrency, --max-tokens and --abusers must be >= 1")
    return args


# ------------------------------------------------------------------ good traffic


def good_body(i: int, max_tokens: int, prefix: str = "") -> dict[str, Any]:
    return {
        "prompt": prefix + TEXT_PROMPTS[i % len(TEXT_PROMPTS)],
        "max_tokens": max_tokens,
        "temperature": 0.8,
        "seed": i,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def good_traffic(
    url: str,
    args: argparse.Namespace,
    on_done: Callable[[list[dict]], None] | None = None,
    prefix: str = "",
) -> dict:
    """`--requests` good streams (or as many as `--duration` allows) at `--concurrency`, each
    prompt after `prefix`; each result is load_test's timings or its error. `on_done(results)`
    runs after each of them."""
    import httpx

    client_args = SimpleNamespace(
        endpoint="completions", model=args.model, request_timeout=args.request_timeout
    )
    limits = httpx.Limits(
        max_connections=args.concurrency, max_keepalive_connections=args.concurrency
    )
    results: list[dict] = []
    start = time.perf_counter()
    counter = iter(range(10**9))

    def more() -> int | None:
        i = next(counter)
        if args.duration is not None:
            return i if time.perf_counter() - start < args.duration else None
        return i if i < args.requests else None

    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=30.0) as client:

        async def worker() -> None:
            while (i := more()) is not None:
                results.append(
                    await one_request(client, client_args, good_body(i, args.max_tokens, prefix))
                )
                if on_done is not None:
                    on_done(results)

        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    return summarize(results, time.perf_counter() - start, args)


def summarize(results: list[dict], wall_s: float, args: argparse.Namespace) -> dict:
    ok = [r for r in results if "error" not in r]
    errors = [r["error"] for r in results if "error" in r]
    good = sum(meets_slo(r, args.slo_ttft_ms, args.slo_tpot_ms) for r in ok)
    ttft = sorted(r["ttft"] for r in ok)
    return {
        "sent": len(results),
        "completed": len(ok),
        "lost": len(errors),
        "lost_samples": errors[:5],
        "meeting_slo": good,
        "goodput": good / len(results) if results else None,
        "wall_s": wall_s,
        "ttft_s": {**percentiles(ttft), "p95": nearest_rank(ttft, 95)},
        "tpot_s": percentiles([r["tpot"] for r in ok if r["tpot"] is not None]),
    }


# ------------------------------------------------------------------ abusive clients


def raw_post(url: str, path: str, body: bytes, rcvbuf: int | None = None) -> socket.socket:
    """Send one POST on a raw socket and return it unread (closing it is a disconnect)."""
    parsed = urlparse(url)
    sock = socket.socket()
    if rcvbuf is not None:  # set before connecting, so the advertised window stays small
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect((parsed.hostname, parsed.port))
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {parsed.netloc}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    return sock


class Background:
    """`threads` daemon threads running `work(k)` inside a `with` block; `stop()` (and the
    block's end) sets `stopped` and joins them."""

    def __init__(self, threads: int = 1, join_s: float = 30.0) -> None:
        self.stopped, self.join_s = threading.Event(), join_s
        self._threads = [
            threading.Thread(target=self.work, args=(k,), daemon=True) for k in range(threads)
        ]

    def work(self, k: int) -> None:
        raise NotImplementedError

    def __enter__(self):
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self.stopped.set()
        for t in self._threads:
            t.join(self.join_s)

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class Abuse(Background):
    """Abusive clients on threads: each loops `send` and counts the answers."""

    def __init__(self, threads: int, send: Callable[[int], str]) -> None:
        super().__init__(threads, join_s=120)
        self.send, self.answers = send, collections.Counter()
        self._lock = threading.Lock()

    def work(self, k: int) -> None:
        i = 0
        while not self.stopped.is_set():
            try:
                answer = self.send(k * 1_000_000 + i)
            except Exception as e:  # the abuser's own connection errors: counted, not raised
                answer = type(e).__name__
            with self._lock:
                self.answers[answer] += 1
            i += 1


def http_sender(url: str, make: Callable[[int], tuple[str, bytes]]) -> Callable[[int], str]:
    """A send function: POST the (path, body) `make(i)` returns; the answer is the status code."""
    import httpx

    client = httpx.Client(base_url=url, timeout=120.0, headers={"Content-Type": "application/json"})

    def send(i: int) -> str:
        path, body = make(i)
        return str(client.post(path, content=body).status_code)

    return send


def oversized_body(i: int) -> tuple[str, bytes]:
    if i % 2:  # just over the limit
        return COMPLETIONS, json.dumps({"prompt": "a" * (MAX_BODY_BYTES - 12)}).encode()
    return COMPLETIONS, json.dumps(
        {"prompt": "word " * 160_000, "max_tokens": 4}
    ).encode()  # ~800 KB


def tool_bomb_body() -> bytes:
    tools = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(TOOL_BOMB_TOOLS)]
    return json.dumps(
        {"messages": [{"role": "user", "content": "hi"}], "tools": tools, "max_tokens": 4}
    ).encode()


def overflow_body(i: int) -> tuple[str, bytes]:
    fields = OVERFLOW_FIELDS[i % len(OVERFLOW_FIELDS)]
    return COMPLETIONS, json.dumps(
        {"prompt": "Hello", "max_tokens": 4, "temperature": 0.8, **fields}
    ).encode()


def disconnect_sender(url: str, max_tokens: int) -> Callable[[int], str]:
    def send(i: int) -> str:
        body = json.dumps(good_body(i, max_tokens)).encode()
        sock = raw_post(url, COMPLETIONS, body)
        sock.settimeout(30)
        if i % 2:
            sock.recv(1)  # the stream started; then gone
        sock.close()
        return "dropped"

    return send


class SlowReaders(Background):
    """SSE clients that never read (4 KB receive buffer), one every `interval` s, at most `most`,
    until `stop()`; each asks for bulky chunks (top-20 logprobs) so the server's sends block.
    Their sockets close at the block's end."""

    def __init__(self, url: str, most: int, interval: float) -> None:
        super().__init__()
        self.url, self.most, self.interval = url, most, interval
        self.sockets: list[socket.socket] = []

    def work(self, k: int) -> None:
        body = {
            "prompt": TEXT_PROMPTS[0],
            "max_tokens": 64,
            "logprobs": 20,
            "ignore_eos": True,
            "stream": True,
        }
        while len(self.sockets) < self.most and not self.stopped.is_set():
            self.sockets.append(
                raw_post(self.url, COMPLETIONS, json.dumps(body).encode(), rcvbuf=4096)
            )
            self.stopped.wait(self.interval)

    def __exit__(self, *exc: Any) -> None:
        self.stop()
        for s in self.sockets:
            s.close()


class HealthPoller(Background):
    """GET /health every HEALTH_POLL_S on its own thread; keeps the worst latency and non-200s.
    Entering waits for the first answer, so a short phase is polled from its start (a phase
    could otherwise end before the thread's first request)."""

    def __init__(self, url: str) -> None:
        super().__init__(join_s=90)
        self.url = url
        self.latencies: list[float] = []
        self.not_ok: collections.Counter[str] = collections.Counter()
        self._first_answer = threading.Event()

    def __enter__(self):
        super().__enter__()
        self._first_answer.wait(60)
        return self

    def work(self, k: int) -> None:
        import httpx

        with httpx.Client(base_url=self.url, timeout=60.0) as client:
            while not self.stopped.is_set():
                start = time.perf_counter()
                try:
                    status = str(client.get("/health").status_code)
                except httpx.HTTPError as e:
                    status = type(e).__name__
                self.latencies.append(time.perf_counter() - start)
                if status != "200":
                    self.not_ok[status] += 1
                self._first_answer.set()
                self.stopped.wait(HEALTH_POLL_S)

    def summary(self) -> dict:
        return {
            "polls": len(self.latencies),
            "worst_s": max(self.latencies, default=None),
            "p50_s": percentiles(self.latencies)["p50"],
            "not_200": dict(self.not_ok),
        }


# ------------------------------------------------------------------ phases


def run_phase(url: str, args: argparse.Namespace, name: str) -> dict:
    """Good traffic beside the abuse `name` (phases a-f), with /health polled throughout."""
    extra: dict[str, Any] = {}
    with HealthPoller(url) as health, contextlib.ExitStack() as stack:
        abuse: Abuse | None = None
        if name == "slow_readers":
            slow = stack.enter_context(
                SlowReaders(url, args.slow_readers, args.slow_reader_interval)
            )
        elif name == "oversized_bodies":
            abuse = stack.enter_context(Abuse(args.abusers, http_sender(url, oversized_body)))
        elif name == "tool_bombs":
            bomb = tool_bomb_body()
            extra["tool_bomb_bytes"] = len(bomb)
            abuse = stack.enter_context(
                Abuse(args.abusers, http_sender(url, lambda i: (CHAT, bomb)))
            )
        elif name == "overflow_values":
            abuse = stack.enter_context(Abuse(args.abusers, http_sender(url, overflow_body)))
        elif name == "disconnect_storm":
            abuse = stack.enter_context(
                Abuse(args.abusers, disconnect_sender(url, args.max_tokens))
            )
        good = asyncio.run(good_traffic(url, args))
        if name == "slow_readers":
            slow.stop()
            extra.update(slow_readers_opened=len(slow.sockets), **leftovers(url, args.settle))
    if name == "disconnect_storm":
        extra.update(leftovers(url, args.settle))
    if abuse is not None:
        extra["abuse_answers"] = dict(abuse.answers)
    return {"phase": name, "good": good, "health": health.summary(), **extra}


def leftovers(url: str, seconds: float) -> dict:
    """What abusive clients left behind once the engine is done with their requests: wait up to
    `seconds` for the engine to have no running or waiting request (good traffic is over by
    now), then read /metrics. Requests in flight or KV pages in use then are held by clients
    that never read or that left (both must be 0)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        engine_work = [metric(url, f"minivllm_num_requests_{k}") for k in ("running", "waiting")]
        if not any(engine_work):
            break
        time.sleep(0.5)
    return {
        "engine_idle": not any(engine_work),
        "in_flight_when_idle": metric(url, "minivllm_requests_in_flight"),
        "kv_pages_used_when_idle": metric(url, "minivllm_kv_pages_used"),
    }


def _shown_path(path: str) -> str:
    """`path` relative to the repository when it is inside it (no machine paths in results)."""
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return Path(path).name


def tear_pages(disk_dir: Path) -> list[str]:
    """What a crash (or an attacker with the folder) can leave: one page file cut in half, one
    whose JSON header is nested 100k deep. Returns what was done to which file."""
    pages = sorted(disk_dir.rglob("*.kvpage"))
    done = []
    if pages:
        data = pages[0].read_bytes()
        pages[0].write_bytes(data[: len(data) // 2])
        done.append(f"truncated {pages[0].name}")
    if len(pages) > 1:
        pages[1].write_bytes(b'{"a":' * 100_000 + b"1" + b"}" * 100_000 + b"\n" + os.urandom(64))
        done.append(f"100k-deep header in {pages[1].name}")
    return done


# Phase g's prompts start with this (several KV pages), so the restarted server can serve them
# from the disk tier the killed one left behind.
SHARED_PREFIX = (
    "You are a helpful assistant. Answer briefly and clearly, in plain words, and say so when "
    "you do not know. The user asks about geography, history, cooking and programming. "
) * 2


def sigkill_restart(args: argparse.Namespace) -> dict:
    """Phase g: clean run (pages written), SIGKILL mid-run, tear two page files, restart, serve."""
    disk_dir = Path(tempfile.mkdtemp(prefix="minivllm-resilience-kv-"))
    server_args = f"{args.server_args} --kv-disk-dir {disk_dir}"
    with launched_server(args.model, server_args, args.launch_timeout) as (url, _):
        asyncio.run(
            good_traffic(url, args, prefix=SHARED_PREFIX)
        )  # cached, then written to disk at SIGTERM
    killed: dict[str, Any] = {}
    # Two waves at least: once the first wave is done, the second is killed halfway through.
    two_waves = argparse.Namespace(
        **{**vars(args), "requests": max(args.requests, 2 * args.concurrency), "duration": None}
    )
    with launched_server(args.model, server_args, args.launch_timeout) as (url, proc):

        def sigkill() -> None:
            if proc.poll() is None:
                proc.kill()  # SIGKILL: no drain, no clean write of the cache

        def kill_mid_second_wave(results: list[dict]) -> None:
            if (
                len(results) == args.concurrency
            ):  # half a typical request later, the next wave is mid-stream
                e2e = sorted(r["e2e"] for r in results if "e2e" in r) or [1.0]
                killed["after_s"] = e2e[len(e2e) // 2] / 2
                threading.Timer(killed["after_s"], sigkill).start()

        before_kill = asyncio.run(
            good_traffic(url, two_waves, on_done=kill_mid_second_wave, prefix=SHARED_PREFIX)
        )
    # In flight at the SIGKILL, or sent after it: they die with the process (expected, counted apart).
    killed["completed_before"] = before_kill["completed"]
    killed["failed_at_or_after_sigkill"] = before_kill["lost"]
    pages_before_restart = len(list(disk_dir.rglob("*.kvpage")))
    torn = tear_pages(disk_dir)
    start = time.perf_counter()
    with (
        launched_server(args.model, server_args, args.launch_timeout) as (url, proc),
        HealthPoller(url) as health,
    ):
        ready_s = time.perf_counter() - start
        good = asyncio.run(good_traffic(url, args, prefix=SHARED_PREFIX))
        disk_hits = metric(url, 'minivllm_prefix_cache_hit_tokens_total{tier="disk"}')
        alive = proc.poll() is None
    shutil.rmtree(disk_dir, ignore_errors=True)
    return {
        "phase": "sigkill_restart",
        "good": good,
        "health": health.summary(),
        "killed": killed,
        "kv_disk_pages_before_restart": pages_before_restart,
        "torn_files": torn,
        "restart_ready_s": ready_s,
        "served_after_restart": alive,
        "disk_hit_tokens_after_restart": disk_hits,
    }


# ------------------------------------------------------------------ report


def print_phase(r: dict) -> None:
    g, h = r["good"], r["health"]
    goodput = "-" if g["goodput"] is None else f"{100 * g['goodput']:.0f}%"
    print(
        f"{r['phase']:<18}{goodput:>9}{ms(g['ttft_s']['p50']):>10}{ms(g['ttft_s']['p95']):>10}"
        f"{ms(g['tpot_s']['p50']):>10}{g['lost']:>6}{ms(h['worst_s']):>12}  "
        + ", ".join(f"{k}={v}" for k, v in r.items() if k not in ("phase", "good", "health")),
        flush=True,
    )
    for e in g["lost_samples"]:
        print(f"  lost: {e}", file=sys.stderr)


def plot(result: dict, out: str) -> Path:
    """Goodput and TTFT p50 (p95 as a tick) of the good traffic in each phase."""
    fig, axes = new_figure(2, width=6.0)
    (ax, bx), phases, slo = axes[0], result["phases"], result["slo"]
    x = np.arange(len(phases))
    goodput = [100 * (p["good"]["goodput"] or 0) for p in phases]
    lost = [p["good"]["lost"] for p in phases]
    bars = ax.bar(x, goodput, color=["tab:red" if n else "tab:blue" for n in lost])
    ax.bar_label(bars, [f"{n} lost" if n else "" for n in lost], fontsize=8, color="tab:red")
    title = f"goodput (TTFT <= {slo['ttft_ms']:g} ms, TPOT <= {slo['tpot_ms']:g} ms)"
    ax.set(ylim=(0, 110), ylabel="good requests meeting the SLO (%)", title=title)
    ttft = lambda q: [1e3 * (p["good"]["ttft_s"][q] or 0) for p in phases]  # noqa: E731
    bx.bar(x, ttft("p50"), label="p50")
    bx.plot(x, ttft("p95"), "k_", markersize=18, label="p95")
    bx.set(yscale="log", ylabel="TTFT (ms)", title="good-traffic TTFT")
    bx.legend(fontsize=8)
    for a in (ax, bx):
        a.set_xticks(x, [p["phase"].replace("_", "\n") for p in phases], fontsize=8)
        a.grid(alpha=0.3, axis="y")
    fig.suptitle(
        f"{result['model']}: {result['flags']['concurrency']} good streams beside each abusive client "
        f"(red: good requests lost)",
        fontsize=10,
    )
    return save_plot(fig, out)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    phases: list[dict] = []
    header = (
        f"{'phase':<18}{'goodput':>9}{'TTFT p50':>10}{'TTFT p95':>10}{'TPOT p50':>10}{'lost':>6}"
        f"{'/health max':>12}  (ms)"
    )
    in_server = [p for p in args.phases if p != "sigkill_restart"]
    if in_server:
        with launched_server(args.model, args.server_args, args.launch_timeout) as (url, _):
            asyncio.run(
                good_traffic(
                    url,
                    SimpleNamespace(
                        **{**vars(args), "requests": args.concurrency, "duration": None}
                    ),
                )
            )  # warm-up, untimed
            print(header, flush=True)
            for name in in_server:
                phases.append(run_phase(url, args, name))
                print_phase(phases[-1])
    if "sigkill_restart" in args.phases:
        phases.append(sigkill_restart(args))
        if not in_server:
            print(header)
        print_phase(phases[-1])
    lost = sum(p["good"]["lost"] for p in phases)
    tool_phase = next((p for p in phases if p["phase"] == "tool_bombs"), None)
    result = {
        "benchmark": "resilience",
        "model": args.model,
        "flags": {**vars(args), "out": _shown_path(args.out)},
        "server_args": args.server_args,
        "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms},
        "git": git_state(),
        "lost_good_requests": lost,
        "health_worst_s_during_tool_bombs": tool_phase["health"]["worst_s"] if tool_phase else None,
        "phases": phases,
    }
    print(
        f"lost good requests: {lost} (must be 0); /health worst during tool bombs: "
        f"{ms(result['health_worst_s_during_tool_bombs'])} ms"
    )
    write_result(result, args.out)
    plot(result, args.out)
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main())
