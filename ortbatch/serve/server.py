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

import signal
import threading
import time
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from .._extras import require
from ..errors import ServeError
from . import tracing
from .assembly import (
    ExitCounts,
    Served,
    announce,
    app_for,
    exit_report,
    grpc_server_for,
    load_app,
    say,
    served_summary,
    with_grpc,
)
from .config import ServeConfig
from .http.connection import uvicorn_config
from .http.plumbing import RequestCounts
from .listen import bind_socket, url_of, warn_if_exposed
from .served.repository import ModelRepository

if TYPE_CHECKING:
    from .grpc import GrpcServer

__all__ = ["BackgroundServer", "ServeConfig", "serve"]


def serve(directory: str | Path | ModelRepository, config: ServeConfig | None = None) -> int:
    """Serve an export directory (or every model of a
    :class:`~ortbatch.serve.served.repository.ModelRepository`) in the foreground until
    SIGTERM/SIGINT; returns 0
    after a graceful drain in which every received request was answered (1 if the
    graceful timeout cancelled some). Prints ``listening on URL`` once the model is
    loaded and the socket is bound, and the request counts after the drain."""
    config = config or ServeConfig()
    if config.frontends != 1:
        if isinstance(config.frontends, bool) or not isinstance(config.frontends, int) or config.frontends < 1:
            raise ServeError(f"frontends must be a positive integer, got {config.frontends!r}")
        from .frontends import serve_frontends  # spawns processes: loaded only when asked for

        return serve_frontends(directory, config)
    warn_if_exposed(config)
    # bound before loading: a port in use is said at once, not after the model has loaded
    sock = bind_socket(config.host, config.port, config.backlog)
    say(f"loading {directory}")  # startup that speaks: each stage as it happens
    loading = time.monotonic()
    try:
        served, app = load_app(directory, config)
    except BaseException:
        sock.close()
        raise
    session: Any = getattr(served, "session", None)  # a repository's models say their own state
    plan = getattr(session, "warmup_plan", "")
    warm = f" (warm-up: {plan}, {session.warmup_s:.2f}s)" if plan else ""
    say(f"loaded in {time.monotonic() - loading:.1f}s{warm}")
    server, grpc_server = _start(served, app, sock, config)
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
    address = grpc_server.address if grpc_server is not None else None
    what = with_grpc(served_summary(served), address, grpc_server is not None and grpc_server.tls)
    announce(served, what, url_of(sock, config.ssl_certfile is not None))
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
        tracing.shutdown()  # the last spans exported before the exit report
    counts: RequestCounts = app.state.counts
    totals = ExitCounts(counts.accepted, counts.answered, counts.abandoned)
    if grpc_server is not None:
        totals.grpc_accepted, totals.grpc_answered = grpc_server.counts.accepted, grpc_server.counts.answered
    return exit_report(totals, started=server.started, grace=config.graceful_timeout_s, grpc=grpc_server is not None)


def _start(served: Served, app: Any, sock: Any, config: ServeConfig) -> tuple[Any, GrpcServer | None]:
    """The uvicorn server for ``app`` and the started gRPC server; on a failure the socket
    and ``served`` are closed."""
    uvicorn = require("uvicorn")
    try:
        server = uvicorn.Server(uvicorn_config(app, config))
        grpc_server = grpc_server_for(served, config, app)
    except BaseException:
        sock.close()
        served.close(drain=False)
        raise
    return server, grpc_server


class BackgroundServer:
    """Serve a :class:`ServedModel` (or a :class:`~ortbatch.serve.served.generator.ServedGenerator`,
    or a :class:`~ortbatch.serve.served.repository.ModelRepository` after its ``load_all()``)
    from a background thread on a loopback port.

        with BackgroundServer(ServedModel.load("exports/minilm")) as srv:
            httpx.get(srv.url + "/v2/health/ready")

    ``stop()`` (or leaving the ``with``) shuts down gracefully, closing the model's
    session after in-flight requests are answered.
    """

    def __init__(
        self,
        model: Served,
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
        self.app = app_for(model, self.config, close_model)
        self._sock = bind_socket(self.config.host, self.config.port, self.config.backlog)
        self.url = url_of(self._sock, self.config.ssl_certfile is not None)
        self.port: int = self._sock.getsockname()[1]
        uvicorn = require("uvicorn")
        self._server = uvicorn.Server(uvicorn_config(self.app, self.config))
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
            self.grpc = grpc_server_for(self.model, self.config, self.app)
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
