"""The HTTP routes of a :class:`~ortbatch.serve.served.repository.ModelRepository`: one server, many
models, each answered by its own model's app (the very app ``ortbatch serve DIR`` runs for
it alone), so every endpoint behaves the same with one model or many.

Routes::

    POST /v2/repository/index                   [{name, version, state, reason}]
    POST /v2/repository/models/{name}/load      load, or reload a changed export
    POST /v2/repository/models/{name}/unload    after in-flight requests finish
    GET  /v2 | /v2/health/live | /v2/health/ready | /metrics | /v1/models
    *    /v2/models/{name}/...                  that model's KServe v2 routes
                                                ({name}_text: its text-in entry)
    POST /v1/embeddings /v1/rerank /rerank /v1/classify /tokenize /detokenize
         /v1/completions /v1/chat/completions   by the body's ``model`` field; without
                                                one, the only model serving the endpoint

A request holds its model (reference counted) until its response is complete, streamed
answers included, so an unload or reload never cuts one short. Metrics: the HTTP series
of the whole server plus each model's batching series, labelled ``model``.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

from ... import __version__
from ..._extras import require
from ...errors import InvalidInputError, ModelNotFoundError, ModelUnavailableError
from ..metrics import ServerMetrics
from ..served.kinds import kind_of
from ..served.protocol import loads_json
from ..served.repository import LOAD_PARAMETERS, UNLOAD_PARAMETERS, Loaded, ModelRepository, check_parameters
from .app import BODY_ROUTES, build_app, wrong_kind_message
from .openapi import repository_docs
from .plumbing import (
    AsgiEndpoint,
    BodyLimits,
    Incoming,
    assemble_app,
    error_reply,
    handled_route,
    json_response,
    send_reply,
)

__all__ = ["BODY_ROUTES", "create_repository_app"]


class _ModelsCollector:
    """Each loaded model's batching metrics, one series per model (label ``model``)."""

    def __init__(self, repository: ModelRepository) -> None:
        self.repository = repository

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        core = require("prometheus_client.core")
        families: dict[str, Any] = {}
        for name, loaded in self.repository.loaded():
            served = loaded.served
            # the one-model collector of its kind, reused per model (its families relabelled)
            source = kind_of(served).collector(served)
            if source is None:
                continue
            for fam in source.collect():
                merged = families.get(fam.name)
                if merged is None:
                    merged = families[fam.name] = core.Metric(fam.name, fam.documentation, fam.type)
                for sample in fam.samples:
                    merged.add_sample(sample.name, {**sample.labels, "model": name}, sample.value)
        yield from families.values()


def _model_field(body: bytes) -> str | None:
    """The body's ``model``, if any (an InvalidInputError when the body is not a JSON
    object or the name not a string)."""
    doc = loads_json(body)
    if not isinstance(doc, dict):
        raise InvalidInputError("request body must be a JSON object")
    name = doc.get("model")
    if name is not None and not isinstance(name, str):
        raise InvalidInputError(f"'model' must be a string, got {name!r:.80}", input_name="model")
    return name


class _Dispatch:
    """The routes that reach one model: by path (``/v2/models/{name}/...``) or by the
    body's ``model`` (:data:`BODY_ROUTES`), each forwarded to that model's own app (the
    one ``ortbatch serve DIR`` runs for it alone, made on its first request and gone
    with it; no API-key door: the repository's app has it) while the model is held."""

    def __init__(self, repository: ModelRepository, limits: BodyLimits) -> None:
        self.repository = repository
        self.limits = limits
        self.apps: weakref.WeakKeyDictionary[Loaded, Any] = weakref.WeakKeyDictionary()
        config = repository.config
        self.per_model = BodyLimits(config.max_body_bytes, config.body_timeout_s) if config is not None else limits

    async def forward(self, loaded: Loaded, scope: Any, receive: Any, send: Any) -> None:
        try:
            app = self.apps.get(loaded)
            if app is None:
                app = self.apps[loaded] = build_app(loaded.served, self.per_model, close_on_shutdown=False)
            await app(scope, receive, send)
        finally:
            self.repository.release(loaded)

    @staticmethod
    async def answer_error(exc: Exception, scope: Any, send: Any) -> None:
        await send_reply(send, error_reply(exc, openai=scope["path"].startswith("/v1/")))

    async def by_path(self, scope: Any, receive: Any, send: Any) -> None:
        name = scope["path_params"]["name"]
        scope["ortbatch.endpoint"] = "/v2/models/{name}"  # the model's own route refines it
        try:
            loaded = self.repository.acquire(self.repository.base_name(name))
        except (ModelNotFoundError, ModelUnavailableError) as exc:
            await self.answer_error(exc, scope, send)
            return
        await self.forward(loaded, scope, receive, send)

    def pick(self, endpoint: str, path: str, name: str | None) -> Loaded:
        """The model a body route reaches: the one ``name``d, else the only one serving it."""
        repository = self.repository
        if name is not None:
            loaded = repository.acquire(name)
            reason = loaded.endpoints.get(endpoint, "no")
            if reason:
                repository.release(loaded)
                if reason == "no":  # the other kind of export: what it answers alone (app.py)
                    message = wrong_kind_message(path, name, kind_of(loaded.served))
                    raise InvalidInputError(message, input_name="model")
                raise InvalidInputError(f"{path}: {reason}", input_name="model")
            return loaded
        candidates = repository.serving(endpoint)
        if len(candidates) == 1:
            return repository.acquire(candidates[0])
        if not candidates:
            raise InvalidInputError(f"no model on this server serves {path}")
        raise InvalidInputError(f"'model' is required: {path} is served by {candidates}", input_name="model")

    async def by_body(self, scope: Any, receive: Any, send: Any) -> None:
        path = scope["path"]
        scope["ortbatch.endpoint"] = path
        try:
            body = await self.limits.read(Incoming(scope, receive))
            name = _model_field(body)
            loaded = self.pick(BODY_ROUTES[path], path, name)
        except Exception as exc:
            await self.answer_error(exc, scope, send)
            return
        # The model's app reads the body again: hand it the (decompressed) bytes read here.
        headers = [(k, v) for k, v in scope["headers"] if k not in (b"content-length", b"content-encoding")]
        scope["headers"] = [*headers, (b"content-length", str(len(body)).encode())]
        replayed = False

        async def replay() -> Any:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # then: the client's disconnect, if it leaves

        await self.forward(loaded, scope, replay, send)


def _extension_routes(repository: ModelRepository, limits: BodyLimits) -> list[Any]:
    """The repository extension (index, load, unload), the server metadata and
    ``/v1/models``."""
    from starlette.requests import Request

    async def read_json(request: Request) -> dict[str, Any]:
        data = await limits.read(request)
        if not data.strip():
            return {}  # tritonclient may send no body
        doc = loads_json(data)
        if not isinstance(doc, dict):
            raise InvalidInputError("request body must be a JSON object")
        return doc

    async def index(request: Request) -> Any:
        doc = await read_json(request)
        ready = doc.get("ready", False)
        if not isinstance(ready, bool):
            raise InvalidInputError(f"'ready' must be true or false, got {repr(ready)[:40]}", input_name="ready")
        return json_response(repository.index(ready_only=ready))

    def parameters(doc: dict[str, Any], allowed: frozenset[str]) -> None:
        params = doc.get("parameters", {})
        if not isinstance(params, dict):
            raise InvalidInputError("'parameters' must be an object", input_name="parameters")
        check_parameters(params, allowed)

    async def load(request: Request) -> Any:
        parameters(await read_json(request), LOAD_PARAMETERS)
        await repository.load(request.path_params["name"])
        return json_response({})

    async def unload(request: Request) -> Any:
        parameters(await read_json(request), UNLOAD_PARAMETERS)
        await repository.unload(request.path_params["name"])
        return json_response({})

    async def server_metadata(request: Request) -> Any:
        return json_response(
            {"name": "ortbatch", "version": __version__, "extensions": ["binary_tensor_data", "model_repository"]}
        )

    async def list_models(request: Request) -> Any:
        data = [
            {"id": name, "object": "model", "created": 0, "owned_by": "ortbatch"} for name, _ in repository.loaded()
        ]
        return json_response({"object": "list", "data": data})

    route = handled_route
    return [
        route("/v2", server_metadata, "GET"),
        route("/v2/repository/index", index, "POST"),
        route("/v2/repository/models/{name}/load", load, "POST"),
        route("/v2/repository/models/{name}/unload", unload, "POST"),
        route("/v1/models", list_models, "GET"),
    ]


def create_repository_app(
    repository: ModelRepository,
    *,
    body: BodyLimits | None = None,
    close_model_on_shutdown: bool = True,
) -> Any:
    """Build the Starlette app serving every model of ``repository`` (routes in the module
    docs); on lifespan shutdown every model is closed with ``drain=True`` (unless
    ``close_model_on_shutdown=False``)."""
    require("starlette")
    from starlette.routing import Route

    metrics = ServerMetrics()
    metrics.registry.register(_ModelsCollector(repository))
    limits = body or BodyLimits()
    dispatch = _Dispatch(repository, limits)
    routes = [
        *_extension_routes(repository, limits),
        Route("/v2/models/{name}{rest:path}", AsgiEndpoint(dispatch.by_path), methods=["GET", "POST"]),
        *(Route(path, AsgiEndpoint(dispatch.by_body), methods=["POST"]) for path in BODY_ROUTES),
    ]
    docs = repository_docs(repository, limits)
    return assemble_app(routes, repository, metrics, close_on_shutdown=close_model_on_shutdown, docs=docs)
