"""Server metrics in the Prometheus text exposition format (no client library needed).

Example::

    metrics = Metrics()
    metrics.observe_request("/v1/completions", 200, duration_s=0.12)
    metrics.render(queue_depth=0, running=1)  # "# HELP tandem_requests_total ..."
"""
from __future__ import annotations

import math
import threading
from typing import Any

LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
INTER_TOKEN_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
KNOWN_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")


class Histogram:
    """Cumulative-bucket histogram (Prometheus semantics: ``le`` buckets, ``_sum``, ``_count``)."""

    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS_S):
        self.buckets = buckets
        self.counts = [0] * len(buckets)  # non-cumulative per bucket
        self.overflow = 0
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.total += value
        self.count += 1
        for i, upper in enumerate(self.buckets):
            if value <= upper:
                self.counts[i] += 1
                return
        self.overflow += 1

    def lines(self, name: str, labels: str = "") -> list[str]:
        sep = "," if labels else ""
        out, running = [], 0
        for upper, n in zip(self.buckets, self.counts):
            running += n
            out.append(f'{name}_bucket{{{labels}{sep}le="{_fmt(upper)}"}} {running}')
        out.append(f'{name}_bucket{{{labels}{sep}le="+Inf"}} {self.count}')
        suffix = f"{{{labels}}}" if labels else ""
        out.append(f"{name}_sum{suffix} {_fmt(self.total)}")
        out.append(f"{name}_count{suffix} {self.count}")
        return out


def _fmt(value: float) -> str:
    if isinstance(value, int) or (math.isfinite(value) and value == int(value) and abs(value) < 1e15):
        return str(int(value))
    return repr(float(value))


def endpoint_label(path: str) -> str:
    """Bound label cardinality: known routes keep their path, everything else is ``other``."""
    if path in KNOWN_ENDPOINTS:
        return path
    if path.startswith("/v1/models/"):
        return "/v1/models"
    return "other"


class Metrics:
    """Thread-safe counters, gauges and histograms of one server."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: dict[tuple[str, int], int] = {}
        self._latency: dict[str, Histogram] = {}
        self._ttft = Histogram()
        self._queue_wait = Histogram()
        self.prompt_tokens_total = 0
        self.generated_tokens_total = 0
        self.generations_total = 0
        self.cancelled_total = 0
        self.timeouts_total = 0
        self.rejected_total = 0
        self.cache_hit_rate: float | None = None
        self._batch_size = Histogram(BATCH_SIZE_BUCKETS)
        self._inter_token = Histogram(INTER_TOKEN_BUCKETS_S)
        self.preemptions_total = 0
        self.pool: Any = None  # the scheduler's KVPool (gauges read live at render time)
        self.decode_tokens_per_s: float | None = None
        self.speculation: Any = None  # the loop's BatchSpeculation (counters read at render time)

    def observe_request(self, path: str, status: int, duration_s: float) -> None:
        endpoint = endpoint_label(path)
        with self._lock:
            key = (endpoint, int(status))
            self._requests[key] = self._requests.get(key, 0) + 1
            self._latency.setdefault(endpoint, Histogram()).observe(duration_s)

    def observe_generation(self, prompt_tokens: int, generated_tokens: int, stats: dict[str, Any] | None,
                           queue_wait_s: float) -> None:
        stats = stats or {}
        with self._lock:
            self.generations_total += 1
            self.prompt_tokens_total += int(prompt_tokens)
            self.generated_tokens_total += int(generated_tokens)
            self._queue_wait.observe(queue_wait_s)
            ttft = stats.get("ttft_s")
            if isinstance(ttft, (int, float)) and math.isfinite(ttft):
                self._ttft.observe(float(ttft))
            rate = _hit_rate(stats)
            if rate is not None:
                self.cache_hit_rate = rate
            tps = stats.get("decode_tokens_per_s")
            if isinstance(tps, (int, float)) and math.isfinite(tps):
                self.decode_tokens_per_s = float(tps)

    def observe_batch(self, n_sequences: int) -> None:
        """One batching step of ``n_sequences``."""
        with self._lock:
            self._batch_size.observe(n_sequences)

    def observe_inter_token(self, seconds: float) -> None:
        with self._lock:
            self._inter_token.observe(seconds)

    def count_batch(self, what: str) -> None:
        """Increment a batching counter (``preemptions``)."""
        self.count(what)

    def count(self, what: str) -> None:
        """Increment ``cancelled``, ``timeouts`` or ``rejected``."""
        with self._lock:
            setattr(self, f"{what}_total", getattr(self, f"{what}_total") + 1)

    def requests(self, endpoint: str, status: int) -> int:
        with self._lock:
            return self._requests.get((endpoint, status), 0)

    def render(self, queue_depth: int, running: int) -> str:
        with self._lock:
            lines: list[str] = []

            def metric(name: str, kind: str, help_text: str, samples: list[str]) -> None:
                lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *samples])

            metric("tandem_requests_total", "counter", "HTTP requests by endpoint and status code.",
                   [f'tandem_requests_total{{endpoint="{e}",status="{s}"}} {n}'
                    for (e, s), n in sorted(self._requests.items())])
            latency: list[str] = []
            for endpoint, hist in sorted(self._latency.items()):
                latency += hist.lines("tandem_request_duration_seconds", f'endpoint="{endpoint}"')
            metric("tandem_request_duration_seconds", "histogram", "Request latency until the last byte.", latency)
            metric("tandem_time_to_first_token_seconds", "histogram", "Engine time to first token.",
                   self._ttft.lines("tandem_time_to_first_token_seconds"))
            metric("tandem_queue_wait_seconds", "histogram", "Time a request waited for the engine.",
                   self._queue_wait.lines("tandem_queue_wait_seconds"))
            metric("tandem_batch_size", "histogram", "Sequences stepped together per batching iteration.",
                   self._batch_size.lines("tandem_batch_size"))
            metric("tandem_inter_token_latency_seconds", "histogram", "Time between two tokens of one sequence.",
                   self._inter_token.lines("tandem_inter_token_latency_seconds"))
            pool = {} if self.pool is None else {
                "used": self.pool.n_used, "total": self.pool.n_blocks, "hit_tokens": self.pool.counters.hits_tokens,
                "evictions": self.pool.counters.evictions, "copies": self.pool.counters.copies}
            for name, kind, help_text, value in (
                ("tandem_kv_pool_blocks_used", "gauge", "KV pool blocks referenced by sequences.", pool.get("used", 0)),
                ("tandem_kv_pool_blocks_total", "gauge", "KV pool blocks in all.", pool.get("total", 0)),
                ("tandem_prefix_cache_hit_tokens_total", "counter", "Prompt tokens whose KV was reused from the prefix cache.",
                 pool.get("hit_tokens", 0)),
                ("tandem_kv_evictions_total", "counter", "Cached KV blocks evicted to make room.", pool.get("evictions", 0)),
                ("tandem_kv_copies_total", "counter", "KV blocks copied on write (n > 1 forks).", pool.get("copies", 0)),
                ("tandem_preemptions_total", "counter", "Sequences preempted (KV freed, recomputed later).",
                 self.preemptions_total),
            ):
                metric(name, kind, help_text, [f"{name} {value}"])
            for name, help_text, value in (
                ("tandem_prompt_tokens_total", "Prompt tokens processed.", self.prompt_tokens_total),
                ("tandem_generated_tokens_total", "Tokens generated.", self.generated_tokens_total),
                ("tandem_generations_total", "Generations run to completion.", self.generations_total),
                ("tandem_cancelled_total", "Generations stopped because the client went away.", self.cancelled_total),
                ("tandem_timeouts_total", "Requests that ran past the per-request timeout.", self.timeouts_total),
                ("tandem_rejected_total", "Requests rejected with 429 because the queue was full.", self.rejected_total),
            ):
                metric(name, "counter", help_text, [f"{name} {value}"])
            spec = self.speculation.counters.as_dict() if self.speculation is not None and self.speculation.enabled else None
            for key, name, help_text in (
                ("draft_tokens", "tandem_spec_draft_tokens_total", "Tokens drafted by serve --speculate."),
                ("accepted_tokens", "tandem_spec_accepted_tokens_total", "Drafted tokens the verifier accepted."),
                ("verify_steps", "tandem_spec_verify_steps_total", "Sequence steps that verified a draft."),
            ) if spec is not None else ():
                metric(name, "counter", help_text, [f"{name} {spec[key]}"])
            metric("tandem_queue_depth", "gauge", "Requests waiting for the engine.", [f"tandem_queue_depth {queue_depth}"])
            metric("tandem_running_requests", "gauge", "Requests being generated now.", [f"tandem_running_requests {running}"])
            if self.cache_hit_rate is not None:
                metric("tandem_cache_hit_rate", "gauge", "Engine cache hit rate of the last generation (0..1).",
                       [f"tandem_cache_hit_rate {_fmt(self.cache_hit_rate)}"])
            if self.decode_tokens_per_s is not None:
                metric("tandem_decode_tokens_per_second", "gauge", "Decode speed of the last generation.",
                       [f"tandem_decode_tokens_per_second {_fmt(self.decode_tokens_per_s)}"])
            return "\n".join(lines) + "\n"


def _hit_rate(stats: dict[str, Any]) -> float | None:
    """The engine's cache hit rate, if it reports one (``cache_hit_rate`` or any ``*hit_rate`` key)."""
    keys = ["cache_hit_rate"] + sorted(k for k in stats if isinstance(k, str) and k.endswith("hit_rate"))
    for key in keys:
        value = stats.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
    return None
