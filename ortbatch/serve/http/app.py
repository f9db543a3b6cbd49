"""The one app factory: a Starlette app from the routes of what is served.

:func:`routes_for` says which protocols a served thing speaks (a :class:`ServedModel`: the
Open Inference Protocol and, for an embedding export, ``/v1/embeddings``; a
:class:`ServedGenerator`: OpenAI completions and chat; a model's task endpoints,
:mod:`ortbatch.serve.http.task_routes`), :func:`metrics_for` which
runtime counters it exports, and :func:`build_app` puts them together with
:func:`~ortbatch.serve.http.plumbing.assemble_app`. A server of several models, or another ingress,
assembles the same routes its own way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..._extras import require
from ...errors import InvalidInputError
from ..metrics import ServerMetrics
from ..served.generator import ServedGenerator
from ..served.model import ServedModel
from .kserve import generation_routes, kserve_routes
from .openai_api import completion_routes, embedding_routes
from .plumbing import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES, BodyLimits, assemble_app, handled_route
from .task_routes import task_routes

__all__ = [
    "BODY_ROUTES",
    "build_app",
    "create_app",
    "create_completions_app",
    "metrics_for",
    "routes_for",
    "wrong_kind_message",
]

#: routes whose model is named in the JSON body -> the endpoint kind of
#: :func:`~ortbatch.serve.served.text_tasks.served_endpoints` (a repository dispatches them
#: by that name: :mod:`.repository_routes`)
BODY_ROUTES = {
    "/v1/embeddings": "embeddings",
    "/embed": "embeddings",
    "/embed_sparse": "embed_sparse",
    "/v1/rerank": "rerank",
    "/rerank": "rerank",
    "/v1/classify": "classify",
    "/tokenize": "tokenize",
    "/detokenize": "tokenize",
    "/v1/completions": "completions",
    "/v1/chat/completions": "completions",
}


def wrong_kind_message(path: str, name: str, generator: bool) -> str:
    """What a body-routed endpoint of the other kind of export answers (400), the same with
    the model alone and in a repository (:mod:`.repository_routes`)."""
    if generator:
        return f"{path}: model {name!r} is a text-generation export: it serves /v1/completions"
    return f"{path}: model {name!r} is not a text-generation export"


def _wrong_kind_routes(served: ServedModel | ServedGenerator) -> list[Any]:
    """The other kind's body-routed endpoints, each refused with :func:`wrong_kind_message`
    (not "no route")."""
    generator = isinstance(served, ServedGenerator)

    async def refuse(request: Any) -> Any:
        raise InvalidInputError(wrong_kind_message(request.url.path, served.name, generator), input_name="model")

    paths = [p for p, kind in BODY_ROUTES.items() if (kind == "completions") != generator]
    return [handled_route(p, refuse, "POST") for p in paths]


def routes_for(served: ServedModel | ServedGenerator, body: BodyLimits) -> list[Any]:
    """The protocol routes serving ``served`` (without health, ``/v1/models`` and
    ``/metrics``, which :func:`~ortbatch.serve.http.plumbing.assemble_app` adds)."""
    if isinstance(served, ServedGenerator):
        return [*completion_routes(served, body), *generation_routes(served, body), *_wrong_kind_routes(served)]
    own = [*kserve_routes(served, body), *embedding_routes(served, body), *task_routes(served, body)]
    return [*own, *_wrong_kind_routes(served)]


def metrics_for(served: ServedModel | ServedGenerator) -> ServerMetrics:
    """A registry with the HTTP instruments and ``served``'s runtime counters."""
    if isinstance(served, ServedGenerator):
        return ServerMetrics(generator_stats=served.generator.stats)
    return ServerMetrics(served.session.stats)


def build_app(
    served: ServedModel | ServedGenerator,
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
    served: ServedModel | ServedGenerator,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    close_model_on_shutdown: bool = True,
    body_timeout_s: float | None = DEFAULT_BODY_TIMEOUT_S,
) -> Any:
    """:func:`build_app` with the body limits spelled out: KServe v2 and ``/v1/embeddings``
    for a :class:`ServedModel`, ``/v1/completions`` and chat for a :class:`ServedGenerator`."""
    return build_app(served, BodyLimits(max_body_bytes, body_timeout_s), close_on_shutdown=close_model_on_shutdown)


#: the name this factory had for generation exports; the same function
create_completions_app = create_app
