"""Lifecycle helpers both runtimes share: BatchedSession and BatchedGenerator.

Pure Python, no ONNX Runtime. What is here is what both repeat otherwise:

* the live-instance set and the one ``atexit`` hook that closes what is still open, so
  a process that never calls ``close()`` still exits without stranded callers;
* settling a future exactly once (it may have been cancelled, or settled, meanwhile), and a
  request future whose cancel wakes ``concurrent.futures.wait``;
* the checks of constructor arguments.
"""

from __future__ import annotations

import atexit
import weakref
from concurrent.futures import Future, InvalidStateError
from typing import Any, Protocol

__all__ = ["check_positive", "check_timeout", "forget_live", "request_future", "settle", "track_live"]


class _Closeable(Protocol):
    def close(self, drain: bool = True, timeout: float | None = None) -> None: ...


# Weak: an instance nobody holds any more is not kept alive by this set.
_LIVE: weakref.WeakSet[Any] = weakref.WeakSet()


def track_live(instance: _Closeable) -> None:
    """Close ``instance`` (without draining) at interpreter exit if it is still open then."""
    _LIVE.add(instance)


def forget_live(instance: _Closeable) -> None:
    """``instance`` is closed: the exit hook need not close it."""
    _LIVE.discard(instance)


@atexit.register
def _close_all_at_exit() -> None:  # pragma: no cover - exercised in a subprocess test
    for instance in list(_LIVE):
        try:
            instance.close(drain=False, timeout=1.0)
        except Exception:
            pass


def settle(fut: Any, *, result: Any = None, error: BaseException | None = None) -> bool:
    """Set ``fut``'s outcome unless it is already done (cancelled or settled meanwhile).

    Works for :class:`concurrent.futures.Future` and the runtime's ``LightFuture``, which both
    raise :class:`InvalidStateError` when set twice or after a cancel. Returns whether
    this call settled it.
    """
    try:
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)
    except InvalidStateError:
        return False
    return True


def request_future() -> Future[Any]:
    """A request's future, whose ``cancel()`` wakes ``concurrent.futures.wait`` and ``as_completed``.

    ``Future.cancel()`` alone does not: those waiters learn of a cancel only when
    ``set_running_or_notify_cancel()`` moves the future from CANCELLED to CANCELLED_AND_NOTIFIED
    (an executor's call before it runs the work), and until then ``wait`` does not count the
    future as done even if it was cancelled before the call. The generators never move their
    futures to RUNNING (a caller may cancel a request mid-way), so the cancel itself notifies, once.
    """
    future: Future[Any] = Future()
    future.add_done_callback(_notify_cancelled)
    return future


def _notify_cancelled(future: Future[Any]) -> None:
    if future.cancelled():
        try:
            future.set_running_or_notify_cancel()
        except RuntimeError:  # notified already
            pass


def check_positive(name: str, value: Any) -> None:
    """``value`` must be an int >= 1 (not a bool): a ``ValueError`` naming ``name`` otherwise."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def check_timeout(name: str, value: float | None) -> None:
    """``value`` must be ``None`` or a number > 0."""
    if value is not None and not value > 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
