"""The one app factory: a Starlette app from the routes of what is served.

:func:`routes_for` says which protocols a served thing speaks: what its model kind declares
(:meth:`~ortbatch.serve.served.kinds.ModelKind.http_routes`: for an encoder the Open Inference
Protocol, ``/v1/embeddings`` and the task endpoints; for a text-generation export OpenAI
completions and chat), and every other kind's body-routed endpoints, refused with why.
:func:`metrics_for` says which runtime counters it exports (its kind's), and :func:`build_app`
puts them together with :func:`~ortbatch.serve.http.plumbing.assemble_app`. A server of
several models, or another ingress, assembles the same routes its own way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..._extras import require
from ...errors import InvalidInputError
from ..metrics import ServerMetrics
from ..served.kinds import BODY_ROUTES, ModelKind, kind_of, owner_of
from .plumbing import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES, BodyLimits, assemble_app, handled_route

__all__ = [
    "BODY_ROUTES",
    "build_app",
    "create_app",
    "create_completions_app",
    "metrics_for",
    "routes_for",
    "wrong_kind_message",
]


def wrong_kind_message(path: str, name: str, kind: ModelKind) -> str:
    """What body-routed endpoint ``path`` of another kind answers (400) for a model of
    ``kind``, the same with the model alone and in a repository (:mod:`.repository_routes`)."""
    return kind.refusal(path, name, owner_of(BODY_ROUTES[path]))


def _wrong_kind_routes(served: Any, kind: ModelKind) -> list[Any]:
    """The other kinds' body-routed endpoints, each refused with :func:`wrong_kind_message`
    (not "no route")."""

    async def refuse(request: Any) -> Any:
        raise InvalidInputError(wrong_kind_message(request.url.path, served.name, kind), input_name="model")

    paths = [p for p in BODY_ROUTES if p not in kind.body_routes]
    return [handled_route(p, refuse, "POST") for p in paths]


def routes_for(served: Any, body: BodyLimits) -> list[Any]:
    """The protocol routes serving ``served`` (without health, ``/v1/models`` and
    ``/metrics``, which :func:`~ortbatch.serve.http.plumbing.assemble_app` adds)."""
    kind = kind_of(served)
    return [*kind.http_routes(served, body), *_wrong_kind_routes(served, kind)]


def metrics_for(served: Any) -> ServerMetrics:
    """A registry with the HTTP instruments and ``served``'s runtime counters."""
    return kind_of(served).metrics(served)


def build_app(
    served: Any,
    body: BodyLimits | None = None,
    *,
    close_on_shutdown: bool = True,
    docs: Callable[[list[Any]], list[Any]] | None = None,
) -> Any:
    """The Starlette app serving ``served``: its routes, the common ones, the metrics
    and counts (``app.state.counts``, ``app.state.metrics``); ``served`` is closed with
    ``drain=True`` on lifespan shutdown unless ``close_on_shutdown`` is false. ``docs``:
    the routes describing the app (``/openapi.json``, ``/docs``: :func:`.openapi.model_docs`)."""
    require("starlette")  # a clear ImportError naming the extra
    routes = routes_for(served, body or BodyLimits())
    return assemble_app(routes, served, metrics_for(served), close_on_shutdown=close_on_shutdown, docs=docs)


def create_app(
    served: Any,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    close_model_on_shutdown: bool = True,
    body_timeout_s: float | None = DEFAULT_BODY_TIMEOUT_S,
) -> Any:
    """:func:`build_app` with the body limits spelled out: KServe v2 and ``/v1/embeddings``
    for a ServedModel, ``/v1/completions`` and chat for a ServedGenerator (what its kind
    declares)."""
    return build_app(served, BodyLimits(max_body_bytes, body_timeout_s), close_on_shutdown=close_model_on_shutdown)


#: the name this factory had for generation exports; the same function
create_completions_app = create_app
