"""A stand-in for an OpenTelemetry collector: an OTLP/HTTP receiver (``POST /v1/traces``,
``application/x-protobuf``) that decodes each ``ExportTraceServiceRequest`` with
``opentelemetry-proto`` and keeps the spans, for tests to wait on (by condition, never by
a sleep of a chosen length)."""

from __future__ import annotations

import gzip
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Span:
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    status: int = 0
    service: str = ""


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind is not None else None


def _attributes(items: Any) -> dict[str, Any]:
    return {a.key: _value(a.value) for a in items}


class OtlpReceiver:
    """``with OtlpReceiver() as rx:`` listens on a loopback port; ``rx.url`` is the base
    URL to give the exporter (``--otlp-endpoint``)."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

        self.spans: list[Span] = []
        self.requests = 0
        self.changed = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                message = trace_service_pb2.ExportTraceServiceRequest()
                message.ParseFromString(body)
                receiver.take(message)
                answer = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, name="otlp-receiver", daemon=True)

    def take(self, message: Any) -> None:
        spans = []
        for resource_spans in message.resource_spans:
            service = _attributes(resource_spans.resource.attributes).get("service.name", "")
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    spans.append(
                        Span(
                            name=s.name,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_id=s.parent_span_id.hex(),
                            kind=s.kind,
                            start_ns=s.start_time_unix_nano,
                            end_ns=s.end_time_unix_nano,
                            attributes=_attributes(s.attributes),
                            events=[(e.name, _attributes(e.attributes)) for e in s.events],
                            status=s.status.code,
                            service=service,
                        )
                    )
        with self.changed:
            self.spans += spans
            self.requests += 1
            self.changed.notify_all()

    def wait_for(self, predicate: Any, timeout: float = 60.0) -> list[Span]:
        """The spans once ``predicate(spans)`` holds (AssertionError with what came, if it
        never does within ``timeout``: the exporter sends every few seconds)."""
        with self.changed:
            if not self.changed.wait_for(lambda: predicate(list(self.spans)), timeout):
                names = sorted((s.name, s.trace_id[:8]) for s in self.spans)
                raise AssertionError(f"the spans never came; received: {names}")
            return list(self.spans)

    def __enter__(self) -> OtlpReceiver:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
