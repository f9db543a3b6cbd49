"""Putting a server together for a :class:`ServeConfig`, the same way for ``serve()``,
:class:`~ortbatch.serve.server.BackgroundServer`, each front-end process and Ray Serve:
the app for what is served (:func:`app_for`, behind the API-key door), the gRPC server
(:func:`grpc_server_for`), and what the server says: the startup lines
(:func:`announce`) and the exit report (:func:`exit_report`, whose return is the exit
code).

It sits above both transports (:mod:`ortbatch.serve.http`, :mod:`ortbatch.serve.grpc`)
and the core (:mod:`ortbatch.serve.served`), below the runners (:mod:`.server`,
:mod:`.frontends`, :mod:`ortbatch.ray`).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from . import tracing
from .config import ServeConfig
from .http.app import build_app
from .http.auth import ApiKeyMiddleware
from .http.openapi import model_docs
from .http.plumbing import BodyLimits
from .http.repository_routes import create_repository_app
from .http.tracing import TracingMiddleware
from .served.generator import ServedGenerator
from .served.kinds import kind_of
from .served.loading import load_served
from .served.model import ServedModel
from .served.repository import ModelRepository

if TYPE_CHECKING:
    from .grpc import GrpcServer

__all__ = [
    "ExitCounts",
    "Served",
    "announce",
    "app_for",
    "exit_report",
    "grpc_server_for",
    "load_app",
    "say",
    "served_label",
    "served_summary",
]

#: what a server serves: one model of a registered kind (:mod:`.served.kinds`: a ServedModel,
#: a ServedGenerator, ...), or a repository of them
Served = ServedModel | ServedGenerator | ModelRepository | Any


def _repository(served: Any) -> ModelRepository | None:
    """``served`` when it is a repository (the one question this module asks of its class:
    anything else is one model, described by its kind)."""
    return served if isinstance(served, ModelRepository) else None


def say(text: str) -> None:
    """One line of the server's own log (stderr), as every runner writes it."""
    print(f"ortbatch serve: {text}", file=sys.stderr, flush=True)


def app_for(served: Served, config: ServeConfig, close_model_on_shutdown: bool = True) -> Any:
    """The app for what is served (:func:`~ortbatch.serve.http.app.build_app`; every model's for
    a repository), behind the API-key door when a key is set, traced when tracing is on
    (``config.otlp_endpoint`` or the ``OTEL_*`` variables: :mod:`.tracing`)."""
    body = BodyLimits(config.max_body_bytes, config.body_timeout_s)
    traces = tracing.configure(config.otlp_endpoint)
    app: Any
    repository = _repository(served)
    if repository is not None:
        app = create_repository_app(repository, body=body, close_model_on_shutdown=close_model_on_shutdown)
        for _, loaded in repository.loaded():  # those loaded later are observed by load_served
            tracing.observe(loaded.served, traces)
    else:
        app = build_app(served, body, close_on_shutdown=close_model_on_shutdown, docs=model_docs(served))
        tracing.observe(served, traces)
    if config.api_key is not None:
        app = ApiKeyMiddleware(app, config.api_key)
    # outermost: a refused request is traced too
    return TracingMiddleware(app, traces) if traces is not None else app


def grpc_server_for(
    served: Served, config: ServeConfig, app: Any = None, reuse_port: bool = False
) -> GrpcServer | None:
    """The started gRPC service when ``config.grpc_port`` is set (None otherwise); its
    requests are counted in ``app``'s ``/metrics``. ``reuse_port``: share the port with the
    other front ends (``--frontends``)."""
    if config.grpc_port is None:
        return None
    from .grpc import GrpcServer  # grpcio is the serve extra's: imported only when asked for

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


def load_app(directory: str | Path | ModelRepository, config: ServeConfig) -> tuple[Served, Any]:
    """Load what ``directory`` holds (as its model kind loads it: a generator for a
    decoder-with-past export, a model for an encoder; every model of a repository) and build
    its app."""
    tracing.configure(config.otlp_endpoint)  # before loading: each model gets its observer
    served: Served
    repository = _repository(directory)
    if repository is not None:
        served = repository
        repository.load_all()
    else:
        served = load_served(cast("str | Path", directory), config.name, config)
    try:
        return served, app_for(served, config)
    except BaseException:
        served.close(drain=False)
        raise


def served_summary(served: Served) -> str:
    """What the startup line says is served (before the gRPC address and the URL): its kind's
    summary, or the repository's."""
    if _repository(served) is not None:
        return "a model repository: POST /v2/repository/index"
    return str(kind_of(served).summary(served))


def served_label(served: Served) -> str:
    """The startup line's subject: ``model 'name'``, or ``serving`` for a repository."""
    return "serving" if _repository(served) is not None else f"model {served.name!r}"


def with_grpc(what: str, address: str | None, tls: bool) -> str:
    """``what`` followed by where gRPC listens (when it does)."""
    if address is None:
        return what
    return what + f"; gRPC{' (TLS)' if tls else ''} on {address}"


def announce(served: Served, what: str, url: str, before: Sequence[str] = ()) -> None:
    """The startup lines: each repository model's state, then ``before`` (a runner's own
    lines), then ``{label} ({what}); listening on {url}`` (tests and scripts wait for it)."""
    repository = _repository(served)
    if repository is not None:
        for line in repository.status_lines():
            say(line)
    for line in before:
        say(line)
    say(f"{served_label(served)} ({what}); listening on {url}")


@dataclass
class ExitCounts:
    """The requests a server took and settled, over HTTP and gRPC, for :func:`exit_report`."""

    accepted: int = 0
    answered: int = 0
    #: HTTP requests whose client left before the response was complete
    abandoned: int = 0
    grpc_accepted: int = 0
    grpc_answered: int = 0
    #: requests a front end held when it was killed (--frontends): neither answered nor cancelled by a timeout
    lost: int = 0
    grpc_lost: int = 0


def exit_report(counts: ExitCounts, *, started: bool, grace: float | None, grpc: bool, by_front_end: str = "") -> int:
    """Say what the server answered and return the exit code: 1 when it never started or
    a graceful-shutdown timeout cancelled requests unanswered, else 0. ``grpc``: report
    the gRPC counts; ``by_front_end``: the requests each front end took."""
    rpc = f"; gRPC accepted={counts.grpc_accepted} answered={counts.grpc_answered}" if grpc else ""
    per = f"; by front end: {by_front_end}" if by_front_end else ""
    lost = f" lost with a killed front end={counts.lost}" if counts.lost else ""
    say(
        f"stopped; requests accepted={counts.accepted} answered={counts.answered} "
        f"abandoned by their clients={counts.abandoned}{lost}{rpc}{per}"
    )
    if not started:
        return 1
    if counts.grpc_answered + counts.grpc_lost < counts.grpc_accepted:
        say(
            f"{counts.grpc_accepted - counts.grpc_answered - counts.grpc_lost} gRPC request(s) were cancelled "
            "unanswered "
            f"(--graceful-timeout-s {grace} exceeded)"
        )
        return 1
    if counts.answered + counts.abandoned + counts.lost < counts.accepted:
        # only a graceful-shutdown timeout cancels requests: say so in the exit code
        say(
            f"{counts.accepted - counts.answered - counts.abandoned - counts.lost} request(s) were cancelled "
            "unanswered "
            f"(--graceful-timeout-s {grace} exceeded)"
        )
        return 1
    return 0
