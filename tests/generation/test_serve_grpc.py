"""A real generation export over gRPC ``ModelStreamInfer`` (tritonclient's stream API):
several prompts on one stream, token by token, each answer the text the generator itself
gives for its prompt alone (greedy) and the text ``/v1/completions`` answers."""

from __future__ import annotations

import json
import queue
from collections.abc import Iterator

import numpy as np
import pytest

from ortbatch import BatchedGenerator

from .conftest import TinyModel

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
grpcclient = pytest.importorskip("tritonclient.grpc")

from ortbatch.serve import BackgroundServer, ServeConfig, ServedGenerator  # noqa: E402

NAME = "tiny-gpt2"
PROMPTS = ["hello world", "the cat", "a b c d e", "once upon"]


@pytest.fixture(scope="module")
def server(tiny_gpt2: TinyModel) -> Iterator[BackgroundServer]:
    served = ServedGenerator(BatchedGenerator(tiny_gpt2.export, max_batch_size=4, max_queue=64), NAME)
    config = ServeConfig(port=0, grpc_port=0, access_log=False, log_level="warning")
    with BackgroundServer(served, config) as srv:
        yield srv


def _inputs(prompt: str, max_tokens: int) -> list[object]:
    values = {
        "text_input": (np.array([prompt.encode()], dtype=object), "BYTES"),
        "stream": (np.array([True]), "BOOL"),
        "sampling_parameters": (
            np.array([json.dumps({"max_tokens": max_tokens, "temperature": 0}).encode()], dtype=object),
            "BYTES",
        ),
    }
    out = []
    for name, (array, datatype) in values.items():
        t = grpcclient.InferInput(name, [1], datatype)
        t.set_data_from_numpy(array)
        out.append(t)
    return out


def test_streamed_prompts_equal_the_generator_and_http(server: BackgroundServer, tiny_gpt2: TinyModel) -> None:
    assert server.grpc is not None
    items: queue.Queue[tuple[str, str, bool, str | None]] = queue.Queue()

    def on_response(result: object, error: object) -> None:
        if error is not None:
            items.put(("", "", True, str(error)))
            return
        r = result.get_response()  # type: ignore[attr-defined]
        text = result.as_numpy("text_output")[0].decode()  # type: ignore[attr-defined]
        items.put((r.id, text, r.parameters["triton_final_response"].bool_param, None))

    client = grpcclient.InferenceServerClient(server.grpc.address)
    client.start_stream(on_response)
    lengths = [7, 3, 9, 5]
    try:
        for i, (prompt, n) in enumerate(zip(PROMPTS, lengths, strict=True)):
            client.async_stream_infer(NAME, _inputs(prompt, n), request_id=str(i))
        pieces: dict[str, list[str]] = {}
        finals = 0
        while finals < len(PROMPTS):
            rid, text, final, error = items.get(timeout=60)
            assert error is None, error
            pieces.setdefault(rid, []).append(text)
            finals += final
    finally:
        client.stop_stream()
        client.close()
    with BatchedGenerator(tiny_gpt2.export, max_batch_size=1) as alone:
        for i, (prompt, n) in enumerate(zip(PROMPTS, lengths, strict=True)):
            want = alone.generate(prompt, n).text
            assert "".join(pieces[str(i)]) == want, (prompt, pieces[str(i)])
            assert len(pieces[str(i)]) > 1  # streamed, not answered at once
            body = {"model": NAME, "prompt": prompt, "max_tokens": n, "temperature": 0}
            http = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
            assert http["choices"][0]["text"] == want


FIELDS = {"max_tokens": 5, "temperature": 1.0, "seed": 4, "n": 2, "logprobs": 2, "echo": True}


def _http_choices(server: BackgroundServer, prompt: str, fields: dict) -> list[dict]:
    body = {"model": NAME, "prompt": prompt, **fields}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return sorted(r.json()["choices"], key=lambda c: c["index"])


def _joined(pieces: list[dict]) -> dict:
    """A choice's text, finish reason and logprobs from its pieces (streamed or whole)."""
    lp: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for p in pieces:
        for k in lp:
            lp[k] += p.get("logprobs", {}).get(k, [])
    return {"text": "".join(p["text_output"] for p in pieces), "finish": pieces[-1].get("finish_reason"), "lp": lp}


def _same_as_http(got: dict[int, list[dict]], want: list[dict]) -> None:
    assert sorted(got) == [c["index"] for c in want]
    for c in want:
        mine = _joined(got[c["index"]])
        assert (mine["text"], mine["finish"]) == (c["text"], c["finish_reason"])
        assert mine["lp"]["tokens"] == c["logprobs"]["tokens"]
        assert mine["lp"]["text_offset"] == c["logprobs"]["text_offset"]
        np.testing.assert_allclose(
            [x if x is not None else 0.0 for x in mine["lp"]["token_logprobs"]],
            [x if x is not None else 0.0 for x in c["logprobs"]["token_logprobs"]],
            atol=1e-5,
        )


@pytest.mark.parametrize("stream", [False, True])
def test_grpc_sampling_parameters_take_the_completions_fields(server: BackgroundServer, stream: bool) -> None:
    """n, logprobs and echo in ``sampling_parameters``: the ``index`` and ``logprobs`` outputs
    carry what /v1/completions answers for the same fields."""
    assert server.grpc is not None
    items: queue.Queue[tuple[dict, bool, str | None]] = queue.Queue()

    def on_response(result: object, error: object) -> None:
        if error is not None:
            items.put(({}, True, str(error)))
            return
        r = result.get_response()  # type: ignore[attr-defined]
        names = {o.name for o in r.outputs}
        piece = {"text_output": result.as_numpy("text_output")[0].decode()}  # type: ignore[attr-defined]
        piece["index"] = int(result.as_numpy("index")[0])  # type: ignore[attr-defined]
        if "logprobs" in names:  # a response with tokens (a stream's last may only finish)
            piece["logprobs"] = json.loads(result.as_numpy("logprobs")[0])  # type: ignore[attr-defined]
        if "finish_reason" in names:
            piece["finish_reason"] = result.as_numpy("finish_reason")[0].decode()  # type: ignore[attr-defined]
        items.put((piece, r.parameters["triton_final_response"].bool_param, None))

    inputs = _inputs("once upon", 5)
    inputs[1].set_data_from_numpy(np.array([stream]))
    inputs[2].set_data_from_numpy(np.array([json.dumps(FIELDS).encode()], dtype=object))
    client = grpcclient.InferenceServerClient(server.grpc.address)
    client.start_stream(on_response)
    got: dict[int, list[dict]] = {}
    try:
        client.async_stream_infer(NAME, inputs)
        while True:
            piece, final, error = items.get(timeout=60)
            assert error is None, error
            got.setdefault(piece["index"], []).append(piece)
            if final:
                break
    finally:
        client.stop_stream()
        client.close()
    _same_as_http(got, _http_choices(server, "once upon", FIELDS))
    assert all(len(pieces) > 1 for pieces in got.values()) == stream


def test_kserve_generate_and_generate_stream_take_the_completions_fields(server: BackgroundServer) -> None:
    want = _http_choices(server, "once upon", FIELDS)
    url = server.url + f"/v2/models/{NAME}"
    whole = httpx.post(url + "/generate", json={"text_input": "once upon", "parameters": FIELDS}, timeout=60).json()
    assert whole["model_name"] == NAME and whole["model_version"] == "1"
    got = {
        i: [{"text_output": t, "finish_reason": f, "logprobs": lp}]
        for i, (t, f, lp) in enumerate(
            zip(whole["text_output"], whole["finish_reason"], whole["logprobs"], strict=True)
        )
    }
    _same_as_http(got, want)
    events: dict[int, list[dict]] = {}
    with httpx.stream("POST", url + "/generate_stream", json={"text_input": "once upon", "parameters": FIELDS}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                event = json.loads(line[6:])
                events.setdefault(event["index"], []).append(event)
    _same_as_http(events, want)
    one = {"max_tokens": 4, "temperature": 0}
    single = httpx.post(url + "/generate", json={"text_input": "once upon", "parameters": one}, timeout=60).json()
    assert single["text_output"] == _http_choices(server, "once upon", one)[0]["text"]
    assert "index" not in single and "logprobs" not in single


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"text_input": "x", "parameters": {"guided_json": {"type": "strnig"}}}, 400, "guided_json cannot be compiled"),
        ({"text_input": "x", "parameters": {"grammar": "x"}}, 400, "Unrecognized request argument supplied: grammar"),
        ({"text_input": "x", "parameters": {"stream": True}}, 400, "'stream' is not a sampling parameter here"),
        ({"text_input": 5}, 400, "'text_input' must be a string"),
        ({"text_input": "x", "inputs": []}, 400, "takes 'text_input' and 'parameters'"),
        ({"text_input": "x", "parameters": {"max_tokens": 500}}, 400, "context"),
    ],
)
def test_kserve_generate_refusals_name_the_field(
    server: BackgroundServer, body: dict, status: int, message: str
) -> None:
    for route in ("generate", "generate_stream"):
        r = httpx.post(server.url + f"/v2/models/{NAME}/{route}", json=body, timeout=60)
        assert r.status_code == status and message in r.json()["error"], r.text
