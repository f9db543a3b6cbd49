"""The per-request helpers of the HTTP path (ortbatch.serve.http): a client that leaves
cancels its work, a cancelled request cancels its work, a body has one deadline."""

from __future__ import annotations

import asyncio

import pytest

from ortbatch.serve.http import ClientGone, HTTPError, read_request_body, run_or_abandon


def _receive(gone: asyncio.Event):
    async def receive():
        await gone.wait()
        return {"type": "http.disconnect"}

    return receive


async def _work(started: asyncio.Event, state: dict, seconds: float = 30.0, value: str = "done"):
    started.set()
    try:
        await asyncio.sleep(seconds)
    except asyncio.CancelledError:
        state["cancelled"] = True
        raise
    return value


def test_an_answer_comes_back_and_the_watcher_goes():
    async def main():
        gone = asyncio.Event()
        before = len(asyncio.all_tasks())
        result = await run_or_abandon(_receive(gone), _work(asyncio.Event(), {}, 0.0, "answer"))
        await asyncio.sleep(0)
        return result, len(asyncio.all_tasks()) - before

    assert asyncio.run(main()) == ("answer", 0)


def test_a_client_that_leaves_cancels_its_work():
    async def main():
        gone, started, state = asyncio.Event(), asyncio.Event(), {}
        task = asyncio.ensure_future(run_or_abandon(_receive(gone), _work(started, state)))
        await started.wait()
        gone.set()
        with pytest.raises(ClientGone):
            await task
        return state

    assert asyncio.run(main()) == {"cancelled": True}


def test_a_failing_receive_counts_as_a_client_gone():
    async def receive():
        raise OSError("connection reset")

    async def main():
        started, state = asyncio.Event(), {}
        with pytest.raises(ClientGone):
            await run_or_abandon(receive, _work(started, state))
        return state

    assert asyncio.run(main()) == {"cancelled": True}


def test_a_cancelled_request_cancels_its_work_and_stays_cancelled():
    async def main():
        gone, started, state = asyncio.Event(), asyncio.Event(), {}
        task = asyncio.ensure_future(run_or_abandon(_receive(gone), _work(started, state)))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0)
        return state, task.cancelled()

    assert asyncio.run(main()) == ({"cancelled": True}, True)


def test_an_error_of_the_work_is_raised_as_is():
    async def fail():
        raise ValueError("boom")

    async def main():
        await run_or_abandon(_receive(asyncio.Event()), fail())

    with pytest.raises(ValueError, match="boom"):
        asyncio.run(main())


class _Request:
    """What read_request_body uses of a Starlette request: headers and stream()."""

    def __init__(self, chunks: list[bytes], pause_s: float = 0.0) -> None:
        self.headers: dict[str, str] = {}
        self._chunks, self._pause = chunks, pause_s

    async def stream(self):
        for c in self._chunks:
            await asyncio.sleep(self._pause)
            yield c


def test_a_body_arrives_whole_within_its_deadline():
    body = asyncio.run(read_request_body(_Request([b"ab", b"cd", b""]), 100, 5.0))
    assert body == b"abcd"


def test_the_deadline_is_for_the_whole_body_not_each_chunk():
    # every chunk comes within the timeout, the whole body does not: 408
    with pytest.raises(HTTPError) as info:
        asyncio.run(read_request_body(_Request([b"a"] * 6, pause_s=0.05), 100, 0.2))
    assert info.value.status == 408 and "within 0.2 s" in str(info.value)


def test_a_body_over_the_limit_is_413():
    with pytest.raises(HTTPError) as info:
        asyncio.run(read_request_body(_Request([b"a" * 60, b"a" * 60]), 100, None))
    assert info.value.status == 413
