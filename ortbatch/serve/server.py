"""Running the app: ``ortbatch serve DIR`` (foreground, signal-aware) and
:class:`BackgroundServer` (a thread, for tests and notebooks).

Shutdown on SIGTERM or SIGINT is graceful: uvicorn stops accepting connections,
every request already received is answered (the BatchedSession keeps running until
then), and only then is the session closed with ``drain=True``. ``serve`` returns 0
(requests whose clients left, such as abandoned streams, count as settled).

Connections are bounded (:class:`ServeConfig`): request headers must arrive within
``header_timeout_s``, a body within ``body_timeout_s`` (else 408), an idle keep-alive
connection is closed after ``keep_alive_s``, and beyond ``limit_concurrency``
connections or requests at once uvicorn answers 503.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from .._extras import require
from ..errors import OrtBatchError, ServeError
from .app import build_app
from .auth import API_KEY_ENV, ApiKeyMiddleware
from .http import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES, BodyLimits, RequestCounts
from .model import DEFAULT_MAX_TEXT_CHARS, ServedModel
from .served_generator import ServedGenerator, is_generation_export

if TYPE_CHECKING:
    from .grpc import GrpcServer
    from .repository import ModelRepository

__all__ = ["BackgroundServer", "ServeConfig", "bind_socket", "serve"]

log = logging.getLogger("ortbatch.serve")


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

    def generator_kwargs(self) -> dict[str, Any]:
        """The :class:`~ortbatch.BatchedGenerator` arguments, for a generation export."""
        kw: dict[str, Any] = {
            "max_batch_size": self.max_batch_size or 32,
            "max_queue": self.max_queue,
            "timeout_s": self.timeout_s,
            "max_context_length": self.max_context_length,
        }
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


def is_loopback(host: str) -> bool:
    """Whether ``host`` names only this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind_socket(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """A listening TCP socket; ``port=0`` picks a free port (read it back with
    ``sock.getsockname()[1]``), with no window for another process to take it."""
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise ServeError(f"port must be 0-65535 (0 picks a free one), got {port!r}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:  # socket.gaierror: a name that does not resolve
        raise ServeError(f"cannot listen on {host!r}: the address does not resolve ({exc.strerror or exc})") from None
    family, _, proto, _, addr = infos[0]
    # proto must say IPPROTO_TCP: asyncio turns on TCP_NODELAY only for sockets that do, and
    # without it every response written in two parts (headers, body) waits ~40 ms for the
    # client's delayed ACK (Nagle), capping one client at ~25 requests/s.
    sock = socket.socket(family, socket.SOCK_STREAM, proto or socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(backlog)
        sock.set_inheritable(True)
    except OSError as exc:
        sock.close()
        raise ServeError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    except BaseException:
        sock.close()
        raise
    return sock


#: most bytes of a request line and headers still incomplete (h11's own cap; over it: 400, closed)
MAX_HEADER_BYTES = 16 * 1024


def _httptools_available() -> bool:
    try:
        import httptools  # noqa: F401
    except ImportError:
        return False
    return True


def _header_timeout_protocol(
    timeout_s: float, parser: str = "auto", first_byte_s: float | None = None, idle_per_address: int | None = None
) -> type[Any]:
    """uvicorn's HTTP/1.1 protocol (httptools when installed, else h11; ``parser`` picks
    one), closing a connection whose request headers have not all arrived ``timeout_s``
    seconds after its first byte (or after it opened): uvicorn itself waits for headers
    forever, so a client sending a byte a second would hold its connection (and a file
    descriptor) as long as it likes. httptools (llhttp, in C) costs less CPU per request
    than h11 (pure Python). Headers still incomplete after :data:`MAX_HEADER_BYTES` are
    a 400 and a closed connection with either parser (h11 caps them the same way).
    A connection that has sent nothing yet is idle (:class:`_IdleConnections`): closed after
    ``first_byte_s``, at most ``idle_per_address`` per client address, and not counted
    toward uvicorn's ``limit_concurrency``."""
    if parser not in ("auto", "httptools", "h11"):
        raise OrtBatchError(f"the HTTP parser must be 'auto', 'httptools' or 'h11', got {parser!r}")
    if parser == "httptools" or (parser == "auto" and _httptools_available()):
        protocol = _httptools_protocol(timeout_s)
    else:
        protocol = _h11_protocol(timeout_s)
    # one class per server: its idle bookkeeping is that server's
    return type(
        protocol.__name__,
        (protocol,),
        {"_first_byte_s": first_byte_s, "_idle": _IdleConnections(idle_per_address)},
    )


class _IdleConnections:
    """One server's connections that have not sent a byte yet, by client address (oldest
    first). They are left out of uvicorn's ``limit_concurrency`` count (see
    ``_HeaderTimer.limit_concurrency``): otherwise a client opening connections that send
    nothing fills the limit, and every request, health checks included, is a 503."""

    def __init__(self, per_address: int | None) -> None:
        self.per_address = per_address
        self.by_address: dict[Any, dict[Any, None]] = {}
        self.count = 0

    def add(self, address: Any, protocol: Any) -> None:
        idle = self.by_address.setdefault(address, {})
        idle[protocol] = None
        self.count += 1
        if self.per_address is not None and len(idle) > self.per_address:
            oldest = next(iter(idle))
            self.discard(address, oldest)
            oldest.transport.close()

    def discard(self, address: Any, protocol: Any) -> None:
        idle = self.by_address.get(address)
        if idle is not None and protocol in idle:
            del idle[protocol]
            self.count -= 1
            if not idle:
                del self.by_address[address]


class CoalescingTransport:
    """A transport whose writes made in one turn of the event loop leave in one send.

    uvicorn writes a response's status line and headers, then its body, each with its
    own ``write``: two system calls and, with TCP_NODELAY, two packets per response.
    Here the first write of a turn schedules a flush at the end of it, and the flush
    hands the joined bytes to the real transport; closing flushes first, aborting
    drops them. Everything else is the real transport's."""

    __slots__ = ("_loop", "_parts", "_transport")

    def __init__(self, transport: Any, loop: Any) -> None:
        self._transport = transport
        self._loop = loop
        self._parts: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not data:
            return
        if not self._parts:
            self._loop.call_soon(self.flush)
        self._parts.append(data)

    def writelines(self, lines: Any) -> None:
        for data in lines:
            self.write(data)

    def flush(self) -> None:
        """Hand what was written so far to the real transport."""
        parts, self._parts = self._parts, []
        if parts and not self._transport.is_closing():
            self._transport.write(parts[0] if len(parts) == 1 else b"".join(parts))

    def get_write_buffer_size(self) -> int:
        return int(self._transport.get_write_buffer_size()) + sum(len(p) for p in self._parts)

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        self._parts = []
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class _HeaderTimer:
    """The header timeout, mixed in before one of uvicorn's protocols: armed when a
    connection opens and whenever data leaves a request's headers incomplete, disarmed
    once they are complete; on expiry the connection is closed. The protocol writes
    through a :class:`CoalescingTransport`."""

    _timeout_s = 10.0
    _header_timer: Any = None
    #: seconds to the first byte (None: the header timeout)
    _first_byte_s: float | None = None
    _idle: _IdleConnections | None = None
    #: this connection's client address while it is idle (has sent nothing)
    _idle_address: Any = None
    _is_idle = False
    _limit: int | None = None
    loop: Any
    transport: Any

    # uvicorn answers 503 when len(connections) >= limit_concurrency: reading the limit
    # raised by the idle connections is what leaves them out of that count
    @property
    def limit_concurrency(self) -> int | None:
        if self._limit is None or self._idle is None:
            return self._limit
        return self._limit + self._idle.count

    @limit_concurrency.setter
    def limit_concurrency(self, value: int | None) -> None:
        self._limit = value

    def _headers_incomplete(self) -> bool:
        raise NotImplementedError

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        # after uvicorn's own setup: its flow control keeps the real transport
        self.transport = CoalescingTransport(transport, self.loop)
        if self._idle is not None:
            peer = transport.get_extra_info("peername")
            self._idle_address = peer[0] if isinstance(peer, tuple) and peer else peer
            self._is_idle = True
            self._idle.add(self._idle_address, self)
        self._arm(self._first_byte_s)

    def data_received(self, data: bytes) -> None:
        if self._is_idle:  # its first bytes: no longer idle; the header timeout runs from now
            self._leave_idle()
            self._disarm()
        super().data_received(data)  # type: ignore[misc]

    def _leave_idle(self) -> None:
        if self._is_idle and self._idle is not None:
            self._is_idle = False
            self._idle.discard(self._idle_address, self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._leave_idle()
        self._disarm()
        super().connection_lost(exc)  # type: ignore[misc]

    def _rearm(self) -> None:
        if self._headers_incomplete():
            self._arm()
        else:
            self._disarm()

    def _arm(self, timeout_s: float | None = None) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(timeout_s or self._timeout_s, self._expire)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _expire(self) -> None:
        self._header_timer = None
        if self._headers_incomplete() and not self.transport.is_closing():
            self.transport.close()


def _h11_protocol(timeout_s: float) -> type[Any]:
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderTimeoutProtocol(_HeaderTimer, H11Protocol):
        _timeout_s = timeout_s

        def _headers_incomplete(self) -> bool:
            return bool(self.conn.their_state is h11.IDLE)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._rearm()

    return HeaderTimeoutProtocol


def _httptools_protocol(timeout_s: float) -> type[Any]:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class HttpToolsHeaderTimeoutProtocol(_HeaderTimer, HttpToolsProtocol):
        _timeout_s = timeout_s
        # a request has begun (its first byte parsed) and its headers have not ended
        _in_headers = False
        _header_bytes = 0

        def _headers_incomplete(self) -> bool:
            # or no request yet: the connection has sent nothing a request begins with
            return self._in_headers or self.cycle is None

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._in_headers:
                # httptools buffers a header line until it ends: bound what it may hold
                self._header_bytes += len(data)
                if self._header_bytes > MAX_HEADER_BYTES and not self.transport.is_closing():
                    self.send_400_response(f"Request line and headers over {MAX_HEADER_BYTES} bytes.")
                    return
            self._rearm()

        def send_400_response(self, msg: str) -> None:
            # uvicorn answers what the parser refuses (an unknown method, a malformed
            # line, headers over the cap) in plain text; every error of this server is JSON
            body = json.dumps({"error": msg}).encode()
            head = [b"HTTP/1.1 400 Bad Request\r\n"]
            head += [name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers]
            head.append(
                b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(body)
            )
            self.transport.write(b"".join(head) + body)
            self.transport.close()

        # the parser's callbacks
        def on_message_begin(self) -> None:
            self._in_headers = True
            self._header_bytes = 0
            super().on_message_begin()

        def on_headers_complete(self) -> None:
            self._in_headers = False
            super().on_headers_complete()

    return HttpToolsHeaderTimeoutProtocol


def _uvicorn_config(app: Any, config: ServeConfig) -> Any:
    uvicorn = require("uvicorn")
    if (config.ssl_certfile is None) != (config.ssl_keyfile is None):
        raise OrtBatchError("TLS needs both --ssl-certfile and --ssl-keyfile")
    return uvicorn.Config(
        app,
        lifespan="on",
        log_level=config.log_level,
        access_log=config.access_log,
        timeout_graceful_shutdown=config.graceful_timeout_s,
        backlog=config.backlog,
        server_header=False,
        ssl_certfile=config.ssl_certfile,
        ssl_keyfile=config.ssl_keyfile,
        http=_header_timeout_protocol(
            config.header_timeout_s, config.http_parser, config.first_byte_timeout_s, config.max_idle_per_address
        ),
        timeout_keep_alive=config.keep_alive_s,
        limit_concurrency=config.limit_concurrency,
    )


def _url(sock: socket.socket, tls: bool = False) -> str:
    host, port = sock.getsockname()[:2]
    scheme = "https" if tls else "http"
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def _build_app(
    served: ServedModel | ServedGenerator | ModelRepository, config: ServeConfig, close_model_on_shutdown: bool = True
) -> Any:
    """The app for what is served (:func:`~ortbatch.serve.app.build_app`; every model's for
    a repository), behind the API-key door when a key is set."""
    from .repository import ModelRepository

    body = BodyLimits(config.max_body_bytes, config.body_timeout_s)
    app: Any
    if isinstance(served, ModelRepository):
        from .repository_app import create_repository_app

        app = create_repository_app(served, body=body, close_model_on_shutdown=close_model_on_shutdown)
    else:
        app = build_app(served, body, close_on_shutdown=close_model_on_shutdown)
    return ApiKeyMiddleware(app, config.api_key) if config.api_key is not None else app


def _grpc_server(
    served: ServedModel | ServedGenerator | ModelRepository,
    config: ServeConfig,
    app: Any = None,
    reuse_port: bool = False,
) -> GrpcServer | None:
    """The started gRPC service when ``config.grpc_port`` is set (None otherwise); its
    requests are counted in ``app``'s ``/metrics``. ``reuse_port``: share the port with the
    other front ends (``--frontends``)."""
    if config.grpc_port is None:
        return None
    from .grpc import GrpcServer

    return GrpcServer(
        served,
        host=config.host,
        port=config.grpc_port,
        api_key=config.api_key,
        ssl_certfile=config.ssl_certfile,
        ssl_keyfile=config.ssl_keyfile,
        max_message_bytes=config.max_body_bytes,
        metrics=app.state.metrics if app is not None else None,
        reuse_port=reuse_port,
    ).start()


def refuse_unvalidated(directory: str | Path, allow_unvalidated: bool) -> None:
    """Raise :class:`~ortbatch.errors.ValidationError` when ``directory``'s manifest records
    failed accuracy checks (``validation.passed`` false, as in an ``X.failed`` export), unless
    ``allow_unvalidated``. Every way a model gets loaded goes through :func:`load_served`, which
    calls this, so the rule cannot be skipped by serving the export beside another."""
    from ..errors import ValidationError
    from ..manifest import MANIFEST_NAME, Manifest

    target = Path(directory)
    if allow_unvalidated or not (target / MANIFEST_NAME).is_file():
        return
    if Manifest.load(target).validation.get("passed") is False:
        raise ValidationError(
            f"{target} FAILED its accuracy checks (validation.passed is false; see "
            f"{target / 'validation.json'}), so it may answer wrong numbers. Re-export it, "
            "or pass --allow-unvalidated to serve it anyway"
        )


def load_served(
    directory: str | Path,
    name: str | None,
    config: ServeConfig,
    session_options: Callable[[bool], Any] | None = None,
) -> ServedModel | ServedGenerator:
    """What ``directory`` holds, ready to serve: a ServedGenerator for a decoder-with-past
    export, else a ServedModel, built with ``config``'s settings. ``session_options(generation)``,
    when given, makes the ONNX Runtime session options (``ortbatch.ray`` sizes threads to a
    replica's CPUs). An export whose accuracy checks failed is refused
    (:func:`refuse_unvalidated`) unless ``config.allow_unvalidated``."""
    refuse_unvalidated(directory, config.allow_unvalidated)
    if is_generation_export(directory):
        gen_kw = config.generator_kwargs()
        if session_options is not None:
            gen_kw["session_options"] = session_options(True)
        return ServedGenerator.load(directory, name=name, generator_kwargs=gen_kw)
    kw = config.session_kwargs()
    if session_options is not None:
        kw["session_options"] = session_options(False)
    return ServedModel.load(
        directory,
        name=name,
        session_kwargs=kw,
        normalize_embeddings=config.normalize_embeddings,
        max_text_chars=config.max_text_chars,
        truncate=config.truncate,
    )


def _load_app(
    directory: str | Path | ModelRepository, config: ServeConfig
) -> tuple[ServedModel | ServedGenerator | ModelRepository, Any]:
    """Load what ``directory`` holds (a generator for a decoder-with-past export, else a
    model; every model of a repository) and build its app."""
    from .repository import ModelRepository

    served: ServedModel | ServedGenerator | ModelRepository
    if isinstance(directory, ModelRepository):
        served = directory
        served.load_all()
    else:
        served = load_served(directory, config.name, config)
    try:
        return served, _build_app(served, config)
    except BaseException:
        served.close(drain=False)
        raise


def served_summary(served: ServedModel | ServedGenerator | ModelRepository) -> str:
    """What the startup line says is served (before the gRPC address and the URL)."""
    from .repository import ModelRepository

    if isinstance(served, ModelRepository):
        return "a model repository: POST /v2/repository/index"
    if isinstance(served, ServedModel):
        text = "text input on" if served.text_input else "no text input"
        emb = "/v1/embeddings on" if served.embedding_output else "no /v1/embeddings"
        return f"{text}, {emb}"
    return "text generation: /v1/completions"


def warn_if_exposed(config: ServeConfig) -> None:
    """Warn (stderr) about a bind reachable from other machines without an API key."""
    if is_loopback(config.host):
        return
    if config.api_key is None:
        print(
            f"ortbatch serve: warning: binding {config.host}, reachable from other machines, without an API "
            "key: anyone who can reach it can use the model (set --api-key, --api-key-file or "
            f"{API_KEY_ENV})",
            file=sys.stderr,
            flush=True,
        )
    else:
        log.warning("ortbatch serve: binding %s, reachable from other machines", config.host)


def serve(directory: str | Path | ModelRepository, config: ServeConfig | None = None) -> int:
    """Serve an export directory (or every model of a
    :class:`~ortbatch.serve.repository.ModelRepository`) in the foreground until
    SIGTERM/SIGINT; returns 0
    after a graceful drain in which every received request was answered (1 if the
    graceful timeout cancelled some). Prints ``listening on URL`` once the model is
    loaded and the socket is bound, and the request counts after the drain."""
    config = config or ServeConfig()
    uvicorn = require("uvicorn")
    if config.frontends != 1:
        if isinstance(config.frontends, bool) or not isinstance(config.frontends, int) or config.frontends < 1:
            raise ServeError(f"frontends must be a positive integer, got {config.frontends!r}")
        from .frontends import serve_frontends

        return serve_frontends(directory, config)
    warn_if_exposed(config)
    # bound before loading: a port in use is said at once, not after the model has loaded
    sock = bind_socket(config.host, config.port, config.backlog)
    try:
        served, app = _load_app(directory, config)
    except BaseException:
        sock.close()
        raise
    try:
        server = uvicorn.Server(_uvicorn_config(app, config))
        grpc_server = _grpc_server(served, config, app)
    except BaseException:
        sock.close()
        served.close(drain=False)
        raise
    received: list[int] = []

    def on_signal(sig: int, frame: FrameType | None) -> None:
        # uvicorn re-raises the signal it shut down on once it has drained; landing
        # here instead of the default handler is what makes SIGTERM exit 0. A signal
        # before uvicorn installs its own handlers must still stop it.
        received.append(sig)
        server.should_exit = True
        if grpc_server is not None:
            grpc_server.stop_soon(config.graceful_timeout_s)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    from .repository import ModelRepository

    if isinstance(served, ModelRepository):
        for line in served.status_lines():
            print(f"ortbatch serve: {line}", file=sys.stderr, flush=True)
    what = served_summary(served)
    if grpc_server is not None:
        tls = " (TLS)" if grpc_server.tls else ""
        what += f"; gRPC{tls} on {grpc_server.address}"
    label = "serving" if isinstance(served, ModelRepository) else f"model {served.name!r}"
    print(
        f"ortbatch serve: {label} ({what}); listening on {_url(sock, config.ssl_certfile is not None)}",
        file=sys.stderr,
        flush=True,
    )
    try:
        server.run(sockets=[sock])
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        sock.close()
        if grpc_server is not None:
            # its in-flight requests finish before the session closes
            grpc_server.stop(config.graceful_timeout_s)
        if not served.closed:
            served.close(drain=True)
    counts: RequestCounts = app.state.counts
    rpc = f"; gRPC accepted={grpc_server.counts.accepted} answered={grpc_server.counts.answered}" if grpc_server else ""
    print(
        f"ortbatch serve: stopped; requests accepted={counts.accepted} answered={counts.answered} "
        f"abandoned by their clients={counts.abandoned}{rpc}",
        file=sys.stderr,
        flush=True,
    )
    if not server.started:
        return 1
    if grpc_server is not None and grpc_server.counts.answered < grpc_server.counts.accepted:
        print(
            f"ortbatch serve: {grpc_server.counts.accepted - grpc_server.counts.answered} gRPC request(s) were "
            f"cancelled unanswered (--graceful-timeout-s {config.graceful_timeout_s} exceeded)",
            file=sys.stderr,
            flush=True,
        )
        return 1
    if counts.settled < counts.accepted:
        # only a graceful-shutdown timeout cancels requests: say so in the exit code
        print(
            f"ortbatch serve: {counts.accepted - counts.settled} request(s) were cancelled unanswered "
            f"(--graceful-timeout-s {config.graceful_timeout_s} exceeded)",
            file=sys.stderr,
            flush=True,
        )
        return 1
    return 0


class BackgroundServer:
    """Serve a :class:`ServedModel` (or a :class:`~ortbatch.serve.served_generator.ServedGenerator`,
    or a :class:`~ortbatch.serve.repository.ModelRepository` after its ``load_all()``)
    from a background thread on a loopback port.

        with BackgroundServer(ServedModel.load("exports/minilm")) as srv:
            httpx.get(srv.url + "/v2/health/ready")

    ``stop()`` (or leaving the ``with``) shuts down gracefully, closing the model's
    session after in-flight requests are answered.
    """

    def __init__(
        self,
        model: ServedModel | ServedGenerator | ModelRepository,
        config: ServeConfig | None = None,
        *,
        close_model: bool = True,
    ) -> None:
        self.config = config or ServeConfig(port=0, access_log=False, log_level="warning")
        if self.config.frontends != 1:
            raise ServeError(
                "BackgroundServer serves from a thread of this process: frontends must be 1 (serve() runs more)"
            )
        self.model = model
        self.app = _build_app(model, self.config, close_model)
        self._sock = bind_socket(self.config.host, self.config.port, self.config.backlog)
        self.url = _url(self._sock, self.config.ssl_certfile is not None)
        self.port: int = self._sock.getsockname()[1]
        uvicorn = require("uvicorn")
        self._server = uvicorn.Server(_uvicorn_config(self.app, self.config))
        #: the gRPC service, started by start() when ``config.grpc_port`` is set
        self.grpc: GrpcServer | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="ortbatch-serve", daemon=True)

    @property
    def counts(self) -> RequestCounts:
        counts: RequestCounts = self.app.state.counts
        return counts

    def _run(self) -> None:
        try:
            self._server.run(sockets=[self._sock])
        except BaseException as exc:  # surfaced by start()/stop()
            self._error = exc

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        try:
            self.grpc = _grpc_server(self.model, self.config, self.app)
        except BaseException:
            self._sock.close()
            raise
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not start: {self._error!r}")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 60.0) -> None:
        self._server.should_exit = True
        # gRPC's in-flight requests finish while the HTTP side drains, before the session closes
        stopped = self.grpc.stop_soon(self.config.graceful_timeout_s) if self.grpc is not None else None
        if stopped is not None:
            stopped.result(timeout)
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._sock.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
