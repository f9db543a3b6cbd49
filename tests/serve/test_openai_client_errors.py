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


@pytest.mark.asyncio
async def test_a_fault_outside_the_handlers_is_still_an_openai_error_under_v1():
    from starlette.routing import Route

    from ortbatch.serve.http.plumbing import AsgiEndpoint, assemble_app
    from ortbatch.serve.metrics import ServerMetrics

    async def broken(scope, receive, send):  # a bare ASGI route: no handled_route to catch it
        raise RuntimeError("secret detail")

    served = type("Served", (), {"name": "m", "ready": True, "close": lambda self, drain=True: None})()
    routes = [Route(p, AsgiEndpoint(broken), methods=["POST"]) for p in ("/v1/boom", "/v2/boom")]
    app = assemble_app(routes, served, ServerMetrics(), close_on_shutdown=False)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as http:
        client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", max_retries=0, http_client=http)
        with pytest.raises(openai.InternalServerError) as info:
            await client.post("/boom", cast_to=object)
        assert info.value.body["message"].startswith("internal server error (logged as incident ")
        assert info.value.type == "server_error" and "secret" not in info.value.response.text
        r = await http.post("/v2/boom")
        assert r.status_code == 500 and r.json()["error"].startswith("internal server error")
