"""A streamed completion's pieces, transport-free: from the generator's token callbacks (on its
own thread) to one asyncio consumer, as :class:`~ortbatch.serve.served.answers.Piece` objects
in order. HTTP's event streams, gRPC's decoupled responses and KServe v2 ``generate_stream``
all read them (:mod:`ortbatch.serve.http.openai_api`, :mod:`ortbatch.serve.served.decoupled`).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from functools import partial
from typing import Any

from .answers import Piece, opening, stop_reason
from .completions import CompletionRequest, Prompts, admitted, submit_all

__all__ = ["MAX_PENDING", "MAX_PENDING_TOTAL", "PieceStream", "pending_pieces"]

# queue item index meaning: the consumer is gone (the client disconnected)
_GONE = -1
#: most tokens one stream holds for a consumer that does not keep up (a client that stopped
#: reading): beyond, its requests are cancelled and what it held is dropped
MAX_PENDING = 4096
#: most tokens every stream of this process holds together (the same, for the stream that adds one more)
MAX_PENDING_TOTAL = 65536
_total_lock = threading.Lock()
_total = 0


def _count(delta: int) -> int:
    global _total
    with _total_lock:
        _total += delta
        return _total


def pending_pieces() -> int:
    """Tokens held by every stream of this process, not yet taken by their consumers."""
    return _total


class PieceStream:
    """The pieces of one streamed request, every choice of every prompt interleaved.

    :meth:`start` submits (a refusal, such as a full queue, raises there, before anything is
    streamed); :meth:`pieces` then yields each choice's pieces: its opening (the echo, when
    asked) with its first token, a piece per token that brings text (or logprobs, or ids when
    asked), and a last piece with the finish reason and the Completion, or the error that
    ended the choice. :meth:`abandon` (the client left, from any task) ends the iteration;
    leaving it cancels every request still running.
    """

    def __init__(self, generator: Any, req: CompletionRequest, prompts: Prompts) -> None:
        self.generator, self.req, self.prompts = generator, req, prompts
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self.futures: list[Future[Any]] = []
        #: tokens in the queue (counted in the process's total)
        self._held = 0
        #: the consumer is gone, or fell too far behind: tokens are dropped on arrival
        self._closed = False
        #: the stream was cut because its consumer fell :data:`MAX_PENDING` tokens behind
        self.stalled = False

    def _put(self, item: tuple[int, Any]) -> None:
        try:
            self._loop.call_soon_threadsafe(self._deliver, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def _deliver(self, item: tuple[int, Any]) -> None:
        """Queue ``item`` (on the loop's thread), unless the consumer is gone or too far behind."""
        if self._closed:
            return
        if item[1] is not None and item[0] != _GONE:
            if self._held >= MAX_PENDING or pending_pieces() >= MAX_PENDING_TOTAL:
                self._stall()
                return
            self._held += 1
            _count(1)
        self._queue.put_nowait(item)

    def _stall(self) -> None:
        self.stalled = True
        self.stop()

    def stop(self) -> None:
        """The consumer stopped taking tokens (a client that does not read): cancel every request,
        drop what the queue holds and end :meth:`pieces`, so the memory goes now, not when the
        socket closes (from the event loop's thread)."""
        self._release()
        self.cancel()
        self._queue.put_nowait((_GONE, None))

    def _release(self) -> None:
        self._closed = True
        while not self._queue.empty():
            self._queue.get_nowait()
        _count(-self._held)
        self._held = 0

    def _on_token(self, prompt: int) -> Callable[[Any], None]:
        runs = self.req.runs
        return lambda tok: self._put((prompt * runs + tok.choice, tok))

    async def start(self) -> None:
        """Submit every prompt's choices and wait until they are queued."""
        self.futures = submit_all(self.generator, self.req, self.prompts, self._on_token)
        await admitted(self.futures)
        for k, fut in enumerate(self.futures):
            # tokens are put before the future settles, on the same thread: the end
            # marker (token None) comes after the request's last token
            fut.add_done_callback(partial(lambda k, _fut: self._put((k, None)), k))

    def abandon(self) -> None:
        """End :meth:`pieces` (from the event loop's thread), dropping what it has not taken."""
        self._release()
        self._queue.put_nowait((_GONE, None))

    def cancel(self) -> None:
        for fut in self.futures:
            fut.cancel()

    async def pieces(self) -> AsyncIterator[Piece]:
        req = self.req
        sent = [""] * len(self.futures)  # generated text streamed so far, per choice
        counts = [0] * len(self.futures)
        started = [False] * len(self.futures)
        still_open = len(self.futures)
        try:
            while still_open:
                k, tok = await self._queue.get()
                if k == _GONE:
                    return
                if tok is not None:
                    self._held -= 1
                    _count(-1)
                if tok is None:
                    still_open -= 1
                    piece = self._last(k, started[k], sent[k], counts[k])
                    if piece is not None:
                        yield piece
                    continue
                counts[k] += 1
                piece = Piece(k, generated=counts[k])
                if not started[k]:
                    started[k] = True
                    piece = opening(req, self.prompts, k, tok.prompt_logprobs)
                    piece.generated = counts[k]
                piece.text += tok.text
                piece.token_ids = [tok.token_id]
                sent[k] += tok.text
                if req.logprobs is not None:
                    piece.entries = [*(piece.entries or []), (tok.token_id, tok.logprob)]
                if piece.text or piece.entries or req.return_token_ids:
                    yield piece
        finally:  # the consumer left (or every choice ended): free any row still held
            self._release()
            self.cancel()

    def _last(self, k: int, started: bool, sent: str, count: int) -> Piece | None:
        """Choice ``k``'s last piece once its request settled (``None`` when it was cancelled)."""
        fut = self.futures[k]
        if fut.cancelled():
            return None
        exc = fut.exception()
        if exc is not None:
            return Piece(k, error=exc)
        completion = fut.result()
        piece = Piece(k) if started else opening(self.req, self.prompts, k, completion.prompt_logprobs)
        # what the stream has not carried yet (text held back until the end)
        piece.text += completion.text[len(sent) :] if completion.text.startswith(sent) else ""
        piece.generated = count
        piece.finish_reason = completion.finish_reason
        piece.stop_reason = stop_reason(completion, self.req.params)
        piece.completion = completion
        return piece
