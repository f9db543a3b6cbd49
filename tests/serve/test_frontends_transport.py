"""The --frontends machinery without processes: the arena allocator, frames, errors
across the boundary, and a ProxySession talking to a FrontEndLink over a socketpair in
this process (the engine's session real or scripted)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import socket
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from ortbatch.errors import (
    InferenceError,
    InvalidInputError,
    OrtBatchError,
    QueueFullError,
    RequestTimeoutError,
    RequestTooLargeError,
    SessionClosedError,
)
from ortbatch.serve.frontends.engine import FrontEndLink
from ortbatch.serve.frontends.proxy import NodeSpec, ProxySession, SessionInfo
from ortbatch.serve.frontends.transport import (
    ALIGN,
    Arena,
    BlockAllocator,
    FrameReader,
    decode_error,
    encode_error,
    pack_tensors,
    unpack_tensors,
    write_frame,
)
from ortbatch.serve.http.plumbing import HTTPError

pytestmark = pytest.mark.timeout(60)


# -- allocator ---------------------------------------------------------------------------
def test_allocator_aligns_reuses_and_coalesces():
    a = BlockAllocator(10 * ALIGN)
    x = a.alloc(1)
    y = a.alloc(ALIGN + 1)  # two units
    z = a.alloc(0)  # still a distinct block
    assert (x, y, z) == (0, ALIGN, 3 * ALIGN)
    assert a.alloc(7 * ALIGN) is None  # 6 units left
    a.free(y)
    assert a.alloc(2 * ALIGN) == ALIGN  # first fit takes the hole back
    a.free(ALIGN)
    a.free(x)
    a.free(z)
    assert a.blocks == 0 and a.used_bytes == 0
    assert a.alloc(10 * ALIGN) == 0  # every free run merged back into one


def test_allocator_refuses_a_double_free():
    a = BlockAllocator(4 * ALIGN)
    off = a.alloc(10)
    assert off is not None
    a.free(off)
    with pytest.raises(ValueError, match="not an allocated block"):
        a.free(off)


def test_allocator_survives_random_churn():
    rng = np.random.default_rng(0)
    a = BlockAllocator(1 << 16)
    held: dict[int, int] = {}
    for _ in range(3000):
        if held and rng.random() < 0.5:
            off = list(held)[int(rng.integers(len(held)))]
            a.free(off)
            del held[off]
        else:
            n = int(rng.integers(0, 3000))
            off = a.alloc(n)
            if off is not None:
                end = off + max(-(-n // ALIGN) * ALIGN, ALIGN)
                assert end <= a.size
                for o, m in held.items():  # never overlaps a block still held
                    assert end <= o or off >= o + max(-(-m // ALIGN) * ALIGN, ALIGN)
                held[off] = n
    for off in held:
        a.free(off)
    assert a.alloc(a.size) == 0


# -- tensors and frames ------------------------------------------------------------------
def test_tensors_go_through_the_arena_and_fall_back_to_the_payload_when_it_is_full():
    arena = Arena.create(4096)
    alloc = BlockAllocator(arena.size)
    payload = bytearray()
    small = [("a", np.arange(6, dtype=np.int64).reshape(2, 3)), ("b", np.array([[1.5]], dtype=np.float32))]
    specs, block = pack_tensors(small, arena, alloc, payload)
    assert block == 0 and not payload
    back = unpack_tensors(specs, arena, payload, copy=True)
    for (n1, x), (n2, y) in zip(small, back, strict=True):
        assert n1 == n2 and x.dtype == y.dtype and np.array_equal(x, y)
    big = [("c", np.arange(2000, dtype=np.float64))]  # 16 kB: larger than the arena
    specs, block = pack_tensors(big, arena, alloc, payload)
    assert block is None and len(payload) == 16000
    ((_, c),) = unpack_tensors(specs, arena, payload, copy=False)
    assert np.array_equal(c, big[0][1])


def test_a_scalar_tensor_keeps_its_shape_through_the_arena_and_the_payload():
    # a v2 request with "shape": [] was refused by the engine as "shape [1]" with --frontends 2
    arena = Arena.create(4096)
    alloc = BlockAllocator(arena.size)
    payload = bytearray()
    items = [("s", np.array(1.5, dtype=np.float32)), ("t", np.array([[7]], dtype=np.int64))]
    specs, block = pack_tensors(items, arena, alloc, payload)
    assert block is not None
    back = unpack_tensors(specs, arena, payload, copy=True)
    assert [a.shape for _, a in back] == [(), (1, 1)] and back[0][1] == 1.5
    full = Arena.create(8)
    specs, block = pack_tensors(items, full, BlockAllocator(full.size), payload)
    assert block is None
    assert [a.shape for _, a in unpack_tensors(specs, full, payload, copy=False)] == [(), (1, 1)]


def test_string_tensors_are_refused_with_a_clear_error():
    arena = Arena.create(4096)
    with pytest.raises(InvalidInputError, match="--frontends 1"):
        pack_tensors([("s", np.array([b"x"], dtype=object))], arena, BlockAllocator(arena.size), bytearray())


def test_frames_keep_their_boundaries_and_payloads():
    a, b = socket.socketpair()
    reader = FrameReader(b)
    write_frame(a, [("run", 1), ("cancel", 2)])
    write_frame(a, [("ok", 3)], b"\x00\x01" * 40000)  # larger than one recv
    write_frame(a, [])
    a.close()
    assert reader.read() == ([("run", 1), ("cancel", 2)], bytearray())
    msgs, payload = reader.read()
    assert msgs == [("ok", 3)] and payload == bytearray(b"\x00\x01" * 40000)
    assert reader.read() == ([], bytearray())
    assert reader.read() is None  # end of stream
    reader.close()
    b.close()


def test_a_truncated_frame_is_the_end_of_the_stream():
    a, b = socket.socketpair()
    reader = FrameReader(b)
    a.sendall(b"\x10\x00\x00\x00")  # half a header, then the writer dies
    a.close()
    assert reader.read() is None
    reader.close()
    b.close()


# -- errors ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "exc",
    [
        QueueFullError(7, 8),
        InvalidInputError("input 'x': bad", input_name="x"),
        RequestTooLargeError("too many", input_name="input"),
        RequestTimeoutError("deadline passed before the request could run; it was dropped"),
        SessionClosedError("closed"),
        InferenceError("ORT failed"),
        ValueError("plain"),
        HTTPError(404, "unknown model 'x'", {"Retry-After": "1"}),
    ],
    ids=lambda e: type(e).__name__,
)
def test_errors_cross_as_their_own_class_with_message_and_attributes(exc):
    back = decode_error(*encode_error(exc))
    assert type(back) is type(exc)
    assert str(back) == str(exc)
    for k, v in vars(exc).items():
        assert getattr(back, k) == v


def test_an_unknown_error_class_becomes_an_inference_error_naming_it():
    class Weird(Exception):
        """An error class the decoding side has no reason to trust or import."""

    back = decode_error(*encode_error(Weird("boom")))
    assert type(back) is InferenceError and "Weird: boom" in str(back)
    # a module outside ortbatch and builtins is never imported
    back = decode_error("os", "system", "x", {})
    assert type(back) is InferenceError


# -- a proxy over a link, in one process -------------------------------------------------
class Scripted:
    """The engine's session, scripted by the first value of ``x``: 1 queue full at
    submit, 2 a deadline while queued, 3 bad input at submit, 4 ORT failing, 5 never
    finishing (until cancelled); else ``y = x * 2``."""

    max_queue = 8

    def __init__(self) -> None:
        self.hung: list[concurrent.futures.Future[Any]] = []

    def submit(self, feed, names=None, *, timeout_s=None):
        x = feed["x"]
        code = int(x.reshape(-1)[0])
        if code == 1:
            raise QueueFullError(8, 8)
        if code == 3:
            raise InvalidInputError("input 'x': expected 3 columns", input_name="x")
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        if code == 2:
            fut.set_exception(RequestTimeoutError("deadline passed before the request could run; it was dropped"))
        elif code == 4:
            fut.set_exception(InferenceError("ONNX Runtime failed: RuntimeException"))
        elif code == 5:
            self.hung.append(fut)
        else:
            fut.set_result([x * 2])
        return fut

    def submit_many(self, feeds, names=None, *, timeout_s=None):
        return [self.submit(f, names, timeout_s=timeout_s) for f in feeds]

    def stats(self):
        return SimpleNamespace(queued=3, requests=11)


class ScriptedEach(Scripted):
    """Scripted, with ``submit_each`` as BatchedSession has it: the engine queues a
    frame's runs in one call, each refused on its own."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[int] = []

    def submit_each(self, items):
        self.calls.append(len(items))
        out = []
        for feed, names, timeout_s in items:
            try:
                out.append(self.submit(feed, names, timeout_s=timeout_s))
            except OrtBatchError as exc:
                out.append(exc)
        return out


INFO = SessionInfo(
    (NodeSpec("x", "tensor(float)", ("batch", 3)),), (NodeSpec("y", "tensor(float)", ("batch", 3)),), 4, 8, None
)


def _pair(session: Any, info: SessionInfo = INFO, arena_bytes: int = 1 << 20, **kw: Any):
    ours, theirs = socket.socketpair()
    req, resp = Arena.create(arena_bytes), Arena.create(arena_bytes)
    link = FrontEndLink(session, ours, Arena(req.handle), Arena(resp.handle))
    proxy = ProxySession(theirs, info, req, resp, **kw)
    return link, proxy


@pytest.mark.parametrize("script", [Scripted, ScriptedEach])
def test_answers_and_typed_errors_come_back_through_the_proxy(script):
    session = script()
    link, proxy = _pair(session)

    async def go():
        async def one(v: float):
            try:
                (y,) = await proxy.run_async(["y"], {"x": np.full((1, 3), v, dtype=np.float32)})
                return y
            except Exception as exc:
                return exc

        return await asyncio.gather(*(one(v) for v in (0.5, 1, 2, 3, 4, 7)))

    ok, full, late, bad, failed, ok2 = asyncio.run(go())
    assert np.array_equal(ok, np.full((1, 3), 1.0, dtype=np.float32))
    assert np.array_equal(ok2, np.full((1, 3), 14.0, dtype=np.float32))
    assert type(full) is QueueFullError and (full.queued, full.max_queue) == (8, 8)
    assert type(late) is RequestTimeoutError
    assert type(bad) is InvalidInputError and bad.input_name == "x"
    assert type(failed) is InferenceError
    assert proxy.stats().queued == 3  # the engine's stats, asked over the socket
    if isinstance(session, ScriptedEach):  # a frame's runs went in together, errors and all
        assert sum(session.calls) == 6 and len(session.calls) < 6
    # every request block and every answer block was given back
    assert proxy._alloc.blocks == 0
    _wait(lambda: link._resp_alloc.blocks == 0)
    proxy.shutdown()


def test_concurrent_requests_each_get_their_own_answer(adder_path):
    from ortbatch import BatchedSession

    session = BatchedSession(adder_path, max_batch_size=8, max_delay_ms=1)
    info = SessionInfo.of(session)
    # an arena too small for every request at once: the rest go in the frame's payload
    _link, proxy = _pair(session, info, arena_bytes=4096)
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((int(rng.integers(1, 4)), 3)).astype(np.float32) for _ in range(300)]

    async def go():
        return await asyncio.gather(
            *(proxy.run_async(None, {"x": x, "k": np.full((len(x), 1), i, dtype=np.int32)}) for i, x in enumerate(xs))
        )

    try:
        outs = asyncio.run(go())
        for i, (x, (y, n)) in enumerate(zip(xs, outs, strict=True)):
            np.testing.assert_allclose(y, x * 2 + i, rtol=1e-6)
            assert n.reshape(-1).tolist() == [i + 1] * len(x)
        assert session.stats().batches < 300  # batched together in the engine
        # submit_many: one unit, answers in order
        futures = proxy.submit_many([{"x": x, "k": np.zeros((len(x), 1), np.int32)} for x in xs[:5]], ["y"])
        for x, f in zip(xs[:5], futures, strict=True):
            np.testing.assert_allclose(f.result(10)[0], x * 2, rtol=1e-6)
    finally:
        proxy.shutdown()
        session.close()


def test_a_cancelled_request_is_dropped_in_the_engine_and_its_block_freed():
    script = Scripted()
    link, proxy = _pair(script)

    async def go():
        task = asyncio.ensure_future(proxy.run_async(None, {"x": np.full((1, 3), 5, np.float32)}))
        while not script.hung:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(go())
    _wait(lambda: script.hung[0].cancelled() and proxy._alloc.blocks == 0 and not link.inflight)
    proxy.shutdown()


def test_a_front_end_that_goes_away_has_its_queued_requests_cancelled():
    script = Scripted()
    link, proxy = _pair(script)
    fut = proxy.submit_many([{"x": np.full((1, 3), 5, np.float32)}])[0]
    _wait(lambda: script.hung)
    proxy._sock.shutdown(socket.SHUT_RDWR)  # the front end dies without a word
    _wait(lambda: link.closed.is_set())
    assert script.hung[0].cancelled()  # dropped unrun in the engine
    assert isinstance(fut.exception(5), SessionClosedError)
    proxy._thread.join(5)
    proxy._reader.close()
    proxy._sock.close()


def test_when_the_engine_goes_away_waiting_requests_fail_and_the_front_end_is_told():
    script = Scripted()
    lost = threading.Event()
    link, proxy = _pair(script, on_engine_lost=lost.set)
    fut = proxy.submit_many([{"x": np.full((1, 3), 5, np.float32)}])[0]
    _wait(lambda: script.hung)
    link.sock.shutdown(socket.SHUT_RDWR)
    with pytest.raises(SessionClosedError, match="engine process is gone"):
        fut.result(10)
    assert lost.wait(10)
    assert proxy.closed and not proxy.ready
    with pytest.raises(SessionClosedError):
        proxy.submit_many([{"x": np.zeros((1, 3), np.float32)}])
    proxy.shutdown()


def _wait(cond: Any, timeout: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition never became true"
        time.sleep(0.01)


def test_served_model_metadata_comes_from_the_face_without_a_session(tmp_path: Path):
    from ortbatch.serve.served.model import ServedModel

    _link, proxy = _pair(Scripted())
    served = ServedModel.for_export(proxy, tmp_path, name="fake")
    assert served.metadata()["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 3]}]
    assert served.triton_config()["max_batch_size"] == 4
    assert served.ready
    proxy.shutdown()
