"""The front end's stand-in for the engine's BatchedSession.

:class:`ProxySession` has the methods :class:`~ortbatch.serve.served.model.ServedModel` uses
(``get_inputs``/``get_outputs``, ``run_async``, ``submit_many``, ``stats``,
``closed``/``ready``/``close``, ``manifest``, ``max_batch_size``, ``max_queue``); a request
is written into the request arena and announced to the engine, and its answer arrives the
same way. Requests made in one turn of an event loop go out in one frame.

Every request the engine is told about gets exactly one answer (outputs, an error, or
"gone" for one cancelled before it ran); its request block is freed when that answer
arrives, so a cancelled request's bytes stay valid for as long as the engine may read them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import socket
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from ...errors import InvalidInputError, SessionClosedError
from .generation import GenerationFuture
from .transport import Arena, BlockAllocator, FrameReader, decode_error, pack_tensors, unpack_tensors, write_frame

__all__ = ["ModelProxy", "NodeSpec", "ProxySession", "SessionInfo"]

log = logging.getLogger("ortbatch.serve")

_STATS_TIMEOUT_S = 5.0
#: the engine's answers to requests (``done``: a generation's Completion; ``admitted``
#: and ``tok`` precede it); other messages go to ``ProxySession.on_message``
_ANSWERS = frozenset({"ok", "err", "gone", "done", "admitted", "tok"})


@dataclass(frozen=True)
class NodeSpec:
    """An input or output as ``onnxruntime.NodeArg`` describes it (name, type, shape)."""

    name: str
    type: str
    shape: tuple[Any, ...]


@dataclass(frozen=True)
class SessionInfo:
    """What a front end knows of the engine's session without loading the model."""

    inputs: tuple[NodeSpec, ...]
    outputs: tuple[NodeSpec, ...]
    max_batch_size: int
    max_queue: int
    manifest: Any

    @classmethod
    def of(cls, session: Any) -> SessionInfo:
        def spec(n: Any) -> NodeSpec:
            return NodeSpec(n.name, n.type, tuple(n.shape or ()))

        return cls(
            tuple(spec(n) for n in session.get_inputs()),
            tuple(spec(n) for n in session.get_outputs()),
            session.max_batch_size,
            session.max_queue,
            session.manifest,
        )


#: the info of a link that serves no model of its own (a repository's front end)
_NO_MODEL = SessionInfo((), (), 1, 1, None)


class _Pending:
    __slots__ = ("admitted", "block", "future", "loop", "on_token")

    def __init__(
        self,
        future: Any,
        loop: asyncio.AbstractEventLoop | None,
        block: int | None,
        admitted: concurrent.futures.Future[None] | None = None,
        on_token: Callable[[Any], None] | None = None,
    ) -> None:
        self.future = future  # an asyncio future (loop set) or a concurrent one
        self.loop = loop
        self.block = block
        #: a generation request: set once the engine's generator has queued it
        self.admitted = admitted
        #: a streamed generation request: called with each token, on the reader thread
        self.on_token = on_token


class _RemoteModel:
    """A stand-in for the BatchedSession of one model of the engine, over a :class:`ProxySession`'s
    link (``_link``; ``_key`` names the model there)."""

    _link: ProxySession
    _key: int
    _info: SessionInfo
    _view_closed: bool

    def _init_remote(self, link: ProxySession, info: SessionInfo | None, key: int) -> None:
        info = info if info is not None else _NO_MODEL
        self._link, self._info, self._key = link, info, key
        self._view_closed = False
        self.manifest = info.manifest
        self.max_batch_size = info.max_batch_size
        self.max_queue = info.max_queue

    def get_inputs(self) -> list[NodeSpec]:
        return list(self._info.inputs)

    def get_outputs(self) -> list[NodeSpec]:
        return list(self._info.outputs)

    @property
    def closed(self) -> bool:
        return self._view_closed or self._link._closed or self._link._lost

    @property
    def ready(self) -> bool:
        return not self.closed

    def close(self, drain: bool = True) -> None:
        """Accept no more requests for this model (the engine's session is the engine's to
        close)."""
        self._view_closed = True

    async def run_async(
        self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any], *, timeout_s: float | None = None
    ) -> list[np.ndarray]:
        """Run one request in the engine; cancelling the awaiting task drops it there if
        it has not started."""
        self._check_view()
        return await self._link._run(self._key, output_names, input_feed, timeout_s)

    def submit_many(
        self,
        input_feeds: Sequence[Mapping[str, Any]],
        output_names: Sequence[str] | None = None,
        *,
        timeout_s: float | None = None,
    ) -> list[concurrent.futures.Future[list[np.ndarray]]]:
        """Queue several requests in the engine as one unit (all admitted or all failed
        with the same error, as ``BatchedSession.submit_many``); cancelling a future drops
        its request there if it has not started."""
        self._check_view()
        return self._link._submit_many(self._key, input_feeds, output_names, timeout_s)

    def stats(self) -> Any:
        """The engine's ``BatchedSession.stats()`` now (asked over the socket; the last
        snapshot, or None, if the engine does not answer within 5 s)."""
        return self._link._stats(self._key)

    def _check_view(self) -> None:
        if self._view_closed and not self._link._lost:
            raise SessionClosedError("the server is shutting down; no new requests are accepted")


class ModelProxy(_RemoteModel):
    """Another model of the same engine, over a :class:`ProxySession`'s link
    (:meth:`ProxySession.for_model`): a repository served by front ends."""

    def __init__(self, link: ProxySession, info: SessionInfo, key: int) -> None:
        self._init_remote(link, info, key)


class ProxySession(_RemoteModel):
    """A BatchedSession in another process (the engine), reached over ``sock`` with the
    tensor bytes in the two arenas. It is the link to the engine and the stand-in for the
    engine's model 0 (the one export of ``ortbatch serve DIR``); :meth:`for_model` gives
    the stand-in for any model over the same link.

    ``on_engine_lost`` is called (from the reader thread) when the engine's end closes
    without this side having closed first: every request still waiting has then failed
    with :class:`SessionClosedError`. ``info=None``: the link of a repository's front end,
    whose models all come through :meth:`for_model`. ``on_message`` gets the engine's
    messages that are not answers (a repository's model updates and replies), on the
    reader thread.
    """

    def __init__(
        self,
        sock: socket.socket,
        info: SessionInfo | None,
        requests: Arena,
        responses: Arena,
        *,
        on_engine_lost: Callable[[], None] | None = None,
        on_message: Callable[[tuple[Any, ...]], None] | None = None,
    ) -> None:
        self._sock = sock
        self._req = requests
        self._resp = responses
        self._alloc = BlockAllocator(requests.size)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._pending: dict[int, _Pending] = {}
        self._outbox: list[Any] = []
        self._payload = bytearray()
        self._flush_on: set[asyncio.AbstractEventLoop] = set()
        self._closed = False
        self._lost = False
        self._stats_waiters: dict[int, tuple[threading.Event, list[Any]]] = {}
        self._last_stats: dict[int, Any] = {}
        self._on_engine_lost = on_engine_lost
        self.on_message = on_message
        self._init_remote(self, info, 0)
        self._reader = FrameReader(sock)
        self._thread = threading.Thread(target=self._read_loop, name="ortbatch-frontend-reader", daemon=True)
        self._thread.start()

    def for_model(self, key: int, info: SessionInfo) -> ModelProxy:
        """A stand-in for the engine's model ``key`` over this link."""
        return ModelProxy(self, info, key)

    @property
    def engine_gone(self) -> bool:
        """Whether the engine's end has closed (or failed)."""
        return self._lost

    @property
    def in_flight(self) -> int:
        """Requests sent to the engine and not answered yet (every model's)."""
        return len(self._pending)

    async def _run(
        self, key: int, output_names: Sequence[str] | None, input_feed: Mapping[str, Any], timeout_s: float | None
    ) -> list[np.ndarray]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[list[np.ndarray]] = loop.create_future()
        rid = self._send_run(key, input_feed, output_names, timeout_s, fut, loop)
        try:
            return await fut
        except asyncio.CancelledError:
            self.cancel(rid)
            raise

    def _submit_many(
        self,
        key: int,
        input_feeds: Sequence[Mapping[str, Any]],
        output_names: Sequence[str] | None,
        timeout_s: float | None,
    ) -> list[concurrent.futures.Future[list[np.ndarray]]]:
        self._check_open()
        futures: list[concurrent.futures.Future[list[np.ndarray]]] = []
        rids: list[int] = []
        specs: list[Any] = []
        try:
            with self._lock:
                for feed in input_feeds:
                    fut: concurrent.futures.Future[list[np.ndarray]] = concurrent.futures.Future()
                    rid = next(self._ids)
                    spec, block = pack_tensors(feed.items(), self._req, self._alloc, self._payload)
                    self._pending[rid] = _Pending(fut, None, block)
                    futures.append(fut)
                    rids.append(rid)
                    specs.append(spec)
                names = None if output_names is None else list(output_names)
                self._outbox.append(("many", key, rids, names, specs, timeout_s))
        except BaseException:
            # nothing was announced: take the blocks back
            with self._lock:
                for rid in rids:
                    p = self._pending.pop(rid)
                    if p.block is not None:
                        self._alloc.free(p.block)
            raise
        for rid, fut in zip(rids, futures, strict=True):
            fut.add_done_callback(partial(self._cancel_if_cancelled, rid))
        self._schedule_flush(_running_loop())
        return futures

    def _submit_generation(
        self, key: int, request: tuple[Any, ...], on_token: Callable[[Any], None] | None
    ) -> GenerationFuture:
        """Queue a generation request (``request``: the prompt's ids, its SamplingParams
        and deadline) in the engine's generator ``key``; ``on_token`` (streamed) is called
        on the reader thread with each token."""
        self._check_open()
        fut = GenerationFuture()
        with self._lock:
            rid = next(self._ids)
            self._pending[rid] = _Pending(fut, None, None, fut.admitted, on_token)
            self._outbox.append(("gen", key, rid, request, on_token is not None))
        fut.add_done_callback(partial(self._cancel_if_cancelled, rid))
        self._schedule_flush(_running_loop())
        return fut

    def _stats(self, key: int) -> Any:
        if self._closed or self._lost:
            return self._last_stats.get(key)
        token = next(self._ids)
        event = threading.Event()
        box: list[Any] = []
        self._stats_waiters[token] = (event, box)
        try:
            self._send([("stats", token, key)])
            if event.wait(_STATS_TIMEOUT_S) and box:
                self._last_stats[key] = box[0]
        except OSError:
            pass
        finally:
            self._stats_waiters.pop(token, None)
        return self._last_stats.get(key)

    # -- sending -------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._lost:
            raise SessionClosedError("the engine process is gone; no requests are accepted")
        if self._closed:
            raise SessionClosedError("the server is shutting down; no new requests are accepted")

    def _send_run(
        self,
        key: int,
        feed: Mapping[str, Any],
        output_names: Sequence[str] | None,
        timeout_s: float | None,
        fut: Any,
        loop: asyncio.AbstractEventLoop,
    ) -> int:
        self._check_open()
        if isinstance(output_names, str):
            raise InvalidInputError(f"output_names must be a list of names, got the string {output_names!r}")
        names = None if output_names is None else list(output_names)
        with self._lock:
            rid = next(self._ids)
            spec, block = pack_tensors(feed.items(), self._req, self._alloc, self._payload)
            self._pending[rid] = _Pending(fut, loop, block)
            self._outbox.append(("run", key, rid, names, spec, timeout_s))
        self._schedule_flush(loop)
        return rid

    def _cancel_if_cancelled(self, rid: int, fut: concurrent.futures.Future[Any]) -> None:
        if fut.cancelled():
            self.cancel(rid)

    def cancel(self, rid: int) -> None:
        """Ask the engine to drop request ``rid`` (its answer, "gone" or outputs, frees it)."""
        with self._lock:
            if rid not in self._pending or self._lost:
                return
            self._outbox.append(("cancel", rid))
        self._schedule_flush(_running_loop())

    def _schedule_flush(self, loop: asyncio.AbstractEventLoop | None) -> None:
        """Send what is queued at the end of this turn of ``loop`` (so every request made
        in the turn shares one frame), or now when not called from a loop."""
        if loop is None:
            self.flush()
            return
        with self._lock:
            if loop in self._flush_on:
                return
            self._flush_on.add(loop)
        loop.call_soon(self._flush_from, loop)

    def _flush_from(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._lock:
            self._flush_on.discard(loop)
        self.flush()

    def flush(self) -> None:
        """Write every queued message in one frame."""
        with self._lock:
            if not self._outbox:
                return
            messages, payload = self._outbox, self._payload
            self._outbox, self._payload = [], bytearray()
        self._send(messages, payload)

    def notify(self, messages: list[Any]) -> None:
        """Send control messages to the engine now (e.g. ``("ready", pid)``)."""
        self._send(messages)

    def _send(self, messages: list[Any], payload: bytearray | bytes = b"") -> None:
        try:
            with self._send_lock:
                write_frame(self._sock, messages, payload)
        except OSError:
            self._engine_lost()

    # -- receiving -----------------------------------------------------------------------
    def _read_loop(self) -> None:
        while True:
            frame = self._reader.read()
            if frame is None:
                break
            try:
                self._handle(*frame)
            except Exception:  # a bug here must not leave every later request hanging
                log.exception("front end: cannot handle the engine's answer")
                break
        self._engine_lost()

    def _handle(self, messages: list[Any], payload: bytearray) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Any, Any, bool]]] = {}
        frees: list[int] = []
        for msg in messages:
            kind = msg[0]
            if kind == "stats":
                waiter = self._stats_waiters.get(msg[1])
                if waiter is not None:
                    waiter[1].append(msg[2])
                    waiter[0].set()
                continue
            if kind == "stop":
                self._on_stop()
                continue
            if kind not in _ANSWERS:
                if self.on_message is not None:
                    self.on_message(msg)
                continue
            rid = msg[1]
            if kind in ("admitted", "tok"):  # a generation request's progress, not its end
                self._progress(kind, rid, msg)
                continue
            with self._lock:
                p = self._pending.pop(rid, None)
                if p is not None and p.block is not None:
                    self._alloc.free(p.block)
            value: Any
            ok = kind in ("ok", "done")
            if kind == "ok":
                specs, block = msg[2], msg[3]
                if block is not None:
                    frees.append(block)
                value = [a for _, a in unpack_tensors(specs, self._resp, payload, copy=True)]
            elif kind == "done":
                value = msg[2]
            elif kind == "err":
                value = decode_error(*msg[2])
            else:  # "gone": dropped after a cancel
                if p is not None and p.admitted is not None:
                    _settle(p.admitted, None, True)
                continue
            if p is None:
                continue
            if p.admitted is not None:  # refused at submit (else admitted already: a no-op)
                _settle(p.admitted, None if ok else value, ok)
            if p.loop is None:
                _settle(p.future, value, ok)
            else:
                by_loop.setdefault(p.loop, []).append((p.future, value, ok))
        if frees:
            with self._lock:
                self._outbox.append(("free", frees))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(self._deliver, loop, items)
            except RuntimeError:  # that loop has closed: nobody waits on these any more
                pass
        if frees and not by_loop:
            self.flush()

    def _progress(self, kind: str, rid: int, msg: tuple[Any, ...]) -> None:
        with self._lock:
            p = self._pending.get(rid)
        if p is None:
            return
        if kind == "admitted":
            if p.admitted is not None:
                _settle(p.admitted, None, True)
        elif p.on_token is not None:
            p.on_token(msg[2])

    def _deliver(self, loop: asyncio.AbstractEventLoop, items: list[tuple[Any, Any, bool]]) -> None:
        for fut, value, ok in items:
            _settle(fut, value, ok)
        # the answers' arena blocks go back with whatever the woken handlers send next
        self._schedule_flush(loop)

    #: called from the reader thread when the engine says to stop (set by the front end)
    on_stop: Callable[[], None] | None = None
    #: called from the reader thread with each engine message that is not an answer
    on_message: Callable[[tuple[Any, ...]], None] | None = None

    def _on_stop(self) -> None:
        if self.on_stop is not None:
            self.on_stop()

    def _engine_lost(self) -> None:
        with self._lock:
            if self._lost:
                return
            self._lost = True
            pending, self._pending = self._pending, {}
        error = SessionClosedError("the engine process is gone; the request was not answered")
        for p in pending.values():
            if p.admitted is not None:
                _settle(p.admitted, error, False)
            if p.loop is None:
                _settle(p.future, error, False)
            else:
                try:
                    p.loop.call_soon_threadsafe(_settle, p.future, error, False)
                except RuntimeError:
                    pass
        for event, _ in list(self._stats_waiters.values()):
            event.set()
        if not self._closed and self._on_engine_lost is not None:
            self._on_engine_lost()

    def shutdown(self, final: list[Any] | None = None) -> None:
        """Send ``final`` messages (the front end's counts), then close the socket."""
        self._closed = True
        if final:
            with self._lock:
                self._outbox.extend(final)
        self.flush()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._thread.join(5)
        self._reader.close()
        self._sock.close()


def _settle(fut: Any, value: Any, ok: bool) -> None:
    if fut.done():  # cancelled meanwhile
        return
    try:
        if ok:
            fut.set_result(value)
        else:
            fut.set_exception(value)
    except (asyncio.InvalidStateError, concurrent.futures.InvalidStateError):
        pass  # cancelled on another thread between the check and the set


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
