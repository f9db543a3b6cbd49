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
