"""The per-request helpers of the HTTP path (ortbatch.serve.http.plumbing): a client that leaves
cancels its work, a cancelled request cancels its work, a body has one deadline and one
size limit, and a client that leaves mid-body is gone."""

from __future__ import annotations

import asyncio

import pytest

from ortbatch.serve.http.plumbing import ClientGone, HTTPError, receive_body, run_or_abandon


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


def _body(chunks: list[bytes], pause_s: float = 0.0, then_gone: bool = False, headers=()):
    """An ASGI scope and receive sending ``chunks`` as the request body (the last with
    more_body false, unless ``then_gone``: then the client disconnects instead)."""
    messages = [{"type": "http.request", "body": c, "more_body": True} for c in chunks]
    if then_gone:
        messages.append({"type": "http.disconnect"})
    else:
        messages[-1]["more_body"] = False

    async def receive():
        await asyncio.sleep(pause_s)
        return messages.pop(0)

    return {"type": "http", "headers": list(headers)}, receive


def test_a_body_arrives_whole_within_its_deadline():
    body = asyncio.run(receive_body(*_body([b"ab", b"cd", b""]), 100, 5.0))
    assert body == b"abcd"


def test_the_deadline_is_for_the_whole_body_not_each_chunk():
    # every chunk comes within the timeout, the whole body does not: 408
    with pytest.raises(HTTPError) as info:
        asyncio.run(receive_body(*_body([b"a"] * 6, pause_s=0.05), 100, 0.2))
    assert info.value.status == 408 and "within 0.2 s" in str(info.value)


def test_a_body_over_the_limit_is_413():
    with pytest.raises(HTTPError) as info:
        asyncio.run(receive_body(*_body([b"a" * 60, b"a" * 60]), 100, None))
    assert info.value.status == 413


def test_a_declared_length_over_the_limit_is_413_before_reading():
    scope, receive = _body([b"never read"], headers=[(b"content-length", b"101")])
    with pytest.raises(HTTPError) as info:
        asyncio.run(receive_body(scope, receive, 100, None))
    assert info.value.status == 413 and "101 bytes" in str(info.value)


def test_a_client_that_leaves_mid_body_is_gone():
    with pytest.raises(ClientGone):
        asyncio.run(receive_body(*_body([b"ab"], then_gone=True), 100, 5.0))


def test_a_gzip_body_is_inflated_and_bounded():
    import gzip

    scope, receive = _body([gzip.compress(b"x" * 50)], headers=[(b"content-encoding", b"gzip")])
    assert asyncio.run(receive_body(scope, receive, 100, 5.0)) == b"x" * 50
    scope, receive = _body([gzip.compress(b"x" * 500)], headers=[(b"content-encoding", b"gzip")])
    with pytest.raises(HTTPError) as info:
        asyncio.run(receive_body(scope, receive, 100, 5.0))
    assert info.value.status == 413
