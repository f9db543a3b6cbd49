"""The Open Inference Protocol (KServe v2) routes over one :class:`ServedModel`::

    GET  /v2                                               server metadata
    GET  /v2/models/{name}[/versions/{version}]            model metadata
    GET  /v2/models/{name}[/versions/{version}]/ready
    GET  /v2/models/{name}[/versions/{version}]/config     Triton-style config
    POST /v2/models/{name}[/versions/{version}]/infer      JSON or binary tensors
    POST /v2/models/{name}[/versions/{version}]/generate   a generation export (and generate_stream)

The wire format is :mod:`~ortbatch.serve.served.protocol`; errors, bodies and the app itself
come from :mod:`~ortbatch.serve.http.plumbing`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from ... import __version__
from ...errors import InvalidInputError
from ..served.decoupled import GenerationModel
from ..served.lookup import Entries
from ..served.model import ServedModel
from ..served.protocol import dumps_json, encode_infer_response, loads_json, parse_infer_request
from .plumbing import (
    BodyLimits,
    HTTPError,
    Incoming,
    Reply,
    asgi_route,
    error_response,
    event_stream_response,
    handled_route,
    json_response,
    offload,
    run_or_abandon,
)

__all__ = ["HEADER_LENGTH", "generation_routes", "kserve_routes"]

HEADER_LENGTH = "inference-header-content-length"

Handler = Callable[[Any], Awaitable[Any]]


def kserve_routes(model: ServedModel, body: BodyLimits) -> list[Any]:
    """The v2 routes serving ``model`` (for :func:`~ortbatch.serve.http.plumbing.assemble_app`)."""
    from starlette.requests import Request
    from starlette.responses import Response

    entries = Entries(model)  # the model and its text-in entry, {name}_text

    def find_model(request: Any) -> Any:
        return entries.find(request.path_params["name"], request.path_params.get("version"))

    # -- v2 handlers ------------------------------------------------------------------
    async def server_metadata(request: Request) -> Response:
        return json_response({"name": "ortbatch", "version": __version__, "extensions": ["binary_tensor_data"]})

    model_metadata, model_config, model_ready = _info_handlers(find_model)

    async def infer(request: Incoming) -> Reply:
        m = find_model(request)
        data_in = await body.read(request)
        header_length = _header_length(request)
        req = await offload(len(data_in), parse_infer_request, data_in, header_length)
        outputs = await run_or_abandon(request.receive, m.infer(req))
        binary = [req.wants_binary(name) for name, _ in outputs]
        nbytes = sum(a.nbytes for _, a in outputs)
        data, ctype, hlen = await offload(nbytes, encode_infer_response, m.name, m.version, outputs, binary, req.id)
        return Reply(data, ctype, {"Inference-Header-Content-Length": str(hlen)} if hlen is not None else None)

    route = handled_route
    base = "/v2/models/{name}"
    versioned = "/v2/models/{name}/versions/{version}"
    # the routes every request takes are bare ASGI (matched ahead of Starlette's
    # middleware and router: see http.FastRoutes), and first
    return [
        asgi_route(base + "/infer", infer, "POST"),
        asgi_route(versioned + "/infer", infer, "POST"),
        route("/v2", server_metadata, "GET"),
        route(base, model_metadata, "GET"),
        route(versioned, model_metadata, "GET"),
        route(base + "/config", model_config, "GET"),
        route(versioned + "/config", model_config, "GET"),
        route(base + "/ready", model_ready, "GET"),
        route(versioned + "/ready", model_ready, "GET"),
    ]


_HEADER_LENGTH_KEY = HEADER_LENGTH.encode("latin-1")


def _header_length(request: Incoming) -> int | None:
    """The ``Inference-Header-Content-Length`` header's value (None: not sent). Only ASCII
    digits, as Content-Length: Python's ``int`` would also take ``"+1_0"``; and two values
    that differ are refused rather than one picked (a proxy may have added one)."""
    values = {bytes(v).decode("latin-1").strip() for k, v in request.scope["headers"] if k == _HEADER_LENGTH_KEY}
    if not values:
        return None
    if len(values) > 1:
        shown = ", ".join(repr(v[:40]) for v in sorted(values))
        raise HTTPError(400, f"Inference-Header-Content-Length is sent more than once with different values ({shown})")
    (raw,) = values
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 18:
        raise HTTPError(
            400, f"invalid Inference-Header-Content-Length {raw[:40]!r}: expected the JSON's length in bytes"
        )
    return int(raw)


def _info_handlers(find_model: Callable[[Any], Any]) -> tuple[Handler, Handler, Handler]:
    """The metadata, config and ready handlers of the model ``find_model(request)`` finds
    (a ServedModel, its text view, or a generator's decoupled v2 entry)."""

    async def model_metadata(request: Any) -> Any:
        return json_response(find_model(request).metadata())

    async def model_config(request: Any) -> Any:
        return json_response(find_model(request).triton_config())

    async def model_ready(request: Any) -> Any:
        m = find_model(request)
        if m.ready:
            return json_response({"name": m.name, "ready": True})
        return json_response({"error": f"model {m.name!r} is not ready (shutting down)"}, 503)

    return model_metadata, model_config, model_ready


def generation_routes(served: Any, body: BodyLimits | None = None) -> list[Any]:
    """The v2 model routes of a text-generation export (a
    :class:`~ortbatch.serve.served.generator.ServedGenerator`): metadata, config and ready
    describe its decoupled v2 model entry (:mod:`ortbatch.serve.served.decoupled`), as gRPC
    serves it, so ``tritonclient``'s ``is_model_ready`` agrees with the repository index;
    ``generate`` and ``generate_stream`` (KServe v2's generate extension, as Triton's) answer
    ``{"text_input": ..., "parameters": {/v1/completions fields}}`` through the same entry;
    infer is refused naming what serves it."""
    entries = Entries(served)
    model = GenerationModel(served)
    limits = body or BodyLimits()

    def find_model(request: Any) -> GenerationModel:
        entries.find(request.path_params["name"], request.path_params.get("version"))
        return model

    model_metadata, model_config, model_ready = _info_handlers(find_model)

    async def infer(request: Any) -> Any:
        m = find_model(request)
        raise HTTPError(
            400,
            f"model {m.name!r} is a text-generation export: it serves /v1/completions, v2 generate and "
            "generate_stream (gRPC: ModelStreamInfer)",
        )

    async def generate(request: Any) -> Any:
        m = find_model(request)
        answer = await m.answer(*await _generate_request(request, limits), stream=False)
        pieces = await run_or_abandon(request.receive, _all_pieces(answer))
        return json_response(_generate_body(m, [answer.values(p) for p in pieces], answer.req.n > 1))

    async def generate_stream(request: Any) -> Any:
        m = find_model(request)
        # a refused request (a bad field, a full queue) is a JSON error, before the stream
        answer = await m.answer(*await _generate_request(request, limits), stream=True)
        return event_stream_response(_generate_events(m, answer), on_stall=answer.cancel)

    routes = []
    for base in ("/v2/models/{name}", "/v2/models/{name}/versions/{version}"):
        routes += [
            handled_route(base, model_metadata, "GET"),
            handled_route(base + "/config", model_config, "GET"),
            handled_route(base + "/ready", model_ready, "GET"),
            handled_route(base + "/infer", infer, "POST"),
            handled_route(base + "/generate", generate, "POST"),
            handled_route(base + "/generate_stream", generate_stream, "POST"),
        ]
    return routes


async def _generate_request(request: Any, limits: BodyLimits) -> tuple[str, dict[str, Any]]:
    """A generate request's ``text_input`` and ``parameters`` (400 naming what is wrong)."""
    data = await limits.read(request)
    doc = await offload(len(data), loads_json, data)
    if not isinstance(doc, dict):
        raise InvalidInputError("the generate request must be a JSON object")
    unknown = sorted(set(doc) - {"text_input", "parameters"})
    if unknown:
        raise InvalidInputError(
            f"the generate request takes 'text_input' and 'parameters'; got {str(unknown[0])[:40]!r}",
            input_name=str(unknown[0])[:40],
        )
    text, parameters = doc.get("text_input"), doc.get("parameters") or {}
    if not isinstance(text, str):
        raise InvalidInputError("'text_input' must be a string (the prompt)", input_name="text_input")
    if not isinstance(parameters, dict):
        raise InvalidInputError("'parameters' must be an object of /v1/completions fields", input_name="parameters")
    return text, parameters


async def _all_pieces(answer: Any) -> list[Any]:
    return [p async for p in answer.pieces()]


def _generate_body(model: Any, values: list[dict[str, Any]], several: bool) -> dict[str, Any]:
    """generate's answer: each output's value, or with ``n`` > 1 a list of them, one per choice."""
    doc: dict[str, Any] = {"model_name": model.name, "model_version": model.version}
    if not several:
        return {**doc, **values[0]}
    for name in dict.fromkeys(k for v in values for k in v):
        if name != "index":
            doc[name] = [v.get(name) for v in sorted(values, key=lambda v: v["index"])]
    return doc


async def _generate_events(model: Any, answer: Any) -> AsyncIterator[bytes]:
    """generate_stream's server-sent events: one per piece, or ``{"error": ...}``."""
    head = {"model_name": model.name, "model_version": model.version}
    try:
        async for piece in answer.pieces():
            yield b"data: " + dumps_json({**head, **answer.values(piece)}) + b"\n\n"
    except Exception as exc:
        _status, body, _headers = error_response(exc)
        yield b"data: " + dumps_json(body) + b"\n\n"
