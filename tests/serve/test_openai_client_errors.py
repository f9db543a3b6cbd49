"""The /v1 routes as the real ``openai`` client sees them: the answers Starlette's router
gives (an unknown /v1 route, a wrong method) carry OpenAI's error shape as the routes'
own errors do, and ``models.retrieve`` (``GET /v1/models/{model}``) is served."""

from __future__ import annotations

import httpx
import openai
import pytest

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def client(encoder_server):
    with openai.OpenAI(base_url=encoder_server.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


@pytest.mark.parametrize(
    ("method", "path", "error", "status", "message"),
    [
        ("get", "/nowhere", openai.NotFoundError, 404, "no route '/v1/nowhere'"),
        ("get", "/embeddings", openai.APIStatusError, 405, "method GET not allowed"),
        ("delete", "/models", openai.APIStatusError, 405, "method DELETE not allowed"),
    ],
)
def test_router_errors_under_v1_parse_into_openai_exceptions(client, method, path, error, status, message):
    with pytest.raises(error) as info:
        getattr(client, method)(path, cast_to=object)
    exc = info.value
    assert exc.status_code == status
    # the body's error.message (the client shows a bare "Error code: 404" without it)
    assert exc.message == f"Error code: {status} - {message}"
    assert exc.body["message"] == message
    assert exc.type == "invalid_request_error" if status == 405 else exc.type == "not_found_error"
    assert exc.param is None
    if status == 405:
        assert "GET" in exc.response.headers["allow"] or "POST" in exc.response.headers["allow"]


def test_router_errors_outside_v1_keep_the_v2_shape(encoder_server):
    r = httpx.get(encoder_server.url + "/v2/nowhere")
    assert r.status_code == 404 and r.json() == {"error": "no route '/v2/nowhere'"}


def test_models_retrieve(client):
    model = client.models.retrieve("tiny")
    assert (model.id, model.object, model.owned_by) == ("tiny", "model", "ortbatch")
    assert [m.id for m in client.models.list()] == ["tiny"]
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("nope")
    assert info.value.body["message"] == "unknown model 'nope'; this server serves 'tiny'"
    assert info.value.type == "not_found_error"
