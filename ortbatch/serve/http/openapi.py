"""The API's own description: ``GET /openapi.json`` (OpenAPI 3.1) and ``GET /docs``, a
Swagger UI page served offline from the ``swagger-ui-bundle-v2`` package (the serve extra).

The document is made from the routes the app actually mounts (``app.routes``, read at each
request, so a repository's document lists the models present now), each described by its
entry in :data:`~.openapi_schemas.OPERATIONS`. Routes an app mounts only to refuse them
(the other kind of export's endpoints, a task this model does not serve) are left out and
named in the description. A route without an entry still appears, marked
``x-ortbatch-undocumented``; ``tests/serve/test_openapi.py`` fails on it.

With an API key set (``--api-key``), ``/docs`` and its assets stay open (a static page,
nothing of the server in it) while ``/openapi.json`` and every call need the key: the page
asks for it through Swagger UI's Authorize dialog (a bearer scheme) and sends it with the
document's request and with each "Try it out".
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ... import __version__
from ..._extras import require
from ..served.kinds import BODY_ROUTES, registered
from ..served.lookup import Entries
from ..served.repository import ModelRepository
from .app import routes_for
from .openapi_schemas import OPERATIONS, SCHEMAS, Operation
from .plumbing import BodyLimits, handled_route, json_response

__all__ = [
    "DOCS_PATHS",
    "ApiFacts",
    "docs_routes",
    "document",
    "model_docs",
    "model_facts",
    "mounted",
    "repository_docs",
    "repository_facts",
]

#: the routes of the docs themselves (not in the document)
DOCS_PATHS = frozenset({"/openapi.json", "/docs", "/docs/{asset}"})
#: what the page loads from the Swagger UI bundle
_ASSETS = {
    "swagger-ui-bundle.js": "application/javascript",
    "swagger-ui.css": "text/css",
    "favicon-32x32.png": "image/png",
}
_PARAM = re.compile(r"{(\w+)(?::\w+)?}")
#: the one route of a repository's app that reaches every model's own /v2/models/{name}/... routes
_REPOSITORY_DISPATCH = "/v2/models/{name}{rest:path}"


def mounted(routes: Iterable[Any]) -> list[tuple[str, str]]:
    """``(METHOD, path template)`` of each route (HEAD, which Starlette adds to every GET,
    and the docs' own routes left out), in mounting order."""
    out: list[tuple[str, str]] = []
    for route in routes:
        path = getattr(route, "path", None)
        if path is None or path in DOCS_PATHS:
            continue
        out += [(m, path) for m in sorted(getattr(route, "methods", None) or ()) if m != "HEAD"]
    return out


class ApiFacts:
    """What the document says of the served models: the operations it lists (with the
    names their ``{name}`` takes and the model their examples name), what is mounted but
    refused (with why), and the KServe infer examples of each model entry."""

    def __init__(self, title: str) -> None:
        self.title = title
        #: (method, path) -> the model names its path's ``{name}`` takes
        self.listed: dict[tuple[str, str], list[str]] = {}
        #: (method, path) -> why the route is mounted but refused for what is served
        self.refused: dict[tuple[str, str], str] = {}
        #: entry name -> a KServe v2 infer request for it
        self.infer_examples: dict[str, Any] = {}
        #: (method, path) -> the Operation a model's own kind describes it by, in that model's own
        #: document (:meth:`~ortbatch.serve.served.kinds.ModelKind.operations`: an image export's
        #: /v1/embeddings takes images); a repository's document keeps the shared table's
        self.own: dict[tuple[str, str], Operation] = {}
        #: the schemas of the kinds present (their :meth:`~ortbatch.serve.served.kinds.ModelKind.schemas`)
        self.schemas: dict[str, Any] = {}

    def list(self, op: tuple[str, str], names: Iterable[str]) -> None:
        known = self.listed.setdefault(op, [])
        known += [n for n in names if n not in known]

    def refuse(self, op: tuple[str, str], reason: str) -> None:
        self.refused.setdefault(op, reason)


def _infer_example(meta: Mapping[str, Any]) -> dict[str, Any]:
    """A v2 infer request for the entry whose metadata is ``meta``: one row, length 4."""
    inputs = []
    for tensor in meta["inputs"]:
        datatype = tensor["datatype"]
        shape = [1] + [d if isinstance(d, int) and d > 0 else 4 for d in tensor["shape"][1:]]
        if datatype == "BYTES":
            inputs.append({"name": tensor["name"], "datatype": datatype, "shape": [1], "data": ["Hello, world!"]})
            continue
        count = 1
        for d in shape:
            count *= d
        value: Any = 0.5 if datatype.startswith("FP") else (0 if "type" in tensor["name"] else 1)
        inputs.append({"name": tensor["name"], "datatype": datatype, "shape": shape, "data": [value] * count})
    return {"inputs": inputs}


def model_facts(served: Any, routes: Iterable[Any], facts: ApiFacts | None = None) -> ApiFacts:
    """The facts of one model's app over its mounted ``routes`` (added to ``facts``, as a
    repository gathers its models'): what its kind serves and refuses
    (:meth:`~ortbatch.serve.served.kinds.ModelKind.openapi_refusal`) and its entries'
    KServe v2 infer examples."""
    own = facts is None  # the model's own document (not one of a repository's models)
    facts = facts if facts is not None else ApiFacts(f"ortbatch: {served.name}")
    entries = Entries(served)
    kind = entries.kind
    names = [served.name] + ([entries.text_view.name] if entries.text_view is not None else [])
    endpoints = kind.endpoints(served)
    for method, path in mounted(routes):
        reason = kind.openapi_refusal(served, method, path, endpoints)
        if reason:
            facts.refuse((method, path), reason)
        else:
            facts.list((method, path), names)
    for name, meta in kind.kserve_metadata(served, entries).items():
        facts.infer_examples[name] = _infer_example(meta)
    facts.schemas.update(kind.schemas())
    if own:
        facts.own.update(kind.operations())
    return facts


def repository_facts(repository: ModelRepository, routes: Iterable[Any], body: BodyLimits) -> ApiFacts:
    """The facts of a repository's app: its own routes, each loaded model's
    ``/v2/models/{name}/...`` routes (what the dispatch route reaches), and the body routes
    some model present serves (the others are refused)."""
    facts = ApiFacts("ortbatch: a model repository")
    per_model = ApiFacts("")
    for _, loaded in repository.loaded():
        model_facts(loaded.served, routes_for(loaded.served, body), per_model)
    facts.infer_examples = per_model.infer_examples
    facts.schemas = per_model.schemas
    for method, path in mounted(routes):
        if path == _REPOSITORY_DISPATCH:
            for (m, p), names in per_model.listed.items():
                if m == method and p.startswith("/v2/models/"):
                    facts.list((m, p), names)
        elif path in BODY_ROUTES:
            serving = repository.serving(BODY_ROUTES[path])
            if serving:
                facts.list((method, path), serving)
            else:
                facts.refuse((method, path), "no model present serves it")
        else:
            facts.list((method, path), [])
    return facts


def _parameters(path: str, names: list[str]) -> list[dict[str, Any]]:
    out = []
    for param in _PARAM.findall(path):
        schema: dict[str, Any] = {"type": "string"}
        if param == "name" and names:
            schema = {"type": "string", "enum": names, "default": names[0]}
        elif param == "version":
            schema = {"type": "string", "default": "1"}
        out.append({"name": param, "in": "path", "required": True, "schema": schema})
    return out


def _named(example: Any, model: str) -> Any:
    """``example`` with every ``"{model}"`` replaced by ``model`` (left out without one)."""
    if isinstance(example, dict):
        return {k: _named(v, model) for k, v in example.items() if not (v == "{model}" and not model)}
    if isinstance(example, list):
        return [_named(v, model) for v in example]
    return model if example == "{model}" else example


def _operation(method: str, path: str, names: list[str], facts: ApiFacts, auth: bool) -> dict[str, Any]:
    spec = facts.own.get((method, path)) or OPERATIONS.get((method, path)) or _kind_operations().get((method, path))
    op_id = re.sub(r"[^A-Za-z0-9]+", "_", f"{method.lower()}{path}").strip("_")
    if spec is None:  # mounted, but nobody said what it is: tests/serve/test_openapi.py fails on it
        spec = Operation(f"{method} {path}", "Undocumented")
    content: dict[str, Any] = {spec.media: {"schema": {"$ref": f"#/components/schemas/{spec.response}"}}}
    if spec.response is None:
        content = {spec.media: {"schema": {"type": "string"}}}
    error = {"$ref": "#/components/responses/Error"}
    op: dict[str, Any] = {
        "summary": spec.summary,
        "operationId": op_id,
        "tags": [spec.tag],
        "responses": {"200": {"description": "OK", "content": content}, "default": error},
    }
    if spec.tag == "Undocumented":
        op["x-ortbatch-undocumented"] = True
    if spec.description:
        op["description"] = spec.description
    if params := _parameters(path, names):
        op["parameters"] = params
    if spec.request is not None:
        media: dict[str, Any] = {"schema": {"$ref": f"#/components/schemas/{spec.request}"}}
        if path.endswith("/infer"):
            wanted = names or list(facts.infer_examples)
            media["examples"] = {n: {"value": facts.infer_examples[n]} for n in wanted if n in facts.infer_examples}
        elif spec.example is not None:
            media["example"] = _named(spec.example, names[0] if names else "")
        op["requestBody"] = {"required": not path.startswith("/v2/repository"), "content": {"application/json": media}}
    if auth:
        op["security"] = [] if spec.open else [{"bearer": []}]
        if not spec.open:
            op["responses"]["401"] = error
    return op


def _kind_operations() -> dict[tuple[str, str], Operation]:
    """The operations the registered model kinds describe besides :data:`OPERATIONS`."""
    out: dict[tuple[str, str], Operation] = {}
    for kind in registered():
        out.update(kind.operations())
    return out


def document(facts: ApiFacts, auth: bool = False) -> dict[str, Any]:
    """The OpenAPI 3.1 document of the operations ``facts`` lists; ``auth``: the server
    wants a bearer key (each operation but the health checks says so)."""
    paths: dict[str, dict[str, Any]] = {}
    for (method, path), names in facts.listed.items():
        paths.setdefault(path, {})[method.lower()] = _operation(method, path, names, facts, auth)
    description = "Generated from the routes this server mounts."
    if facts.refused:
        lines = [f"- `{m} {p}`: {why}" for (m, p), why in sorted(facts.refused.items())]
        description += " Also mounted, and refused for what this server serves:\n\n" + "\n".join(lines)
    components: dict[str, Any] = {
        "schemas": copy.deepcopy({**SCHEMAS, **facts.schemas}),
        "responses": {
            "Error": {
                "description": "An error (400 bad input, 401 no key, 404 unknown model, 413 too large, 429 queue "
                "full, 503 shutting down, 504 deadline)",
                "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
            }
        },
    }
    if auth:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return {
        "openapi": "3.1.0",
        "info": {"title": facts.title, "version": __version__, "description": description},
        "paths": paths,
        "components": components,
    }


_PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>ortbatch API</title>
<link rel="stylesheet" href="docs/swagger-ui.css">
<link rel="icon" type="image/png" href="docs/favicon-32x32.png">
</head>
<body>
<div id="swagger-ui"></div>
<script src="docs/swagger-ui-bundle.js"></script>
<script>
// The document needs the API key when the server has one: ask for it with Swagger UI's own
// Authorize dialog (over a placeholder document that declares the bearer scheme), then load
// the real document with it. The key goes with the document's request and each call.
const specUrl = new URL("openapi.json", window.location.href).href;
let apiKey = null;
const placeholder = {
  openapi: "3.1.0",
  info: {title: "ortbatch", version: "", description:
    "This server needs an API key: press **Authorize**, enter the key and press Authorize."},
  paths: {},
  components: {securitySchemes: {bearer: {type: "http", scheme: "bearer"}}},
  security: [{bearer: []}],
};
async function loadSpec(ui) {
  const headers = apiKey ? {Authorization: "Bearer " + apiKey} : {};
  const response = await fetch(specUrl, {headers});
  if (response.status === 401) {
    ui.specActions.updateSpec(JSON.stringify(apiKey ? {...placeholder, info: {...placeholder.info,
      description: "That key was refused: press **Authorize**, log out and enter the right key."}} : placeholder));
    return;
  }
  ui.specActions.updateSpec(await response.text());
}
const KeyPlugin = () => ({statePlugins: {auth: {wrapActions: {
  authorize: (original, system) => (payload) => {
    const result = original(payload);
    const entry = payload && payload.bearer;
    if (entry && entry.value) { apiKey = entry.value; loadSpec(window.ui); }
    return result;
  },
  logout: (original) => (payload) => { apiKey = null; return original(payload); },
}}}});
window.onload = () => {
  window.ui = SwaggerUIBundle({
    dom_id: "#swagger-ui",
    spec: {openapi: "3.1.0", info: {title: "ortbatch", version: ""}, paths: {}},
    deepLinking: true,
    tryItOutEnabled: false,
    presets: [SwaggerUIBundle.presets.apis],
    plugins: [KeyPlugin],
    layout: "BaseLayout",
    requestInterceptor: (request) => {
      if (apiKey && !request.headers.Authorization) { request.headers.Authorization = "Bearer " + apiKey; }
      return request;
    },
  });
  loadSpec(window.ui);
};
</script>
</body>
</html>
"""


def docs_routes(facts: Callable[[list[Any]], ApiFacts], routes: list[Any]) -> list[Any]:
    """``GET /openapi.json`` (the document of ``facts(routes)``, made at each request:
    ``routes`` is the app's route list, read as it is then), ``GET /docs`` and the page's
    assets. The document says a key is needed when the API-key door let the request in
    (``scope["ortbatch.auth"]``)."""
    from starlette.responses import FileResponse, Response

    async def openapi(request: Any) -> Any:
        return json_response(document(facts(routes), auth=bool(request.scope.get("ortbatch.auth"))))

    async def page(request: Any) -> Any:
        return Response(_PAGE, media_type="text/html", headers={"Cache-Control": "no-cache"})

    async def asset(request: Any) -> Any:
        name = request.path_params["asset"]
        media = _ASSETS.get(name)
        if media is None:
            return json_response({"error": f"no asset {name[:80]!r}"}, 404)
        bundle = require("swagger_ui_bundle", "serve")  # an ImportError naming the extra
        return FileResponse(bundle.swagger_ui_path / name, media_type=media, headers={"Cache-Control": "max-age=3600"})

    return [
        handled_route("/openapi.json", openapi, "GET"),
        handled_route("/docs", page, "GET"),
        handled_route("/docs/{asset}", asset, "GET"),
    ]


def model_docs(served: Any) -> Callable[[list[Any]], list[Any]]:
    """The ``docs`` of :func:`~.app.build_app` for one model's app."""
    return lambda routes: docs_routes(lambda mounted_routes: model_facts(served, mounted_routes), routes)


def repository_docs(repository: ModelRepository, body: BodyLimits) -> Callable[[list[Any]], list[Any]]:
    """The ``docs`` of :func:`~.plumbing.assemble_app` for a repository's app."""
    return lambda routes: docs_routes(lambda mounted_routes: repository_facts(repository, mounted_routes, body), routes)
