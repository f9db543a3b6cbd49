"""`ortbatch serve GENERATION_EXPORT --frontends 2` as users run it (a subprocess): concurrent
clients on both front ends each get exactly the completion the generator gives their prompt
alone, whole or streamed (HTTP) and over gRPC ``ModelStreamInfer``; a full queue is a 429
JSON error even for a stream; bad requests are 400s naming the field; SIGTERM drains."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ortbatch import BatchedGenerator

from .conftest import TinyModel, random_prompts

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

REPO = Path(__file__).resolve().parents[2]
NAME = "tiny-gpt2"
PROMPTS = random_prompts([3, 8, 5, 12, 2, 9])
LENGTHS = [9, 4, 12, 7, 10, 3]


class Server:
    """``ortbatch serve EXPORT --frontends 2 --grpc-port 0`` in a subprocess."""

    def __init__(self, export: Path, log: Path, *extra: str) -> None:
        self.log = log
        self._fh = open(log, "wb")  # noqa: SIM115 - closed in stop()
        cmd = [sys.executable, "-m", "ortbatch.cli", "serve", str(export), "--name", NAME, "--frontends", "2"]
        cmd += ["--grpc-port", "0", "--port", "0", "--log-level", "warning", "--no-access-log", "--allow-unvalidated"]
        self.proc = subprocess.Popen(
            [*cmd, *extra], stdout=self._fh, stderr=subprocess.STDOUT, cwd=REPO, env=dict(os.environ)
        )
        deadline = time.monotonic() + 90
        while not (m := re.search(r"gRPC on (\S+)\); listening on (http://\S+)", self.text())):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server did not start:\n{self.text()}")
            time.sleep(0.05)
        self.grpc, self.url = m.group(1), m.group(2)
        pids = re.search(r"front-end processes \(pids ([\d, ]+)\)", self.text())
        assert pids, self.text()
        self.pids = {int(p) for p in pids.group(1).split(", ")}

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._fh.close()
        return self.proc.returncode


@pytest.fixture(scope="module")
def expected(tiny_gpt2: TinyModel) -> dict[tuple[int, ...], tuple[str, int, str]]:
    """What the generator itself answers for each prompt alone (greedy)."""
    with BatchedGenerator(tiny_gpt2.export, max_batch_size=1) as gen:
        return {
            tuple(p): (c.text, c.completion_tokens, c.finish_reason)
            for p, n in zip(PROMPTS, LENGTHS, strict=True)
            for c in [gen.generate(p, n)]
        }


@pytest.fixture(scope="module")
def server(tiny_gpt2: TinyModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # 2 rows and 8 waiting: the 6 clients below always fit (a finished row's place is
    # taken at the next step, so a queue of 4 could still be full for a moment); 32 at once
    # do not
    log = tmp_path_factory.mktemp("serve-gen-fe") / "serve.log"
    srv = Server(tiny_gpt2.export, log, "--max-batch-size", "2", "--max-queue", "8")
    yield srv
    srv.stop()


def _front_end(c: Any) -> int:
    m = re.search(r'ortbatch_frontend\{index="\d+",pid="(\d+)"\} 1', c.get("/metrics").text)
    assert m
    return int(m.group(1))


def _stream_text(c: Any, body: dict[str, Any]) -> tuple[str, str | None]:
    text, reason = "", None
    with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                text += choice["text"]
                reason = choice["finish_reason"] or reason
    return text, reason


def test_concurrent_clients_on_both_front_ends_get_their_own_completions(server: Server, expected: dict) -> None:
    problems: list[str] = []
    seen_pids: set[int] = set()

    def client(i: int) -> None:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            seen_pids.add(_front_end(c))
            for round_ in range(4):
                prompt = PROMPTS[(i + round_) % len(PROMPTS)]
                n = LENGTHS[PROMPTS.index(prompt)]
                body = {"model": NAME, "prompt": prompt, "max_tokens": n, "temperature": 0}
                want_text, want_tokens, want_reason = expected[tuple(prompt)]
                if round_ % 2:
                    got = _stream_text(c, body)
                    if got != (want_text, want_reason):
                        problems.append(f"stream {prompt}: {got} != {(want_text, want_reason)}")
                    continue
                r = c.post("/v1/completions", json=body)
                doc = r.json()
                if r.status_code != 200:
                    problems.append(f"{prompt}: {r.status_code} {doc}")
                    continue
                got_whole = (
                    doc["choices"][0]["text"],
                    doc["usage"]["completion_tokens"],
                    doc["choices"][0]["finish_reason"],
                )
                if got_whole != (want_text, want_tokens, want_reason):
                    problems.append(f"{prompt}: {got_whole} != {expected[tuple(prompt)]}")

    for _ in range(20):  # until connections have reached both front ends
        threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not problems, problems[:5]
        if seen_pids == server.pids:
            break
    assert seen_pids == server.pids


def test_a_full_queue_is_a_429_before_a_stream_starts(server: Server) -> None:
    statuses: list[tuple[int, str]] = []
    body = {"model": NAME, "prompt": [5, 6, 7], "max_tokens": 80, "temperature": 0, "stream": True}

    def one() -> None:
        with httpx.Client(base_url=server.url, timeout=60) as c, c.stream("POST", "/v1/completions", json=body) as r:
            data = r.read().decode()
            statuses.append((r.status_code, r.headers["content-type"]))
            if r.status_code == 200:
                assert data.endswith("data: [DONE]\n\n") and '"error"' not in data, data[-300:]
            else:
                assert json.loads(data)["error"]["code"] == 429, data

    # 32 at once against 2 rows and 8 places: some are refused (how many depends on how
    # many finish while the others arrive); every refusal is a JSON 429, every stream whole
    threads = [threading.Thread(target=one) for _ in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(statuses) == 32
    assert {s for s, _ in statuses} == {200, 429}, statuses
    assert all(ct.startswith("application/json") for s, ct in statuses if s == 429)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"prompt": "", "max_tokens": 3}, "prompt"),
        ({"prompt": [1, 10**6], "max_tokens": 3}, "prompt"),
        ({"prompt": [1], "max_tokens": 3, "temperature": -1}, "temperature"),
    ],
    ids=["empty", "vocab", "temperature"],
)
def test_bad_requests_are_400s_naming_the_field(server: Server, body: dict, field: str) -> None:
    for stream in (False, True):
        r = httpx.post(server.url + "/v1/completions", json={**body, "stream": stream}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_grpc_stream_through_a_front_end_equals_http(server: Server, tiny_gpt2: TinyModel) -> None:
    grpcclient = pytest.importorskip("tritonclient.grpc")
    import queue

    items: queue.Queue[tuple[str, bool, str | None]] = queue.Queue()

    def on_response(result: Any, error: Any) -> None:
        if error is not None:
            items.put(("", True, str(error)))
            return
        final = result.get_response().parameters["triton_final_response"].bool_param
        items.put((result.as_numpy("text_output")[0].decode(), final, None))

    values = {
        "text_input": (np.array([b"once upon"], dtype=object), "BYTES"),
        "stream": (np.array([True]), "BOOL"),
        "sampling_parameters": (np.array([b'{"max_tokens": 9, "temperature": 0}'], dtype=object), "BYTES"),
    }
    inputs = []
    for name, (array, datatype) in values.items():
        t = grpcclient.InferInput(name, [1], datatype)
        t.set_data_from_numpy(array)
        inputs.append(t)
    client = grpcclient.InferenceServerClient(server.grpc)
    client.start_stream(on_response)
    pieces: list[str] = []
    try:
        client.async_stream_infer(NAME, inputs)
        while True:
            text, final, error = items.get(timeout=60)
            assert error is None, error
            pieces.append(text)
            if final:
                break
    finally:
        client.stop_stream()
        client.close()
    body = {"model": NAME, "prompt": "once upon", "max_tokens": 9, "temperature": 0}
    want = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    assert "".join(pieces) == want and len(pieces) > 1


def _choices(c: Any, body: dict[str, Any], stream: bool) -> dict[int, dict[str, Any]]:
    """Each choice's text, token ids and token logprobs, whole or gathered from the stream."""
    out: dict[int, dict[str, Any]] = {}

    def add(choice: dict[str, Any]) -> None:
        got = out.setdefault(choice["index"], {"text": "", "token_ids": [], "logprobs": []})
        got["text"] += choice["text"]
        got["token_ids"] += choice.get("token_ids") or []
        got["logprobs"] += (choice["logprobs"] or {}).get("token_logprobs", [])

    if not stream:
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        for choice in r.json()["choices"]:
            add(choice)
        return out
    with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    add(choice)
    return out


def test_logprobs_and_n_through_both_front_ends(server: Server, tiny_gpt2: TinyModel) -> None:
    """n choices (more than the engine's 2 rows), each with its logprobs, and echo's prompt
    logprobs, cross the front ends whole and streamed as the generator gives them in process."""
    from ortbatch.generation import SamplingParams

    prompt = PROMPTS[1]
    body = {"model": NAME, "prompt": prompt, "max_tokens": 6, "temperature": 1.0, "seed": 9, "n": 3}
    body |= {"logprobs": 2, "return_token_ids": True}
    echo = {"model": NAME, "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1}
    with BatchedGenerator(tiny_gpt2.export, max_batch_size=2) as gen:
        params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=9, n=3, logprobs=2)
        want = gen.generate_choices(prompt, params=params)
        scored = gen.generate(prompt, params=SamplingParams(max_new_tokens=0, prompt_logprobs=1))
    seen: set[int] = set()
    for _ in range(20):  # new connections until both front ends have answered
        with httpx.Client(base_url=server.url, timeout=60) as c:
            seen.add(_front_end(c))
            for stream in (False, True):
                got = _choices(c, body, stream)
                assert sorted(got) == [0, 1, 2]
                for i, w in enumerate(want):
                    assert (got[i]["text"], got[i]["token_ids"]) == (w.text, list(w.token_ids)), (stream, i)
                    np.testing.assert_allclose(got[i]["logprobs"], [x.logprob for x in w.logprobs], atol=1e-4)
            (only,) = _choices(c, echo, False).values()
            assert only["logprobs"][0] is None
            np.testing.assert_allclose(only["logprobs"][1:], [x.logprob for x in scored.prompt_logprobs[1:]], atol=1e-4)
        if seen == server.pids:
            break
    assert seen == server.pids


def test_sigterm_drains_and_exits_0(tiny_gpt2: TinyModel, tmp_path: Path) -> None:
    srv = Server(tiny_gpt2.export, tmp_path / "serve.log")
    answers: list[int] = []

    def one() -> None:
        body = {"model": NAME, "prompt": [5, 6], "max_tokens": 80, "temperature": 0}
        answers.append(httpx.post(srv.url + "/v1/completions", json=body, timeout=60).status_code)

    threads = [threading.Thread(target=one) for _ in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while True:  # every request has reached the engine's generator, then SIGTERM
        metrics = httpx.get(srv.url + "/metrics", timeout=30).text
        m = re.search(r'^ortbatch_generation_requests_total\{outcome="submitted"\} ([0-9.]+)', metrics, re.M)
        if m and float(m.group(1)) >= 4:
            break
        assert time.monotonic() < deadline, metrics
        time.sleep(0.01)
    code = srv.stop()
    for t in threads:
        t.join(60)
    assert code == 0, srv.text()
    assert answers == [200] * 4
    m = re.search(r"requests accepted=(\d+) answered=(\d+)", srv.text())
    assert m and m.group(1) == m.group(2), srv.text()


def test_a_repository_with_a_generation_export_over_front_ends(
    tiny_gpt2: TinyModel, expected: dict, tmp_path: Path
) -> None:
    """The generator is one model of a repository served by two front ends: body-routed
    completions reach it, whole and streamed, and a reload swaps it with nothing refused."""
    log = tmp_path / "serve.log"
    fh = open(log, "wb")  # noqa: SIM115 - closed below
    # NAME=DIR: a repository of one model (the tiny export has no ortbatch.json for --repository)
    model = f"{NAME}={tiny_gpt2.export}"
    cmd = [sys.executable, "-m", "ortbatch.cli", "serve", model, "--frontends", "2", "--port", "0"]
    proc = subprocess.Popen([*cmd, "--log-level", "warning"], stdout=fh, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        deadline = time.monotonic() + 90
        while not (m := re.search(r"listening on (http://\S+)", log.read_text(errors="replace"))):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")
            time.sleep(0.05)
        url = m.group(1)
        prompt, n = PROMPTS[0], LENGTHS[0]
        body = {"model": NAME, "prompt": prompt, "max_tokens": n, "temperature": 0}
        want_text, _, want_reason = expected[tuple(prompt)]
        with httpx.Client(base_url=url, timeout=60) as c:
            index = c.post("/v2/repository/index").json()
            assert [(e["name"], e["state"]) for e in index] == [(NAME, "READY")]
            assert c.post("/v1/completions", json=body).json()["choices"][0]["text"] == want_text
            assert _stream_text(c, body) == (want_text, want_reason)
            assert c.post(f"/v2/repository/models/{NAME}/load").status_code == 200  # a reload
            assert c.post("/v1/completions", json=body).json()["choices"][0]["text"] == want_text
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
        fh.close()
    assert code == 0, log.read_text(errors="replace")
