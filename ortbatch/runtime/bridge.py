"""Where ``BatchedSession.run_async`` meets an event loop, at a cost per burst rather
than per request.

A caller on an event loop could wrap a :class:`concurrent.futures.Future` per request
(``asyncio.wrap_future``): each request would then allocate a ``Condition``, chain two
futures, and wake the loop with its own ``call_soon_threadsafe`` (a write to the loop's
self-pipe) when its batch is done, and each ``put`` would wake a worker for a batch of
one. On a server whose requests cost ~1 ms of CPU in all, that was a quarter of it
(docs/benchmarks-log.md, "The gRPC path"). Instead:

* **Submission** (:class:`Outbox`): requests started in one turn of the loop are queued
  together at the start of its next turn (one lock, one worker wake-up), so
  requests that arrive together are offered to the batcher together.
* **Delivery** (:class:`Mailbox`): a worker settles an :class:`AsyncSlot`, which posts
  the outcome to its loop's mailbox; the first post of a burst schedules one
  ``call_soon_threadsafe`` that sets every asyncio future posted since. A worker settles a
  batch's requests inside :func:`one_wake_up`, so a batch wakes each loop once, at its end,
  whatever the loop does meanwhile (woken at the first post, a busy loop could take that
  one before the next was posted, and be woken again for each).

The slot keeps the state machine the runtime relies on (pending, running, cancelled,
finished: :class:`~ortbatch.runtime.scheduler.Slot`'s, as ``run()``'s ``LightFuture``), so
workers, the scheduler's deadline reaping and ``close()`` settle it like any other future.
"""

from __future__ import annotations

import _thread
import asyncio
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .scheduler import Request, Scheduler, Slot

__all__ = ["AsyncSlot", "Mailbox", "Outbox", "mailbox_for", "one_wake_up"]

#: per thread: the mailboxes posted to inside :func:`one_wake_up` (None outside it)
_held = threading.local()


class Mailbox:
    """Outcomes posted from worker threads for the asyncio futures of one loop."""

    __slots__ = ("__weakref__", "_items", "_lock", "_loop", "_scheduled")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = weakref.ref(loop)  # kept by the loop, so it must not keep the loop
        self._items: list[tuple[asyncio.Future[Any], Any, BaseException | None]] = []
        self._lock = _thread.allocate_lock()
        self._scheduled = False

    def post(self, fut: asyncio.Future[Any], value: Any, exc: BaseException | None) -> None:
        with self._lock:
            self._items.append((fut, value, exc))
            if self._scheduled:
                return
            held: set[Mailbox] | None = getattr(_held, "boxes", None)
            if held is not None:  # woken when the batch is settled (one_wake_up)
                held.add(self)
                return
            self._scheduled = True
        self._wake()

    def _flush(self) -> None:
        """Wake the loop for what was posted and is not yet scheduled."""
        with self._lock:
            if self._scheduled or not self._items:
                return
            self._scheduled = True
        self._wake()

    def _wake(self) -> None:
        loop = self._loop()
        try:
            if loop is None:
                raise RuntimeError("the event loop is gone")
            loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the loop is closed: nobody is left to await the outcome
            with self._lock:
                self._items.clear()
                self._scheduled = False

    def _deliver(self) -> None:
        with self._lock:
            items, self._items = self._items, []
            self._scheduled = False
        for fut, value, exc in items:
            if fut.done():  # its caller was cancelled meanwhile
                continue
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(value)


@contextmanager
def one_wake_up() -> Iterator[None]:
    """Outcomes this thread posts inside the block wake each loop once, when it ends."""
    if getattr(_held, "boxes", None) is not None:  # already inside one
        yield
        return
    _held.boxes = set()
    try:
        yield
    finally:
        boxes, _held.boxes = _held.boxes, None
        for box in boxes:
            box._flush()


_mailboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Mailbox] = weakref.WeakKeyDictionary()
_mailboxes_lock = _thread.allocate_lock()


def mailbox_for(loop: asyncio.AbstractEventLoop) -> Mailbox:
    """The loop's one mailbox (shared by every session the loop awaits)."""
    box = _mailboxes.get(loop)
    if box is None:
        with _mailboxes_lock:
            box = _mailboxes.get(loop)
            if box is None:
                box = _mailboxes[loop] = Mailbox(loop)
    return box


class AsyncSlot(Slot):
    """The slot of one ``run_async`` request: settled by a worker thread, delivered to the
    caller's asyncio future through the loop's :class:`Mailbox`. Nobody blocks on it, so
    unlike :class:`~ortbatch.runtime.scheduler.LightFuture` it has no waiter's lock."""

    __slots__ = ("_mailbox", "future")

    def __init__(self, future: asyncio.Future[Any], mailbox: Mailbox) -> None:
        super().__init__()
        self._mailbox = mailbox
        self.future = future

    def _on_settled(self) -> None:
        value, exc = self._result, self._exc
        self._result = self._exc = None  # the caller's future holds them from here
        self._mailbox.post(self.future, value, exc)


class Outbox:
    """Requests started on one loop for one scheduler during the current turn, queued
    together when the loop next runs its callbacks (or when the session closes)."""

    __slots__ = ("__weakref__", "_items", "_lock", "_loop", "_sched")

    def __init__(self, loop: asyncio.AbstractEventLoop, sched: Scheduler) -> None:
        self._loop = weakref.ref(loop)  # kept per loop, so it must not keep the loop
        self._sched = sched
        self._items: list[Request] = []
        self._lock = _thread.allocate_lock()

    def add(self, req: Request) -> None:
        with self._lock:
            first = not self._items
            self._items.append(req)
        if first:
            loop = self._loop()
            assert loop is not None  # add() runs on the loop
            loop.call_soon(self.flush)

    def remove(self, req: Request) -> bool:
        """Take ``req`` back if it has not been queued yet."""
        with self._lock:
            try:
                self._items.remove(req)
            except ValueError:
                return False
            return True

    def flush(self) -> None:
        """Queue what was gathered, in order, until the queue is full (one lock, one
        wake-up); a request refused gets its own error."""
        with self._lock:
            reqs, self._items = self._items, []
        if not reqs:
            return
        for req, error in zip(reqs, self._sched.put_each(reqs), strict=True):
            if error is not None:
                _fail_now(req, error)


def _fail_now(req: Request, exc: BaseException) -> None:
    """Fail a request that was never queued."""
    slot = req.future
    if isinstance(slot, AsyncSlot) and slot.set_running_or_notify_cancel():
        slot.set_exception(exc)
