"""`ortbatch serve` on a generation export: OpenAI /v1/completions over real HTTP, driven by
the official ``openai`` client (and httpx for the raw protocol): each concurrent caller gets
exactly its own completion, streamed or whole; bad requests get 400s that name the field;
a client that leaves mid-stream frees its row."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ortbatch import BatchedGenerator
from ortbatch._ort import build_session

from .conftest import TinyModel, assert_openai_answer, random_prompts

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from ortbatch.serve import BackgroundServer, ServedGenerator, is_generation_export  # noqa: E402

NAME = "tiny-gpt2"


@pytest.fixture(scope="module")
def server(tiny_gpt2: TinyModel) -> Iterator[BackgroundServer]:
    served = ServedGenerator(BatchedGenerator(tiny_gpt2.export, max_batch_size=4, max_queue=64), NAME)
    with BackgroundServer(served) as srv:
        yield srv
    assert served.closed  # the app closed the generator on shutdown


@pytest.fixture(scope="module")
def expected(tiny_gpt2: TinyModel) -> dict[tuple[int, ...], tuple[str, int, str, int]]:
    """What the generator itself answers for each test prompt: text, tokens, finish reason."""
    out = {}
    with BatchedGenerator(tiny_gpt2.export, max_batch_size=1) as gen:
        for prompt, n in zip(random_prompts([3, 8, 5, 12, 2, 9, 6, 4]), [9, 4, 12, 7, 10, 3, 8, 11], strict=True):
            c = gen.generate(prompt, n)
            out[tuple(prompt)] = (c.text, c.completion_tokens, c.finish_reason, n)
    return out


def client(server: BackgroundServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_generation_export_is_detected(tiny_gpt2: TinyModel, fake_dir: Path, tmp_path: Path) -> None:
    assert is_generation_export(tiny_gpt2.export)
    assert is_generation_export(fake_dir)
    assert not is_generation_export(tmp_path)


def test_concurrent_clients_each_get_their_own_completion(server: BackgroundServer, expected: dict) -> None:
    api = client(server)

    def ask(prompt: tuple[int, ...]) -> object:
        return api.completions.create(model=NAME, prompt=list(prompt), max_tokens=expected[prompt][3], temperature=0)

    with ThreadPoolExecutor(8) as pool:
        answers = dict(zip(expected, pool.map(ask, list(expected)), strict=True))
    for prompt, answer in answers.items():
        text, tokens, reason, _ = expected[prompt]
        choice = answer.choices[0]
        assert (choice.text, choice.finish_reason) == (text, reason), prompt
        assert answer.usage.prompt_tokens == len(prompt) and answer.usage.completion_tokens == tokens
        assert answer.model == NAME and answer.object == "text_completion"


def test_several_prompts_in_one_request(server: BackgroundServer, expected: dict) -> None:
    prompts = list(expected)[:3]
    answer = client(server).completions.create(
        model=NAME, prompt=[list(p) for p in prompts], max_tokens=4, temperature=0
    )
    assert [c.index for c in answer.choices] == [0, 1, 2]
    for prompt, choice in zip(prompts, answer.choices, strict=True):
        assert expected[prompt][0].startswith(choice.text)  # the same greedy run, cut at 4 tokens


def test_stream_carries_the_same_text(server: BackgroundServer, expected: dict) -> None:
    api = client(server)
    for prompt, (text, tokens, reason, n) in list(expected.items())[:4]:
        chunks = list(
            api.completions.create(
                model=NAME,
                prompt=list(prompt),
                max_tokens=n,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        with_choices = [c for c in chunks if c.choices]
        assert "".join(c.choices[0].text for c in with_choices) == text
        assert [c.choices[0].finish_reason for c in with_choices][-1] == reason
        assert all(c.choices[0].finish_reason is None for c in with_choices[:-1])
        assert chunks[-1].usage.completion_tokens == tokens and chunks[-1].usage.prompt_tokens == len(prompt)


def test_top_k_off_spellings(server: BackgroundServer) -> None:
    """top_k -1 (vLLM's spelling) and 0 both mean no top-k: the same seeded sample."""
    body = {"prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0.9, "seed": 3}
    texts = {
        httpx.post(server.url + "/v1/completions", json={**body, **extra}, timeout=30).json()["choices"][0]["text"]
        for extra in ({}, {"top_k": 0}, {"top_k": -1})
    }
    assert len(texts) == 1


def test_sampling_is_reproducible_with_a_seed(server: BackgroundServer) -> None:
    api = client(server)
    texts = {
        api.completions.create(model=NAME, prompt=[5, 6, 7], max_tokens=8, temperature=0.9, top_p=0.9, seed=11)
        .choices[0]
        .text
        for _ in range(3)
    }
    assert len(texts) == 1


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"prompt": [5, 6], "n": 0}, 400, "'n' must be in [1, 128]"),
        ({"prompt": [5, 6], "logprobs": 21}, 400, "'logprobs' must be in [0, 20]"),
        ({"prompt": [5, 6], "suffix": "x"}, 400, "'suffix' is not supported: insertion"),
        ({"prompt": [5, 6], "frobnicate": 1}, 400, "Unrecognized request argument supplied: frobnicate"),
        ({"prompt": [], "max_tokens": 3}, 400, "'prompt' must be"),
        ({"prompt": [5, 6], "max_tokens": 0}, 400, "'max_tokens' must be >= 1"),
        ({"prompt": [5, 6], "temperature": "hot"}, 400, "'temperature' must be a number"),
        ({"prompt": [5, 6], "top_k": -2}, 400, "'top_k' must be >= 0 (or -1 for off)"),
        ({"prompt": [5, 99999]}, 400, "vocabulary"),
        ({"prompt": [5] * 90, "max_tokens": 50}, 400, "context"),
        ({"prompt": [5, 6], "model": "other"}, 404, "unknown model 'other'"),
    ],
)
def test_bad_requests_name_what_is_wrong(server: BackgroundServer, body: dict, status: int, message: str) -> None:
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == status, r.text
    assert message in r.json()["error"]["message"]


def test_bad_request_through_the_openai_client(server: BackgroundServer) -> None:
    with pytest.raises(openai.BadRequestError, match="'best_of' \\(1\\) must be >= 'n' \\(2\\)"):
        client(server).completions.create(model=NAME, prompt="hello", max_tokens=3, n=2, best_of=1)


class _SlowDecodes:
    """The real session, each run made slower (``session_factory=``): an 80-token stream
    then lasts seconds, so the client's disconnect always lands mid-generation, however
    fast or loaded the machine is (a race the plain tiny model lost under load)."""

    def __init__(self, real: object, delay_s: float) -> None:
        self._real, self.delay_s = real, delay_s

    def __getattr__(self, name: str) -> object:
        return getattr(self._real, name)

    def run(self, names: list[str], feed: dict) -> list:
        time.sleep(self.delay_s)
        return self._real.run(names, feed)


def test_client_leaving_a_stream_frees_its_row(tiny_gpt2: TinyModel) -> None:
    def slow(*args: object, **kwargs: object) -> _SlowDecodes:
        return _SlowDecodes(build_session(*args, **kwargs), delay_s=0.05)

    served = ServedGenerator(BatchedGenerator(tiny_gpt2.export, max_batch_size=4, session_factory=slow), NAME)
    with BackgroundServer(served) as srv:
        gen = served.generator
        body = {"prompt": [5, 6, 7], "max_tokens": 80, "temperature": 0, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=30) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            s = gen.stats()
            if s.cancelled > 0 and s.active_rows == 0 and s.queued == 0:
                break
            time.sleep(0.05)
        s = gen.stats()
        assert s.cancelled == 1 and s.active_rows == 0 and s.completed == 0
        # the freed row serves the next request
        after = httpx.post(srv.url + "/v1/completions", json={"prompt": [5], "max_tokens": 2}, timeout=30)
        assert after.status_code == 200


def test_models_health_and_metrics(server: BackgroundServer) -> None:
    assert [m.id for m in client(server).models.list().data] == [NAME]
    assert httpx.get(server.url + "/v2/health/ready").json() == {"ready": True}
    text = httpx.get(server.url + "/metrics").text
    assert (
        "ortbatch_generation_generated_tokens" in text
        and 'ortbatch_generation_requests_total{outcome="completed"}' in text
    )
    assert httpx.post(server.url + "/v2/models/x/infer", json={}).status_code == 404


def test_requests_during_shutdown_are_answered(tiny_gpt2: TinyModel) -> None:
    """Shutting the server down drains: a request in flight still gets its whole answer."""
    served = ServedGenerator(BatchedGenerator(tiny_gpt2.export, max_batch_size=2), NAME)
    srv = BackgroundServer(served).start()
    result: dict = {}

    def ask() -> None:
        result["r"] = httpx.post(srv.url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 30}, timeout=60)

    t = threading.Thread(target=ask)
    t.start()
    # Stop only once the request is in (a fixed sleep raced the client's connect on a busy machine).
    deadline = time.monotonic() + 30
    while srv.counts.accepted < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert srv.counts.accepted == 1, "the request never reached the server"
    srv.stop()
    t.join(60)
    assert result["r"].status_code == 200 and result["r"].json()["usage"]["completion_tokens"] >= 1
    assert srv.counts.accepted == srv.counts.answered


def test_stop_string_stream_equals_the_whole_answer(server: BackgroundServer, expected: dict) -> None:
    """A stop string makes the generator hold text back while it may still match; the
    stream must still add up to the whole (cut) answer, finishing with 'stop'."""
    api = client(server)
    prompt, (text, _, _, n) = next((p, e) for p, e in expected.items() if len(e[0]) >= 6)
    stop = text[3:5]  # occurs in the greedy text, so the answer is cut before it
    whole = api.completions.create(model=NAME, prompt=list(prompt), max_tokens=n, temperature=0, stop=[stop])
    chunks = list(
        api.completions.create(model=NAME, prompt=list(prompt), max_tokens=n, temperature=0, stop=stop, stream=True)
    )
    assert whole.choices[0].finish_reason == "stop" and stop not in whole.choices[0].text
    assert text.startswith(whole.choices[0].text)
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "stop"


hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=6)
_prompts = (
    st.text(max_size=12)
    | st.lists(st.integers(-5, 400), max_size=6)
    | st.lists(st.text(max_size=5), max_size=3)
    | st.lists(st.lists(st.integers(-5, 400), max_size=4), max_size=3)
    | _scalars
)
_bodies = st.fixed_dictionaries(
    {"prompt": _prompts},
    optional={
        "max_tokens": st.integers(-3, 12) | _scalars,
        "temperature": st.floats(-1, 3) | _scalars,
        "top_p": st.floats(-0.5, 1.5) | _scalars,
        "top_k": st.integers(-3, 500) | _scalars,
        "seed": st.integers(-(2**65), 2**65) | _scalars,
        "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=3) | _scalars,
        "stream": st.booleans() | _scalars,
        "stream_options": st.fixed_dictionaries({"include_usage": _scalars}) | _scalars,
        "n": st.integers(-1, 3) | _scalars,
        "model": st.just(NAME) | st.text(max_size=4),
        "echo": _scalars,
        "logprobs": _scalars,
    },
)


@settings(max_examples=80, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=_bodies)
def test_fuzzed_requests_never_fail_the_server(server: BackgroundServer, body: dict) -> None:
    """Whatever the body: a 200 (JSON or a well-formed event stream) or a < 500 JSON error
    in OpenAI's shape; never a 500, never a hang."""
    # json.dumps writes NaN/Infinity as Python's json.loads (the server's) reads them
    r = httpx.post(server.url + "/v1/completions", content=json.dumps(body), timeout=30)
    assert_openai_answer(r, "text_completion")


@pytest.mark.timeout(120)
def test_many_clients_leaving_at_once_leave_the_other_streams_whole(tiny_gpt2: TinyModel, expected: dict) -> None:
    """Six clients close their streams after the first chunk (an 80-token stream, each step
    slowed, so the close lands mid-generation) while six others stream to the end: each
    leaver's request is cancelled (its row freed), and every stream that stayed carries
    exactly the text the generator gives its prompt alone."""

    def slow(*args: object, **kwargs: object) -> _SlowDecodes:
        return _SlowDecodes(build_session(*args, **kwargs), delay_s=0.05)

    served = ServedGenerator(BatchedGenerator(tiny_gpt2.export, max_batch_size=4, session_factory=slow), NAME)
    stayers = list(expected)[:6]
    with BackgroundServer(served) as srv:
        api = client(srv)

        def leave(i: int) -> None:
            body = {"prompt": [5, 6, i], "max_tokens": 80, "temperature": 0, "stream": True, "ignore_eos": True}
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=30) as r:
                assert next(line for line in r.iter_lines() if line.startswith("data: "))

        def stay(prompt: tuple[int, ...]) -> tuple[str, str | None]:
            chunks = api.completions.create(
                model=NAME, prompt=list(prompt), max_tokens=expected[prompt][3], temperature=0, stream=True
            )
            text, reason = "", None
            for chunk in chunks:
                text += chunk.choices[0].text
                reason = chunk.choices[0].finish_reason or reason
            return text, reason

        with ThreadPoolExecutor(12) as pool:
            leavers = [pool.submit(leave, i) for i in range(6)]
            answers = list(pool.map(stay, stayers))
            for f in leavers:
                f.result()
        for prompt, (text, reason) in zip(stayers, answers, strict=True):
            assert (text, reason) == (expected[prompt][0], expected[prompt][2]), prompt
        deadline = time.monotonic() + 30  # a bound on a hang, not a threshold: normally at once
        while (s := served.generator.stats()).cancelled < 6 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert s.cancelled == 6 and s.completed == 6 and s.failed == 0
