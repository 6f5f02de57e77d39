"""Prometheus text exposition, written by hand (no client library): gauges read from the
engine's latest `EngineStats`, counters and latency histograms kept by the server.

Everything here is touched from the event loop only (the engine thread publishes an immutable
`EngineStats` snapshot instead), so no locks are needed.
"""

from __future__ import annotations

import bisect
from collections import Counter

# The engine's snapshot (`LLMEngine.stats()`), published by the engine thread after each iteration.
from minivllm_jax.engine.stats import EngineStats

__all__ = ["EngineStats", "Histogram", "ServerMetrics"]

LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
TTFT_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.1,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    3.0,
    5.0,
    10.0,
    20.0,
    60.0,
)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
PREFIX = "minivllm_"
# The method label takes only these values: a client choosing its own method (FOO, PROPFIND)
# must not be able to create new series. "WS" is a WebSocket handshake.
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "WS"})


class Histogram:
    """Cumulative-bucket histogram in the Prometheus format (`_bucket{le=...}`, `_sum`, `_count`)."""

    def __init__(self, name: str, help: str, buckets: tuple[float, ...]) -> None:
        self.name, self.help, self.buckets = PREFIX + name, help, buckets
        self.counts = [0] * (len(buckets) + 1)  # the last slot is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, count: int = 1) -> None:
        """Record `count` observations of `value` (a step that produced several tokens at once)."""
        self.counts[bisect.bisect_left(self.buckets, value)] += count
        self.sum += value * count
        self.count += count

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        running = 0
        for bound, n in zip(self.buckets, self.counts):
            running += n
            lines.append(f'{self.name}_bucket{{le="{bound}"}} {running}')
        lines.append(f'{self.name}_bucket{{le="+Inf"}} {self.count}')
        lines.append(f"{self.name}_sum {self.sum:.6f}")
        lines.append(f"{self.name}_count {self.count}")
        return lines


def _tier_metrics(stats: EngineStats) -> list[str]:
    """Each KV tier: pages in memory are `kv_pages_used`; these are the swap pool and the disk."""
    out = _metric(
        "kv_swap_pages",
        "gauge",
        "KV pages of preempted sequences held in the host swap pool.",
        [("", stats.swap_pages)],
    )
    out += _metric(
        "kv_swap_outs_total",
        "counter",
        "Preempted sequences whose KV was swapped out.",
        [("", stats.swap_outs)],
    )
    out += _metric(
        "kv_swap_ins_total",
        "counter",
        "Swapped-out sequences whose KV was copied back.",
        [("", stats.swap_ins)],
    )
    out += _metric(
        "kv_disk_pages",
        "gauge",
        "KV pages in the prefix cache's disk tier.",
        [("", stats.disk_pages)],
    )
    out += _metric(
        "kv_disk_bytes", "gauge", "Bytes of the disk tier's page files.", [("", stats.disk_bytes)]
    )
    out += _metric(
        "kv_disk_pages_written_total",
        "counter",
        "Pages written to the disk tier.",
        [("", stats.disk_pages_written)],
    )
    out += _metric(
        "kv_disk_corrupt_total",
        "counter",
        "Disk-tier page files that failed their checks (served as misses).",
        [("", stats.disk_corrupt)],
    )
    out += _metric(
        "prefix_cache_hit_tokens_total",
        "counter",
        "Prompt tokens served from cached KV, by tier.",
        [
            (_labels(tier="memory"), stats.memory_hit_tokens),
            (_labels(tier="disk"), stats.disk_hit_tokens),
        ],
    )
    out += _metric(
        "kv_compression_dropped_pages_total",
        "counter",
        "KV pages dropped by a compression policy.",
        [("", stats.dropped_pages)],
    )
    return out


def _metric(name: str, kind: str, help: str, samples: list[tuple[str, float]]) -> list[str]:
    lines = [f"# HELP {PREFIX}{name} {help}", f"# TYPE {PREFIX}{name} {kind}"]
    lines += [f"{PREFIX}{name}{labels} {_num(v)}" for labels, v in samples]
    return lines


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(float(v))


def _labels(**kv: str) -> str:
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in kv.items())
    return "{" + inner + "}"


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class ServerMetrics:
    """Latency histograms and request counters; `render()` adds the engine gauges."""

    def __init__(self) -> None:
        self.ttft = Histogram(
            "time_to_first_token_seconds",
            "Request arrival at the server to its first generated token.",
            TTFT_BUCKETS,
        )
        self.itl = Histogram(
            "time_per_output_token_seconds",
            "Time between a request's consecutive output tokens.",
            LATENCY_BUCKETS,
        )
        self.e2e = Histogram(
            "e2e_request_latency_seconds", "Request arrival to its last token.", E2E_BUCKETS
        )
        self.http_requests: Counter[tuple[str, str, int]] = Counter()
        self.finished: Counter[str] = Counter()
        self.slow_readers_dropped: Counter[str] = Counter()  # by transport: "sse" or "websocket"

    def observe_http(self, method: str, route: str, status: int) -> None:
        """`route` must already be bounded (`middleware.route_label`); `method` is bounded here."""
        self.http_requests[(method if method in METHODS else "other", route, status)] += 1

    def observe_slow_reader(self, transport: str) -> None:
        """A client that read nothing for the send timeout lost its request and connection."""
        self.slow_readers_dropped[transport] += 1

    def observe_finished(self, reason: str, e2e_seconds: float) -> None:
        self.finished[reason] += 1
        self.e2e.observe(e2e_seconds)

    def render(self, stats: EngineStats | None, *, ready: bool, in_flight: int) -> str:
        out = _metric(
            "ready", "gauge", "1 once the model is loaded and warmed up.", [("", float(ready))]
        )
        out += _metric(
            "requests_in_flight",
            "gauge",
            "Requests admitted by the server and not finished.",
            [("", in_flight)],
        )
        if stats is not None:
            used = stats.usable_pages - stats.free_pages
            out += _metric(
                "num_requests_running",
                "gauge",
                "Sequences in the running batch.",
                [("", stats.running)],
            )
            out += _metric(
                "num_requests_waiting",
                "gauge",
                "Sequences waiting to be scheduled.",
                [("", stats.waiting)],
            )
            out += _metric(
                "kv_pages_used", "gauge", "KV cache pages held by sequences.", [("", used)]
            )
            out += _metric(
                "kv_pages_free",
                "gauge",
                "KV cache pages free to allocate.",
                [("", stats.free_pages)],
            )
            out += _metric(
                "kv_pages_total",
                "gauge",
                "Usable KV cache pages (the scratch page excluded).",
                [("", stats.usable_pages)],
            )
            out += _metric(
                "kv_cache_usage_ratio",
                "gauge",
                "Fraction of KV pages in use.",
                [("", used / stats.usable_pages if stats.usable_pages else 0.0)],
            )
            out += _metric(
                "generation_tokens_total",
                "counter",
                "Tokens generated.",
                [("", stats.generated_tokens)],
            )
            out += _metric(
                "prompt_tokens_total",
                "counter",
                "Prompt tokens prefilled (recomputation included).",
                [("", stats.prompt_tokens)],
            )
            out += _metric(
                "compiles_total",
                "counter",
                "XLA programs compiled (constant after warm-up).",
                [("", stats.compiles)],
            )
            out += _metric(
                "programs_loaded_total",
                "counter",
                "Of compiles_total, programs loaded whole from the program cache at start-up.",
                [("", stats.programs_loaded)],
            )
            out += _metric(
                "preemptions_total",
                "counter",
                "Sequences preempted under KV page pressure.",
                [("", stats.preemptions)],
            )
            out += _metric(
                "engine_steps_total", "counter", "Engine steps run.", [("", stats.steps)]
            )
            out += _metric(
                "spec_decode_num_draft_tokens_total",
                "counter",
                "Speculative decoding: draft tokens proposed and verified.",
                [("", stats.draft_tokens)],
            )
            out += _metric(
                "spec_decode_num_accepted_tokens_total",
                "counter",
                "Speculative decoding: draft tokens accepted.",
                [("", stats.accepted_tokens)],
            )
            out += _metric(
                "spec_decode_acceptance_rate",
                "gauge",
                "Accepted over proposed draft tokens so far.",
                [("", stats.accepted_tokens / stats.draft_tokens if stats.draft_tokens else 0.0)],
            )
            out += _tier_metrics(stats)
        out += _metric(
            "requests_finished_total",
            "counter",
            "Requests finished, by finish reason.",
            [(_labels(finish_reason=r), n) for r, n in sorted(self.finished.items())],
        )
        out += _metric(
            "slow_readers_dropped_total",
            "counter",
            "Streams aborted, connections dropped: the client read nothing for the send timeout.",
            [(_labels(transport=t), self.slow_readers_dropped[t]) for t in ("sse", "websocket")],
        )
        out += _metric(
            "http_requests_total",
            "counter",
            "HTTP and WebSocket requests by route and status.",
            [
                (_labels(method=m, route=r, status=str(s)), n)
                for (m, r, s), n in sorted(self.http_requests.items())
            ],
        )
        for h in (self.ttft, self.itl, self.e2e):
            out += h.render()
        return "\n".join(out) + "\n"
