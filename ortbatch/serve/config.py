"""What ``ortbatch serve`` can be told (:class:`ServeConfig`, the CLI flags one to one) and
the defaults the layers above share. The floor of :mod:`ortbatch.serve`: it imports
nothing of it, so the core, the transports and the runners may all read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["DEFAULT_BODY_TIMEOUT_S", "DEFAULT_MAX_BODY_BYTES", "DEFAULT_MAX_TEXT_CHARS", "ServeConfig"]

#: most bytes of a request body (HTTP) or message (gRPC)
DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024
#: seconds a client has to send a whole request body (a slow sender is answered 408)
DEFAULT_BODY_TIMEOUT_S = 60.0
#: Longest text (in characters) taken when the export has no sequence-length limit to
#: truncate at: a longer one is refused (413) before any of it is tokenized.
DEFAULT_MAX_TEXT_CHARS = 100_000


@dataclass
class ServeConfig:
    """Everything ``ortbatch serve`` can be told (the CLI flags, one to one)."""

    host: str = "127.0.0.1"
    port: int = 8000
    name: str | None = None
    #: None: the export's tuned setting (``ortbatch tune``), else 32
    max_batch_size: int | None = None
    max_batch_tokens: int | None = None
    max_delay_ms: float = 0.0
    max_queue: int = 1024
    workers: int | None = None
    timeout_s: float | None = None
    providers: str | None = None
    #: BatchedSession's latency session (None: its default; False saves the second copy of the weights)
    latency_session: bool | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    normalize_embeddings: bool = True
    #: seconds to wait for in-flight requests on shutdown before cancelling them
    graceful_timeout_s: float | None = 60.0
    log_level: str = "info"
    access_log: bool = True
    backlog: int = 2048
    #: generation exports: most positions a sequence may reach (None: the export's)
    max_context_length: int | None = None
    #: generation exports: reuse the keys and values of prompt prefixes seen before (the
    #: in-place KV cache's prefix cache; ``--no-prefix-cache`` turns it off)
    prefix_cache: bool = True
    #: port of the KServe v2 gRPC service on ``host`` (None: no gRPC; Triton's default is 8001)
    grpc_port: int | None = None
    #: bearer key every route but the health checks needs (HTTP and gRPC; None: open)
    api_key: str | None = None
    #: PEM certificate and key: HTTPS, and TLS for gRPC
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    #: longest text taken when the export sets no sequence length to truncate at
    max_text_chars: int = DEFAULT_MAX_TEXT_CHARS
    #: seconds a client has to send a request's headers (slow senders are disconnected)
    header_timeout_s: float = 10.0
    #: uvicorn's HTTP/1.1 parser: "httptools" (C, less CPU per request), "h11" (pure
    #: Python), or "auto": httptools when installed, else h11
    http_parser: str = "auto"
    #: seconds a client has to send a whole request body (else 408)
    body_timeout_s: float | None = DEFAULT_BODY_TIMEOUT_S
    #: seconds an idle keep-alive connection is kept open
    keep_alive_s: int = 5
    #: most connections (and requests) at once; beyond it uvicorn answers 503. Keep it
    #: below the process's file-descriptor limit (``ulimit -n``).
    limit_concurrency: int | None = 1000
    #: seconds a new connection has to send its first byte (then header_timeout_s runs)
    first_byte_timeout_s: float = 5.0
    #: most connections one client address may hold open without having sent a byte; a new
    #: one beyond it closes that address's oldest (None: no cap). Such connections do not
    #: count toward limit_concurrency, so they cannot deny service to those that send requests
    max_idle_per_address: int | None = 100
    #: default of the text endpoints' ``truncate``: cut over-long inputs instead of a 400
    truncate: bool = False
    #: run the BatchedSession's warm-up grid before reporting ready (no engine build on a request)
    warmup: bool = True
    #: front-end processes (HTTP, gRPC, tokenizing) over the one engine process that owns
    #: the session (1: all in this process; see :mod:`ortbatch.serve.frontends`)
    frontends: int = 1
    #: serve an export whose recorded accuracy checks failed (``validation.passed`` false);
    #: refused otherwise, however it is loaded (one export, a list, a repository, front ends, Ray)
    allow_unvalidated: bool = False
    #: generation exports: accept request fields that no API defines (a vendor's), logging
    #: each name once, instead of OpenAI's 400 "Unrecognized request argument supplied"
    lenient_params: bool = False
    #: OTLP collector to export OpenTelemetry traces to (None: the OTEL_EXPORTER_OTLP_*
    #: variables', else no tracing; see :mod:`ortbatch.serve.tracing`)
    otlp_endpoint: str | None = None

    def generator_kwargs(self) -> dict[str, Any]:
        """The :class:`~ortbatch.BatchedGenerator` arguments, for a generation export."""
        kw: dict[str, Any] = {
            "max_batch_size": self.max_batch_size or 32,
            "max_queue": self.max_queue,
            "timeout_s": self.timeout_s,
            "max_context_length": self.max_context_length,
        }
        if not self.prefix_cache:
            kw["prefix_cache"] = False
        if self.providers is not None:
            kw["providers"] = self.providers
        return kw

    def session_kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = {
            "max_batch_size": self.max_batch_size,
            "max_batch_tokens": self.max_batch_tokens,
            "max_delay_ms": self.max_delay_ms,
            "max_queue": self.max_queue,
            "workers": self.workers,
            "timeout_s": self.timeout_s,
            "warmup": self.warmup,
        }
        if self.providers is not None:
            kw["providers"] = self.providers
        if self.latency_session is not None:
            kw["latency_session"] = self.latency_session
        return kw
