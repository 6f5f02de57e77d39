"""Benchmarks over HTTP: a server of our own on a loopback port, and the streaming client that
times one request (TTFT, inter-token gaps, TPOT) by parsing its SSE. No JAX in this process:
the client side of a serving benchmark stays light."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.lib.report import ROOT


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def launched_server(
    model: str,
    server_args: str,
    timeout: float,
    api_key: str | None = None,
    env: dict[str, str] | None = None,
    poll_s: float = 0.5,
) -> Iterator[tuple[str, subprocess.Popen]]:
    """Run `python -m server` on a free loopback port until the block ends (then SIGTERM);
    yields its URL and process once /health says 200 (polled every `poll_s`). `env` adds to
    the server's environment. The log goes to a temp file, shown on failure; a server the
    caller killed is not warned about."""
    import httpx

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = Path(tempfile.mkdtemp(prefix="minivllm-bench-server-")) / "server.log"
    cmd = [sys.executable, "-m", "server", "--model", model, "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--log-level", "warning", *shlex.split(server_args)]
    env = {**os.environ, **(env or {}), **({"MINIVLLM_API_KEY": api_key} if api_key else {})}
    print(f"launching: {shlex.join(cmd)} (log: {log})", flush=True)
    start = time.perf_counter()
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(
                    f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
                )
            if time.perf_counter() - start > timeout:
                raise SystemExit(
                    f"server not ready after {timeout:.0f} s:\n{log.read_text()[-3000:]}"
                )
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            time.sleep(poll_s)
        print(f"server ready after {time.perf_counter() - start:.1f} s", flush=True)
        yield url, proc
    finally:
        ended_by_caller = proc.poll() is not None
        if not ended_by_caller:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)
    if proc.returncode != 0 and not ended_by_caller:
        print(
            f"warning: the server exited with {proc.returncode} after SIGTERM (log: {log})",
            file=sys.stderr,
        )
    else:
        shutil.rmtree(log.parent, ignore_errors=True)


async def one_request(client: Any, args: argparse.Namespace, body: dict) -> dict:
    """Stream one request; returns its timings (TTFT from when it was sent) or its error."""
    path = "/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions"
    body = {"model": args.model, **body}
    start = time.perf_counter()
    chunk_times: list[float] = []
    tokens, done = None, False
    try:
        async with client.stream("POST", path, json=body, timeout=args.request_timeout) as r:
            if r.status_code != 200:
                return {"error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    return {"error": f"stream error: {chunk['error']}"}
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                for c in chunk["choices"]:
                    if c.get("text") or (c.get("delta") or {}).get("content"):
                        chunk_times.append(time.perf_counter())
    except Exception as e:  # connection errors, timeouts
        return {"error": f"{type(e).__name__}: {e}"}
    end = time.perf_counter()
    if not done or not chunk_times or tokens is None:
        return {"error": "stream ended without content, usage or [DONE]"}
    return {
        "ttft": chunk_times[0] - start,
        "itl": [b - a for a, b in zip(chunk_times, chunk_times[1:])],
        "tpot": (chunk_times[-1] - chunk_times[0]) / (tokens - 1) if tokens > 1 else None,
        "e2e": end - start,
        "tokens": tokens,
    }


def metric(url: str, name: str) -> float | None:
    """One unlabelled (or exactly labelled) sample of /metrics, or None when absent."""
    import httpx

    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return None
