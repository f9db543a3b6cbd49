"""Prometheus metrics of the server (``GET /metrics``).

HTTP metrics are recorded per request by an ASGI middleware, labelled by the route
*template* (``/v2/models/{name}/infer``), never the raw path, so a client cannot
grow the label set. gRPC requests (``--grpc-port``) are recorded into the same registry
by the gRPC service, in families of their own labelled by RPC method and status code
(:class:`GrpcMetrics`); both sides' families have the same shape (a counter, a latency
histogram with the same buckets, an in-flight gauge), so one dashboard query covers
either transport. Batching metrics are read from ``BatchedSession.stats()`` at
scrape time by a custom collector, so the hot path pays nothing for them.

Each server gets its own registry, so several servers (and tests) in one process
never share counters.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from .._extras import require

__all__ = ["GeneratorCollector", "GrpcMetrics", "ServerMetrics", "SessionCollector"]

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_ROWS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class SessionCollector:
    """Exposes a BatchedSession's stats as Prometheus families at scrape time."""

    def __init__(self, stats: Callable[[], Any]) -> None:
        self._stats = stats

    def describe(self) -> list[Any]:
        return []  # families are produced only at collect time

    def collect(self) -> Iterator[Any]:
        core = require("prometheus_client.core")
        s = self._stats()
        yield core.GaugeMetricFamily("ortbatch_queue_depth", "Requests waiting in the batching queue", value=s.queued)
        yield core.GaugeMetricFamily(
            "ortbatch_padding_fraction",
            "Share of padded elements in all batches run (0 = no padding)",
            value=s.padding_fraction,
        )
        yield core.CounterMetricFamily(
            "ortbatch_session_requests", "Requests submitted to the BatchedSession", value=s.requests
        )
        yield core.CounterMetricFamily("ortbatch_batches", "Batches run", value=s.batches)
        yield core.CounterMetricFamily(
            "ortbatch_batches_alone",
            "Batches that ran with nothing else queued or running (the idle path)",
            value=getattr(s, "alone_batches", 0),
        )
        failed = core.CounterMetricFamily(
            "ortbatch_session_failures", "Requests that ended in an error, by error type", labels=["error"]
        )
        for name, count in sorted(s.errors.items()):
            failed.add_metric([name], count)
        yield failed
        hist = sorted(s.rows_histogram.items())
        buckets = []
        for le in _ROWS_BUCKETS:
            buckets.append((str(le), sum(c for rows, c in hist if rows <= le)))
        buckets.append(("+Inf", sum(c for _, c in hist)))
        yield core.HistogramMetricFamily("ortbatch_batch_rows", "Rows per batch run", buckets=buckets, sum_value=s.rows)


class GeneratorCollector:
    """Exposes a BatchedGenerator's stats as Prometheus families at scrape time."""

    def __init__(self, stats: Callable[[], Any]) -> None:
        self._stats = stats

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        core = require("prometheus_client.core")
        s = self._stats()
        yield core.GaugeMetricFamily("ortbatch_queue_depth", "Requests waiting for admission", value=s.queued)
        yield core.GaugeMetricFamily("ortbatch_generation_active_rows", "Sequences being decoded", value=s.active_rows)
        yield core.GaugeMetricFamily(
            "ortbatch_generation_cache_padding_fraction",
            "Mean share of the KV cache that is padding, over decode steps",
            value=s.cache_padding_fraction,
        )
        outcomes = core.CounterMetricFamily(
            "ortbatch_generation_requests", "Generation requests, by outcome", labels=["outcome"]
        )
        for outcome in ("submitted", "completed", "failed", "cancelled", "timed_out", "rejected"):
            outcomes.add_metric([outcome], getattr(s, outcome))
        yield outcomes
        yield core.CounterMetricFamily(
            "ortbatch_generation_prompt_tokens", "Prompt tokens prefilled", value=s.prompt_tokens
        )
        yield core.CounterMetricFamily(
            "ortbatch_generation_generated_tokens", "Tokens generated", value=s.generated_tokens
        )
        yield core.CounterMetricFamily(
            "ortbatch_generation_decode_steps", "Batched decode steps run", value=s.decode_steps
        )
        yield core.CounterMetricFamily(
            "ortbatch_generation_decode_rows",
            "Rows decoded, summed over steps",
            value=round(s.mean_decode_rows * s.decode_steps),
        )
        yield from _prefix_cache_families(core, s)


#: the prefix cache's counters: (family, ``GenerationStats`` field, help)
_PREFIX_COUNTERS = (
    ("lookups", "prefix_cache_lookups", "Prompts looked up in the prefix cache"),
    ("hits", "prefix_cache_hits", "Prompts that reused a cached prefix"),
    ("tokens_saved", "prefix_cache_tokens_saved", "Prompt tokens not run because their keys and values were cached"),
    (
        "evictions",
        "prefix_cache_evictions",
        "Cached prefix blocks evicted (least recently used first) to stay within budget",
    ),
)


def _prefix_cache_families(core: Any, s: Any) -> Iterator[Any]:
    """The prefix cache's counters (zero where it is off or the KV cache is the export's own)."""
    for name, field, help_text in _PREFIX_COUNTERS:
        yield core.CounterMetricFamily(
            f"ortbatch_generation_prefix_cache_{name}", help_text, value=getattr(s, field, 0)
        )
    yield core.GaugeMetricFamily(
        "ortbatch_generation_prefix_cache_bytes",
        "Bytes the prefix cache holds",
        value=getattr(s, "prefix_cache_bytes", 0),
    )


class _InFlight:
    """An in-flight gauge kept as a plain count and read at scrape time, so the hot path's
    ``inc``/``dec`` take no lock. Each is changed from one event loop's thread only (the
    HTTP server's, or the gRPC server's)."""

    __slots__ = ("value",)

    def __init__(self, prom: Any, name: str, documentation: str, registry: Any) -> None:
        self.value = 0
        prom.Gauge(name, documentation, registry=registry).set_function(self._read)

    def _read(self) -> float:
        return float(self.value)

    def inc(self) -> None:
        self.value += 1

    def dec(self) -> None:
        self.value -= 1


class _Series:
    """A request counter and a latency histogram, their labelled children looked up once
    per label set (a bounded set: route templates or RPC methods, methods, status codes)."""

    __slots__ = ("_children", "latency", "requests")

    def __init__(self, requests: Any, latency: Any) -> None:
        self.requests, self.latency = requests, latency
        self._children: dict[tuple[str, ...], tuple[Any, Any]] = {}

    def observe(self, labels: tuple[str, ...], latency_labels: tuple[str, ...], started: float) -> None:
        """Count one request under ``labels`` and its latency under ``latency_labels``
        (which ``labels`` determine)."""
        children = self._children.get(labels)
        if children is None:
            children = (self.requests.labels(*labels), self.latency.labels(*latency_labels))
            self._children[labels] = children
        children[0].inc()
        children[1].observe(time.perf_counter() - started)


class GrpcMetrics:
    """The gRPC service's instruments, in a :class:`ServerMetrics` registry.

    One observation per unary RPC, and one per request of a ``ModelStreamInfer`` stream
    (method ``ModelStreamInfer``, its answer's code), so the counts are requests answered,
    as over HTTP. ``method`` is always one of the service's RPC names and ``code`` a
    ``grpc.StatusCode`` name: the label set stays bounded whatever clients send.
    """

    def __init__(self, registry: Any) -> None:
        prom = require("prometheus_client")
        self.requests = prom.Counter(
            "ortbatch_grpc_requests",
            "gRPC requests answered, by RPC method and status code",
            ["method", "code"],
            registry=registry,
        )
        self.latency = prom.Histogram(
            "ortbatch_grpc_request_duration_seconds",
            "Time from a gRPC request's arrival to its answer, by RPC method and status code",
            ["method", "code"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.in_flight = _InFlight(
            prom, "ortbatch_grpc_requests_in_flight", "gRPC requests being handled now", registry
        )
        self._series = _Series(self.requests, self.latency)

    def observe(self, method: str, code: str, started: float) -> None:
        """Record one answered request (``started`` from :func:`time.perf_counter`)."""
        self._series.observe((method, code), (method, code), started)


class ServerMetrics:
    """The server's Prometheus registry and the instruments the app records into."""

    def __init__(
        self, stats: Callable[[], Any] | None = None, generator_stats: Callable[[], Any] | None = None
    ) -> None:
        prom = require("prometheus_client")
        self._prom = prom
        self.registry = prom.CollectorRegistry(auto_describe=False)
        self.requests = prom.Counter(
            "ortbatch_http_requests",
            "HTTP requests answered, by endpoint (route template), method and status",
            ["endpoint", "method", "status"],
            registry=self.registry,
        )
        self.latency = prom.Histogram(
            "ortbatch_http_request_duration_seconds",
            "Time from request start to the last byte of the response, by endpoint and status",
            ["endpoint", "status"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.in_flight = _InFlight(
            prom, "ortbatch_http_requests_in_flight", "HTTP requests being handled now", self.registry
        )
        self._series = _Series(self.requests, self.latency)
        self._grpc: GrpcMetrics | None = None
        self._grpc_lock = threading.Lock()
        if stats is not None:
            self.registry.register(SessionCollector(stats))
        if generator_stats is not None:
            self.registry.register(GeneratorCollector(generator_stats))

    def observe(self, endpoint: str, method: str, status: int, started: float) -> None:
        """Record one answered request (``started`` from :func:`time.perf_counter`)."""
        code = str(status)
        self._series.observe((endpoint, method, code), (endpoint, code), started)

    def grpc(self) -> GrpcMetrics:
        """The gRPC families, registered on first call (a server without gRPC exports none)."""
        with self._grpc_lock:
            if self._grpc is None:
                self._grpc = GrpcMetrics(self.registry)
            return self._grpc

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return self._prom.generate_latest(self.registry), self._prom.CONTENT_TYPE_LATEST
