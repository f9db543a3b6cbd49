"""OpenTelemetry traces of ``ortbatch serve`` (``--otlp-endpoint URL``, or the standard
``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` variables).

Each request is one trace, its parent taken from the client's W3C ``traceparent`` when it
sends one (HTTP header or gRPC metadata)::

    POST /v1/embeddings                 the request (SERVER span; http/tracing.py, gRPC's handler)
      ortbatch.tokenize                 the texts tokenized (served/model.py)
      ortbatch.queue                    one per row: waiting for a batch
      ortbatch.batch                    the batch run it joined: ortbatch.batch.id (shared by
                                        every request of the batch), .rows, .requests,
                                        .padded_tokens, .real_tokens
    POST /v1/completions
      ortbatch.generate                 one per prompt: ortbatch.ttft_s, prompt and completion
                                        tokens, finish reason; events: prefill (its batch
                                        id), a decode step in every 16 (rows), first token

The spans of a batch are made from the runtime's observer records
(:mod:`ortbatch._observe`) on its worker thread, after the answers are settled; the SDK's
batch processor exports them from its own thread.

With no endpoint nothing of OpenTelemetry is imported and the runtimes get no observer
(``tests/serve/test_tracing.py`` checks ``sys.modules``). The SDK is the ``tracing``
extra's. The exporter speaks OTLP over HTTP (protobuf) unless
``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` / ``OTEL_EXPORTER_OTLP_PROTOCOL`` says ``grpc``;
the SDK reads the other ``OTEL_*`` variables itself (headers, timeout, sampler, batch
sizes, ``OTEL_SERVICE_NAME``: default ``ortbatch``).

This module is serve's floor: it imports nothing of serve, and the core, the transports
and the runners all use it.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from typing import Any

from .._extras import require

__all__ = [
    "STEP_EVERY",
    "Tracing",
    "active",
    "configure",
    "endpoint_from_env",
    "observe",
    "shutdown",
    "span",
    "traced_request",
]

#: one decode step in this many becomes an event of each generation span it decoded
STEP_EVERY = 16
_TRACES_PATH = "/v1/traces"

_active: Tracing | None = None
_lock = threading.Lock()


def endpoint_from_env() -> str | None:
    """The endpoint the ``OTEL_*`` variables set (None when tracing is off by them)."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    if os.environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "none":
        return None
    return os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")


def configure(endpoint: str | None) -> Tracing | None:
    """The process's tracing for ``endpoint`` (``--otlp-endpoint``; None: the ``OTEL_*``
    variables'), made on first use and kept until :func:`shutdown`; None when neither sets
    one (then nothing of OpenTelemetry is imported)."""
    global _active
    if endpoint is None and endpoint_from_env() is None:
        return None
    key = endpoint or ""
    with _lock:
        if _active is None or _active.endpoint != key:
            previous, _active = _active, Tracing(endpoint)
            if previous is not None:
                previous.shutdown()
        return _active


def shutdown() -> None:
    """Export what is left and stop tracing (``serve`` does it on its way out)."""
    global _active
    with _lock:
        previous, _active = _active, None
    if previous is not None:
        previous.shutdown()


def active() -> Tracing | None:
    """The tracing in force (None: off, and nothing of OpenTelemetry is loaded)."""
    return _active


def observe(served: Any, traces: Tracing | None) -> None:
    """Give ``served``'s runtime (a model's ``session``, a generator's ``generator``) the
    observer of ``traces`` (nothing when it is None, or when the runtime takes no observer:
    a front end's stand-in for the engine's session, see docs/serving.md)."""
    if traces is None:
        return
    name = getattr(served, "name", "")
    session = getattr(served, "session", None)
    if session is not None and hasattr(session, "observer"):
        session.observer = traces.session_observer(name)
    generator = getattr(served, "generator", None)
    if generator is not None and hasattr(generator, "observer"):
        generator.observer = traces.generator_observer(name)


_OFF = contextlib.nullcontext()


def span(name: str, attributes: dict[str, Any] | None = None) -> contextlib.AbstractContextManager[Any]:
    """A child span of the current one while tracing is on (else a shared no-op)."""
    tracing = _active
    if tracing is None or _current_context() is None:  # off, or no request to join
        return _OFF
    return tracing.tracer.start_as_current_span(name, attributes=attributes)


@contextlib.contextmanager
def traced_request(tracing: Tracing, name: str, carrier: Iterable[tuple[str, str]], **attributes: Any) -> Iterator[Any]:
    """A SERVER span for one request, the child of the client's ``traceparent`` in
    ``carrier`` (HTTP headers or gRPC metadata, names in lower case), current while the
    request is handled."""
    from opentelemetry import propagate
    from opentelemetry.trace import SpanKind

    parent = propagate.extract({k: v for k, v in carrier})
    with tracing.tracer.start_as_current_span(name, context=parent, kind=SpanKind.SERVER, attributes=attributes) as sp:
        yield sp


def _exporter(endpoint: str | None) -> Any:
    protocol = (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or ""
    )
    if protocol.strip().lower() == "grpc":
        grpc_exporter = require("opentelemetry.exporter.otlp.proto.grpc.trace_exporter", "tracing")
        return grpc_exporter.OTLPSpanExporter(endpoint=endpoint) if endpoint else grpc_exporter.OTLPSpanExporter()
    http_exporter = require("opentelemetry.exporter.otlp.proto.http.trace_exporter", "tracing")
    if endpoint is None:  # the SDK reads OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT itself
        return http_exporter.OTLPSpanExporter()
    # --otlp-endpoint is a base URL, as OTEL_EXPORTER_OTLP_ENDPOINT is: the traces path is added
    url = endpoint if endpoint.rstrip("/").endswith(_TRACES_PATH) else endpoint.rstrip("/") + _TRACES_PATH
    return http_exporter.OTLPSpanExporter(endpoint=url)


class Tracing:
    """One tracer provider exporting to one OTLP endpoint, and the observers that turn
    the runtimes' records into spans. Flushed and shut down at exit."""

    def __init__(self, endpoint: str | None) -> None:
        require("opentelemetry.sdk", "tracing")  # an ImportError naming the extra
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        from .._version import __version__

        self.endpoint = endpoint or ""
        attributes = {"service.version": __version__}
        if not os.environ.get("OTEL_SERVICE_NAME"):
            attributes["service.name"] = "ortbatch"
        self.provider = TracerProvider(resource=Resource.create(attributes))
        self.provider.add_span_processor(BatchSpanProcessor(_exporter(endpoint)))
        self.tracer = self.provider.get_tracer("ortbatch.serve", __version__)
        self._closed = False
        atexit.register(self.shutdown)

    def session_observer(self, model: str) -> SessionTracer:
        return SessionTracer(self.tracer, model)

    def generator_observer(self, model: str) -> GeneratorTracer:
        return GeneratorTracer(self.tracer, model)

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Export every span ended so far (True when done within ``timeout_s``)."""
        return bool(self.provider.force_flush(int(timeout_s * 1000)))

    def shutdown(self) -> None:
        """Export what is left and stop (a second call does nothing)."""
        if not self._closed:
            self._closed = True
            self.provider.shutdown()


def _current_context() -> Any:
    """The caller's context when a span is current in it (else None: nothing to join)."""
    from opentelemetry import context, trace

    ctx = context.get_current()
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


def _batch_attributes(record: Any, model: str) -> dict[str, Any]:
    return {
        "ortbatch.model": model,
        "ortbatch.batch.id": record.batch_id,
        "ortbatch.batch.rows": record.rows,
        "ortbatch.batch.requests": record.requests,
        "ortbatch.batch.padded_tokens": record.padded_tokens,
        "ortbatch.batch.real_tokens": record.real_tokens,
    }


class SessionTracer:
    """A :class:`~ortbatch._observe.BatchObserver`: per request, a queue span (queued ->
    its batch began) and a batch span (the run, with the batch's attributes)."""

    def __init__(self, tracer: Any, model: str) -> None:
        self.tracer = tracer
        self.model = model

    def on_submit(self) -> Any:
        return _current_context()

    def on_batch(self, record: Any) -> None:
        from opentelemetry.trace import Status, StatusCode

        attributes = _batch_attributes(record, self.model)
        end = record.started_ns + record.duration_ns
        for ctx, wait in zip(record.tags, record.waits_ns, strict=True):
            if ctx is None:
                continue
            queued = self.tracer.start_span("ortbatch.queue", context=ctx, start_time=record.started_ns - wait)
            queued.end(end_time=record.started_ns)
            run = self.tracer.start_span(
                "ortbatch.batch", context=ctx, start_time=record.started_ns, attributes=attributes
            )
            if record.error is not None:
                run.set_status(Status(StatusCode.ERROR, type(record.error).__name__))
            run.end(end_time=end)


class GeneratorTracer:
    """A :class:`~ortbatch._observe.GenerationObserver`: one ``ortbatch.generate`` span per
    request (its tag), with the prefill, sampled decode steps and the first token as events,
    and TTFT and the token counts as attributes."""

    step_every = STEP_EVERY

    def __init__(self, tracer: Any, model: str) -> None:
        self.tracer = tracer
        self.model = model

    def on_submit(self) -> Any:
        ctx = _current_context()
        if ctx is None:
            return None
        return self.tracer.start_span("ortbatch.generate", context=ctx, attributes={"ortbatch.model": self.model})

    def on_prefill(self, record: Any) -> None:
        attributes = _batch_attributes(record, self.model)
        for sp, wait in zip(record.tags, record.waits_ns, strict=True):
            if sp is not None:
                sp.add_event("prefill", {**attributes, "ortbatch.queue_s": wait / 1e9}, timestamp=record.started_ns)

    def on_step(self, record: Any) -> None:
        attributes = {"ortbatch.step": record.step, "ortbatch.step.rows": record.rows}
        for sp in record.tags:
            if sp is not None:
                sp.add_event("decode step", attributes, timestamp=record.started_ns)

    def on_done(self, sp: Any, future: Future[Any]) -> None:
        from opentelemetry.trace import Status, StatusCode

        if future.cancelled():
            sp.set_attribute("ortbatch.cancelled", True)
        elif (exc := future.exception()) is not None:
            sp.set_status(Status(StatusCode.ERROR, type(exc).__name__))
        else:
            c = future.result()
            sp.set_attributes(
                {
                    "ortbatch.ttft_s": c.time_to_first_token_s,
                    "ortbatch.prompt_tokens": c.prompt_tokens,
                    "ortbatch.completion_tokens": c.completion_tokens,
                    "ortbatch.finish_reason": c.finish_reason,
                }
            )
            if c.completion_tokens:
                start = sp.start_time if isinstance(getattr(sp, "start_time", None), int) else None
                if start is not None:
                    sp.add_event("first token", timestamp=start + int(c.time_to_first_token_s * 1e9))
        sp.end()
