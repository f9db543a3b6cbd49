"""A generation request from a front end (:class:`ProxyGenerator`) to the engine's generator
over a real link (a FrontEndLink and a ProxySession on a socketpair, in this process): tokens
in order then the Completion, bad prompts refused in the front end with the generator's own
messages, a full queue failing the admission, and a cancel freeing the row in the engine."""

from __future__ import annotations

import socket
import threading
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from ortbatch.errors import InvalidInputError, QueueFullError, SessionClosedError
from ortbatch.generation.requests import Completion, StreamToken
from ortbatch.serve.frontends.engine import FrontEndLink
from ortbatch.serve.frontends.generation import GeneratorInfo, ProxyGenerator
from ortbatch.serve.frontends.proxy import ProxySession
from ortbatch.serve.frontends.transport import Arena

pytestmark = pytest.mark.timeout(60)

INFO = GeneratorInfo(
    layout=SimpleNamespace(vocab_size=50, max_context_length=16, tokenizer=None, eos_token_ids=(0,)),
    max_batch_size=4,
    max_tokens_in_flight=64,
    max_queue=8,
    timeout_s=None,
    default_max_new_tokens=5,
)


class _Generator:
    """The engine's generator: token i is ``"ab"[i % 2]``; ``hold`` stops after the first
    token until the request is cancelled; ``full`` refuses every request."""

    def __init__(self) -> None:
        self.submitted: list[tuple[Any, ...]] = []
        self.hold = self.full = False
        self.cancelled = threading.Event()

    def submit(self, prompt: list[int], *, params: Any, timeout_s: Any, on_token: Any) -> Future[Completion]:
        if self.full:
            raise QueueFullError(8, 8)
        self.submitted.append((prompt, params, timeout_s))
        fut: Future[Completion] = Future()
        threading.Thread(target=self._run, args=(fut, prompt, params.max_new_tokens, on_token), daemon=True).start()
        return fut

    def _run(self, fut: Future[Completion], prompt: list[int], n: int, on_token: Any) -> None:
        for i in range(n):
            if on_token is not None:
                on_token(StreamToken(i, "ab"[i % 2], i))
            if self.hold:
                while not fut.cancelled():
                    threading.Event().wait(0.01)
                self.cancelled.set()
                return
        text = "".join("ab"[i % 2] for i in range(n))
        fut.set_result(Completion(text, tuple(range(n)), "length", len(prompt), n))

    def stats(self) -> Any:
        return SimpleNamespace(queued=0, submitted=len(self.submitted))


@pytest.fixture
def pair(tmp_path: Path) -> Any:
    engine_gen = _Generator()
    ours, theirs = socket.socketpair()
    req, resp = Arena.create(1 << 20), Arena.create(1 << 20)
    link = FrontEndLink(engine_gen, ours, Arena(req.handle), Arena(resp.handle))
    proxy = ProxySession(theirs, None, req, resp)
    gen = ProxyGenerator(proxy, INFO, 0, tmp_path)
    yield engine_gen, link, proxy, gen
    proxy.shutdown()


def test_tokens_come_in_order_then_the_completion(pair):
    engine_gen, _link, _proxy, gen = pair
    tokens: list[StreamToken] = []
    fut = gen.submit([1, 2, 3], 4, temperature=0.0, on_token=tokens.append)
    completion = fut.result(10)
    assert fut.admitted.done() and fut.admitted.exception() is None
    assert completion == Completion("abab", (0, 1, 2, 3), "length", 3, 4)
    assert [t.text for t in tokens] == ["a", "b", "a", "b"] and [t.index for t in tokens] == [0, 1, 2, 3]
    ((prompt, params, _timeout),) = engine_gen.submitted
    assert prompt == [1, 2, 3] and params.max_new_tokens == 4 and params.greedy
    # not streamed: no token crosses; the default length is the engine's
    assert gen.submit([7]).result(10).completion_tokens == INFO.default_max_new_tokens
    assert gen.stats().submitted == 2  # the engine's stats, asked over the link


@pytest.mark.parametrize(
    ("prompt", "kwargs", "message"),
    [
        ([], {}, "prompt has no tokens"),
        ([1, 99], {}, "vocabulary"),
        ([1] * 10, {"max_new_tokens": 10}, "exceeds the model's context of 16 tokens"),
        ([1], {"temperature": -1.0}, "temperature"),
        ("some text", {}, "no tokenizer.json"),
    ],
    ids=["empty", "vocab", "context", "temperature", "no-tokenizer"],
)
def test_bad_prompts_are_refused_in_the_front_end_with_the_generators_message(pair, prompt, kwargs, message):
    engine_gen, _link, _proxy, gen = pair
    with pytest.raises(InvalidInputError, match=message):
        gen.submit(prompt, **kwargs)
    assert not engine_gen.submitted  # never sent


def test_a_full_queue_in_the_engine_fails_the_admission_and_the_future(pair):
    engine_gen, _link, _proxy, gen = pair
    engine_gen.full = True
    fut = gen.submit([1, 2], 3, on_token=lambda t: None)
    with pytest.raises(QueueFullError) as info:
        fut.admitted.result(10)
    assert (info.value.queued, info.value.max_queue) == (8, 8)
    with pytest.raises(QueueFullError):
        fut.result(10)


def test_cancelling_frees_the_row_in_the_engine(pair):
    engine_gen, link, proxy, gen = pair
    engine_gen.hold = True
    first = threading.Event()
    fut = gen.submit([1, 2], 8, on_token=lambda t: first.set())
    assert first.wait(10) and fut.admitted.result(10) is None
    assert fut.cancel()
    assert engine_gen.cancelled.wait(10)  # the engine's request was cancelled: its row is free
    deadline = threading.Event()
    for _ in range(500):
        if not link.inflight and proxy.in_flight == 0:
            break
        deadline.wait(0.01)
    assert not link.inflight and proxy.in_flight == 0


def test_a_closed_generator_refuses_at_once(pair):
    _engine_gen, _link, _proxy, gen = pair
    gen.close()
    assert gen.closed
    with pytest.raises(SessionClosedError):
        gen.submit([1])
