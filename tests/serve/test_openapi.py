"""/openapi.json and /docs: the document and the mounted routes cannot drift apart (each
mounted route is documented or named as refused, and each entry of the operations table is
mounted by some app), the document is valid OpenAPI 3.1, its examples are answered 200
with bodies its schemas accept (checked with ``jsonschema``, not by ortbatch), and the
OpenAI request schemas name only the openai client's own fields (plus named extensions)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("jsonschema")

from fakegen import FakeGenerator
from starlette.testclient import TestClient

from ortbatch.generation.chat import ChatTemplate
from ortbatch.serve import ServeConfig, ServedModel
from ortbatch.serve.assembly import app_for
from ortbatch.serve.http.app import build_app
from ortbatch.serve.http.openapi import DOCS_PATHS, mounted
from ortbatch.serve.http.openapi_schemas import OPERATIONS, SCHEMAS
from ortbatch.serve.served.generator import ServedGenerator
from ortbatch.serve.served.repository import ModelRepository

KEY = "docs-test-key"
TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"


def starlette_of(app: Any) -> Any:
    """The Starlette app under the middleware (ApiKeyMiddleware, RequestObserver, FastRoutes)."""
    while not hasattr(app, "router"):
        app = app.app
    return app


def operations(doc: dict[str, Any]) -> set[tuple[str, str]]:
    return {(m.upper(), p) for p, item in doc["paths"].items() for m in item}


def refused(doc: dict[str, Any]) -> set[tuple[str, str]]:
    """The routes the description names as mounted and refused."""
    out = set()
    for line in doc["info"]["description"].splitlines():
        if line.startswith("- `"):
            method, path = line[3:].split("`", 1)[0].split(" ")
            out.add((method, path))
    return out


@pytest.fixture(scope="module")
def models(task_dirs: dict[str, Path]) -> Iterator[dict[str, Any]]:
    """Every kind of served thing: an embedder, a reranker, a classifier, a tagger, a generator."""
    served: dict[str, Any] = {n: ServedModel.load(d, name=n) for n, d in task_dirs.items()}
    served["gen"] = ServedGenerator(FakeGenerator(), "gen")
    served["chat"] = ServedGenerator(FakeGenerator(), "chat", chat_template=ChatTemplate(TEMPLATE))
    yield served
    for s in served.values():
        s.close(drain=False)


@pytest.fixture(scope="module")
def repository(task_dirs: dict[str, Path]) -> Iterator[ModelRepository]:
    pairs = [(name, task_dirs[name]) for name in ("embedder", "reranker")]
    repo = ModelRepository(pairs, config=ServeConfig(warmup=False))
    repo.load_all()
    yield repo
    repo.close(drain=False)


def document_of(app: Any, **headers: str) -> dict[str, Any]:
    with TestClient(app) as client:
        response = client.get("/openapi.json", headers=headers)
        assert response.status_code == 200, response.text
        return dict(response.json())


@pytest.mark.parametrize("name", ["embedder", "reranker", "sentiment", "ner", "gen", "chat"])
def test_a_models_document_lists_every_mounted_route_or_names_it_refused(models, name):
    app = app_for(models[name], ServeConfig(), close_model_on_shutdown=False)
    doc = document_of(app)
    routes = set(mounted(starlette_of(app).routes))
    assert operations(doc) | refused(doc) == routes
    assert not operations(doc) & refused(doc)
    undocumented = [
        (m, p) for p, item in doc["paths"].items() for m, op in item.items() if "x-ortbatch-undocumented" in op
    ]
    assert undocumented == [], "add these routes to ortbatch/serve/http/openapi_schemas.OPERATIONS"
    # what each kind serves is listed, what it refuses is not
    listed = {p for _, p in operations(doc)}
    assert ("/v1/chat/completions" in listed) == (name == "chat")
    if name in ("gen", "chat"):
        assert "/v1/completions" in listed and "/v1/embeddings" not in listed
        assert "/v2/models/{name}/infer" not in listed
    else:
        assert "/v1/completions" not in listed and "/v2/models/{name}/infer" in listed
    assert ("/v1/embeddings" in listed) == (name == "embedder")
    assert ("/v1/rerank" in listed) == (name == "reranker")
    assert ("/v1/classify" in listed) == (name in ("sentiment", "ner", "reranker"))


def test_a_repositorys_document_lists_its_routes_and_each_models_own(repository):
    app = app_for(repository, ServeConfig(), close_model_on_shutdown=False)
    doc = document_of(app)
    # what the repository's dispatch reaches: each model's own /v2/models/... routes
    expected = set()
    for _, loaded in repository.loaded():
        own = starlette_of(build_app(loaded.served, close_on_shutdown=False)).routes
        expected |= {(m, p) for m, p in mounted(own) if p.startswith("/v2/models/")}
    dispatch = "/v2/models/{name}{rest:path}"
    routes = {(m, p) for m, p in mounted(starlette_of(app).routes) if p != dispatch}
    assert operations(doc) | refused(doc) == routes | expected
    infer = doc["paths"]["/v2/models/{name}/infer"]["post"]
    names = infer["parameters"][0]["schema"]["enum"]
    assert sorted(names) == ["embedder", "embedder_text", "reranker", "reranker_text"]
    assert set(infer["requestBody"]["content"]["application/json"]["examples"]) == set(names)
    # a body route lists the model that serves it in its example; one nobody serves is refused
    embeddings = doc["paths"]["/v1/embeddings"]["post"]["requestBody"]["content"]["application/json"]
    assert embeddings["example"]["model"] == "embedder"
    assert ("POST", "/v1/completions") in refused(doc)


def test_every_entry_of_the_operations_table_is_mounted_by_some_app(models, repository):
    seen: set[tuple[str, str]] = set()
    for served in [*models.values(), repository]:
        doc = document_of(app_for(served, ServeConfig(), close_model_on_shutdown=False))
        seen |= operations(doc) | refused(doc)
    assert set(OPERATIONS) - seen == set(), "entries no app mounts: remove them from OPERATIONS"


def test_the_document_is_valid_openapi_3_1(models, repository):
    from openapi_spec_validator import validate

    for served in [models["embedder"], models["gen"], repository]:
        doc = document_of(app_for(served, ServeConfig(), close_model_on_shutdown=False))
        assert doc["openapi"].startswith("3.1")
        validate(doc)


def _validator(doc: dict[str, Any], ref: str) -> Any:
    """A Draft 2020-12 validator of the schema at ``ref``, its references resolved in ``doc``."""
    import jsonschema
    from referencing import Registry, Resource
    from referencing.jsonschema import DRAFT202012

    registry = Registry().with_resource("urn:doc", Resource(contents=doc, specification=DRAFT202012))
    return jsonschema.Draft202012Validator({"$ref": "urn:doc" + ref}, registry=registry)


def _check_answer(doc: dict[str, Any], op: dict[str, Any], response: Any, what: str) -> None:
    assert response.status_code == 200, f"{what}: {response.status_code} {response.text[:300]}"
    content = op["responses"]["200"]["content"]
    if "application/json" not in content:
        return
    errors = list(_validator(doc, content["application/json"]["schema"]["$ref"]).iter_errors(response.json()))
    assert errors == [], f"{what}: the answer does not match its schema: {errors[0].message}"


def _path_for(path: str, op: dict[str, Any], name: str | None = None) -> str:
    for param in op.get("parameters", []):
        value = name if param["name"] == "name" and name else param["schema"].get("default", "")
        path = path.replace("{" + param["name"] + "}", value)
    return path


@pytest.mark.parametrize("name", ["embedder", "reranker", "sentiment", "ner", "gen", "chat"])
def test_every_example_is_answered_and_every_answer_matches_its_schema(models, name):
    app = app_for(models[name], ServeConfig(), close_model_on_shutdown=False)
    doc = document_of(app)
    with TestClient(app) as client:
        for path, item in doc["paths"].items():
            for method, op in item.items():
                body = op.get("requestBody", {}).get("content", {}).get("application/json", {})
                if method == "get":
                    _check_answer(doc, op, client.get(_path_for(path, op)), f"GET {path}")
                elif "examples" in body:  # the v2 infer examples, one per model entry
                    for entry, example in body["examples"].items():
                        answer = client.post(_path_for(path, op, entry), json=example["value"])
                        _check_answer(doc, op, answer, f"POST {path} ({entry})")
                else:
                    answer = client.post(_path_for(path, op), json=body["example"])
                    _check_answer(doc, op, answer, f"POST {path}")


def test_a_schema_refuses_an_answer_it_does_not_describe(models):
    """The schema check above can fail: an embedding answer without its data is refused."""
    doc = document_of(app_for(models["embedder"], ServeConfig(), close_model_on_shutdown=False))
    bad = {"object": "list", "model": "embedder", "usage": {"prompt_tokens": 1, "total_tokens": 1}}
    assert list(_validator(doc, "#/components/schemas/EmbeddingResponse").iter_errors(bad))


def test_the_openai_request_schemas_name_the_openai_clients_fields():
    from openai.types import CompletionCreateParams, EmbeddingCreateParams
    from openai.types.chat import CompletionCreateParams as ChatCreateParams

    def fields(params: Any) -> set[str]:
        out: set[str] = set()
        for cls in getattr(params, "__args__", (params,)):  # a Union of the streaming and plain forms
            out |= set(getattr(cls, "__annotations__", {}))
        return out

    extensions = {"truncate", "top_k", "prompt_name", "prompt"}  # ortbatch's own, as TEI's and vLLM's
    assert set(SCHEMAS["EmbeddingRequest"]["properties"]) - extensions <= fields(EmbeddingCreateParams)
    assert set(SCHEMAS["CompletionRequest"]["properties"]) - extensions <= fields(CompletionCreateParams)
    assert set(SCHEMAS["ChatCompletionRequest"]["properties"]) - extensions <= fields(ChatCreateParams)


def test_with_a_key_the_page_is_open_and_the_document_and_calls_need_the_key(models):
    app = app_for(models["embedder"], ServeConfig(api_key=KEY), close_model_on_shutdown=False)
    with TestClient(app) as client:
        page = client.get("/docs")
        assert page.status_code == 200 and "swagger-ui-bundle.js" in page.text
        assert client.get("/docs/swagger-ui-bundle.js").status_code == 200
        assert client.get("/docs/swagger-ui.css").headers["content-type"].startswith("text/css")
        assert client.get("/docs/../metrics").status_code in (401, 404)
        assert client.get("/docs/index.html").status_code == 404  # only the page's own assets
        assert client.get("/openapi.json").status_code == 401
        assert client.post("/v1/embeddings", json={"input": "x"}).status_code == 401
        doc = client.get("/openapi.json", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert doc["components"]["securitySchemes"] == {"bearer": {"type": "http", "scheme": "bearer"}}
    assert doc["paths"]["/v2/health/ready"]["get"]["security"] == []
    assert doc["paths"]["/v1/embeddings"]["post"]["security"] == [{"bearer": []}]
    # without a key nothing asks for one
    open_doc = document_of(app_for(models["embedder"], ServeConfig(), close_model_on_shutdown=False))
    assert "securitySchemes" not in open_doc["components"]
    assert "security" not in open_doc["paths"]["/v1/embeddings"]["post"]


def test_the_docs_routes_are_not_in_the_document(models):
    doc = document_of(app_for(models["embedder"], ServeConfig(), close_model_on_shutdown=False))
    assert not set(doc["paths"]) & DOCS_PATHS
