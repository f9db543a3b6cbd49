"""Acceptance 4: hypothesis fuzzing of every new endpoint (the task endpoints and the
repository extension), through a repository server: never a 5xx, never a hang; a body
with one bad field gets a 400 that names that field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ortbatch.serve import BackgroundServer, ServeConfig
from ortbatch.serve.served.repository import ModelRepository

pytestmark = pytest.mark.timeout(300)

# Sized for a 2-core CI machine (a few seconds per endpoint).
FUZZ = settings(
    max_examples=25,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=40)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=16,
)

# endpoint -> a valid body; each fuzzed body replaces (or adds) one of its fields
VALID = {
    "/v1/rerank": {"model": "reranker", "query": "the fox", "documents": ["hello world", "many callers"]},
    "/rerank": {"model": "reranker", "query": "the fox", "texts": ["hello world"]},
    "/v1/classify": {"model": "sentiment", "input": ["hello world"]},
    "/tokenize": {"model": "embedder", "inputs": "hello world"},
    "/detokenize": {"model": "embedder", "ids": [2, 5, 3]},
    "/v1/embeddings": {"model": "embedder", "input": "hello world"},
}
FIELDS = {
    "/v1/rerank": ["query", "documents", "top_n", "return_documents", "raw_scores", "truncate"],
    "/rerank": ["query", "texts", "top_n", "return_text", "raw_scores", "truncate"],
    "/v1/classify": ["input", "truncate"],
    "/tokenize": ["inputs", "prompt", "add_special_tokens"],
    "/detokenize": ["ids", "tokens", "skip_special_tokens"],
    "/v1/embeddings": ["truncate"],
}


@pytest.fixture(scope="module")
def server(task_dirs: dict[str, Path]) -> Iterator[BackgroundServer]:
    config = ServeConfig(port=0, access_log=False, log_level="warning", max_batch_size=8)
    repo = ModelRepository(list(task_dirs.items()), config=config)
    assert repo.load_all() == []
    with BackgroundServer(repo, config) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: BackgroundServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def _message(r: httpx.Response) -> str:
    err = r.json()["error"]
    return err["message"] if isinstance(err, dict) else err


@pytest.mark.parametrize("path", sorted(VALID))
def test_one_bad_field_is_a_400_naming_it(client, path):
    @FUZZ
    @given(field=st.sampled_from(FIELDS[path]), value=json_values)
    def check(field: str, value: object) -> None:
        body = {**VALID[path], field: value}
        r = client.post(path, json=body)
        assert r.status_code < 500, r.text
        if r.status_code != 200:
            assert r.status_code == 400, r.text
            assert f"'{field}'" in _message(r), (body, r.text)

    check()


@pytest.mark.parametrize("path", sorted(VALID))
def test_arbitrary_bodies_never_a_5xx(client, path):
    @FUZZ
    @given(
        body=st.one_of(
            json_values.map(lambda v: json.dumps(v).encode()),
            st.binary(max_size=64),
            st.dictionaries(st.sampled_from([*FIELDS[path], "model"]), json_values, max_size=4).map(
                lambda d: json.dumps(d).encode()
            ),
        )
    )
    def check(body: bytes) -> None:
        r = client.post(path, content=body, headers={"Content-Type": "application/json"})
        assert r.status_code < 500, r.text
        if r.status_code != 200:
            assert isinstance(_message(r), str)

    check()


def test_repository_extension_bodies_never_a_5xx(client):
    names = st.text(st.characters(codec="ascii", categories=["L", "N"]), min_size=1, max_size=6).filter(
        lambda n: n not in ("embedder", "reranker", "sentiment", "ner")
    )

    @FUZZ
    @given(
        action=st.sampled_from(["index", "load", "unload"]),
        name=names,
        body=json_values.map(lambda v: json.dumps(v).encode()) | st.binary(max_size=32),
    )
    def check(action: str, name: str, body: bytes) -> None:
        path = "/v2/repository/index" if action == "index" else f"/v2/repository/models/{name}/{action}"
        r = client.post(path, content=body)
        assert r.status_code in (200, 400, 404), r.text
        if r.status_code != 200:
            assert isinstance(r.json()["error"], str)

    check()
    # and every model still serves
    assert client.get("/v2/health/ready").json() == {"ready": True}
    assert client.post("/v1/classify", json={"model": "sentiment", "input": "hello"}).status_code == 200
