"""HTTP connections dealt to the front ends in turn.

Front ends that all accept from one listening socket share its connections by race: a
loop woken for a new connection accepts every one that is waiting (asyncio up to the
backlog, libuv until none is left), so the 16 connections a client pool opens at once
split 5/11 or 2/14, and the front end with 2 sits idle while the other is saturated.
Behind a proxy that keeps a few long-lived connections, one front end may get none.

Here the engine accepts (:class:`ConnectionDealer`, one thread, blocking ``accept``) and
hands each connection's descriptor to the next front end that is serving, in turn, over
that front end's own ``SOCK_SEQPACKET`` channel (``SCM_RIGHTS``: one descriptor per
message). The front end (:func:`adopting_server`) adopts each into its uvicorn server
with ``loop.connect_accepted_socket``, through the same HTTP protocol (and TLS) as a
connection it accepted itself. Keep-alive connections cost the engine one ``accept`` and
one ``sendmsg`` each, whatever the number of requests they carry. gRPC connections are
spread by the kernel (SO_REUSEPORT): grpcio takes no accepted socket.

The dealer keeps its copy of a connection until the front end acknowledges it (one byte
back per descriptor, sent before it reads anything from the connection). A front end that
dies with connections dealt but not yet taken (still in its channel) would otherwise take
them down with it, unread: a client that reconnected at once after its front end was
killed lost its second request too. On the channel's end (EOF) such connections are dealt
again, to the next front end; nobody has read a byte of them.

A front end that comes back (restarted after it died) gets new connections in turn, but
the keep-alive clients that reconnected while it was down all sit on the others. So when
a front end starts serving, the dealer sends each of the others :data:`REBALANCE` (a
message without a descriptor): each of their keep-alive connections closes after its next
response, which says so (``Connection: close``), and the clients' reconnects are dealt in
turn again. An idle connection is not closed at once: a client may be sending its next
request on it at that moment, and would see the connection closed under that request.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["REBALANCE", "ConnectionDealer", "adopting_server", "channel_pair"]

log = logging.getLogger("ortbatch.serve")

#: how long the dealer waits for a front end's channel to take a descriptor before it
#: tries the next one (a front end that stopped reading must not stall the others)
_SEND_TIMEOUT_S = 1.0
#: how often the dealer's blocking accept looks at its stop flag
_ACCEPT_POLL_S = 0.25
#: how long a connection waits for a front end when none is serving (all of them
#: restarting): as long as it would have waited in the backlog for one to accept it
WAIT_FOR_FRONT_END_S = 10.0
#: the dealer's message "a front end (re)joined: close your idle keep-alive connections"
REBALANCE = b"r"


def channel_pair() -> tuple[socket.socket, socket.socket]:
    """The two ends of a front end's connection channel (the engine's first)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ours.settimeout(_SEND_TIMEOUT_S)
    return ours, theirs


class ConnectionDealer:
    """Accepts on ``listener`` and hands each connection to one of ``channels()`` (the
    channels of the front ends serving now, in a fixed order), in turn. With none
    serving, a connection waits up to ``wait_s`` for one (later connections wait in the
    backlog meanwhile); then, or when none takes it, it is closed. :meth:`stop` ends
    the accepting (new connections are refused once the caller closes the listener)."""

    def __init__(
        self,
        listener: socket.socket,
        channels: Callable[[], Sequence[socket.socket]],
        wait_s: float = WAIT_FOR_FRONT_END_S,
    ) -> None:
        self._listener = listener
        self._channels = channels
        self._wait_s = wait_s
        self._turn = itertools.count()
        self._stop = threading.Event()
        #: connections handed over, and those closed for want of a front end
        self.dealt = 0
        self.refused = 0
        #: per channel, the connections dealt over it that its front end has not acknowledged
        self._unacked: dict[socket.socket, deque[socket.socket]] = {}
        #: the channels serving when the dealer last looked (a new one: rebalance)
        self._seen: set[socket.socket] = set()
        self._thread = threading.Thread(target=self._run, name="ortbatch-dealer", daemon=True)

    def start(self) -> ConnectionDealer:
        self._listener.settimeout(_ACCEPT_POLL_S)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)

    def _rebalance(self) -> None:
        """When a front end has joined since the last look, tell the others to let their
        idle keep-alive connections go, so that their clients reconnect through the dealer."""
        channels = list(self._channels())
        joined = set(channels) - self._seen
        if self._seen and joined:
            for channel in channels:
                if channel not in joined:
                    try:
                        channel.send(REBALANCE)
                    except OSError:  # gone or stalled: it is not the overloaded one then
                        continue
        self._seen = set(channels)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._rebalance()  # at least every _ACCEPT_POLL_S
                self._collect()
                try:
                    conn, _ = self._listener.accept()
                except TimeoutError:
                    continue
                except OSError as exc:  # the listener closed under us, or a transient accept error
                    if self._listener.fileno() < 0:
                        return
                    log.debug("dealer: accept failed: %s", exc)
                    continue
                self._deal(conn)
        finally:
            for conns in self._unacked.values():
                for conn in conns:
                    conn.close()
            self._unacked.clear()

    def _collect(self) -> None:
        """Close the connections front ends acknowledged; deal again those of a front end
        whose channel ended (it died, or the engine closed the channel to restart it)."""
        for channel, conns in list(self._unacked.items()):
            ended = channel.fileno() < 0
            while not ended and conns and select.select([channel], [], [], 0)[0]:
                try:
                    acks = channel.recv(256)
                except BlockingIOError:
                    break
                except OSError:
                    acks = b""
                if not acks:
                    ended = True
                for _ in range(min(len(acks), len(conns))):
                    conns.popleft().close()  # the front end holds its own descriptor now
            if ended or not conns:
                del self._unacked[channel]
            if ended:
                for conn in conns:
                    self._deal(conn, again=True)

    def _deal(self, conn: socket.socket, again: bool = False) -> None:
        channels = list(self._channels())
        deadline = time.monotonic() + self._wait_s
        while not channels and time.monotonic() < deadline and not self._stop.wait(0.05):
            channels = list(self._channels())
        if channels:
            first = next(self._turn)
            for i in range(len(channels)):
                channel = channels[(first + i) % len(channels)]
                try:
                    socket.send_fds(channel, [b"c"], [conn.fileno()])
                except OSError:  # that front end is gone or stalled: the next one
                    continue
                self._unacked.setdefault(channel, deque()).append(conn)
                self.dealt += not again
                return
        self.refused += 1
        conn.close()


class _Adopting:
    """What :func:`adopting_server` adds to ``uvicorn.Server`` (mixed in ahead of it, so
    ``super()`` is uvicorn's): adopt the connections dealt over ``_channel``."""

    _channel: socket.socket
    should_exit: bool
    config: Any
    server_state: Any
    lifespan: Any
    _reading = False
    _adopting: set[asyncio.Task[Any]]
    #: the clients (``scope["client"]``) whose connection closes after its next response
    _closing: set[Any]

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=[])  # type: ignore[misc]  # uvicorn.Server, mixed in after
        if self.should_exit:
            return
        self._adopting = set()
        self._closing = set()
        # outermost (ahead of uvicorn's proxy-headers middleware, which may rewrite the client);
        # protocols made from now on read it, and none was made before
        self.config.loaded_app = _CloseWhenMarked(self.config.loaded_app, self._closing)
        self._channel.setblocking(False)
        asyncio.get_running_loop().add_reader(self._channel.fileno(), self._take)
        self._reading = True

    def _protocol(self) -> Any:
        cfg = self.config
        protocol: Any = cfg.http_protocol_class  # as uvicorn's own startup makes it
        return protocol(config=cfg, server_state=self.server_state, app_state=self.lifespan.state)

    def _take(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                data, fds, _, _ = socket.recv_fds(self._channel, 16, 16)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data, fds = b"", []
            if not data and not fds:  # the engine's end closed
                self._stop_reading()
                return
            if data == REBALANCE and not fds:
                self._let_idle_go()
                continue
            if fds:
                self._adopt_all(loop, fds)

    def _adopt_all(self, loop: asyncio.AbstractEventLoop, fds: list[int]) -> None:
        try:  # taken: the dealer may drop its copies (see the module's docstring)
            self._channel.send(b"a" * len(fds))
        except OSError:
            pass
        for fd in fds:
            conn = socket.socket(fileno=fd)
            if self.should_exit:
                conn.close()
                continue
            conn.setblocking(False)
            task = loop.create_task(self._adopt(loop, conn))
            self._adopting.add(task)
            task.add_done_callback(self._adopting.discard)

    async def _adopt(self, loop: asyncio.AbstractEventLoop, conn: socket.socket) -> None:
        try:
            await loop.connect_accepted_socket(self._protocol, conn, ssl=self.config.ssl)
        except Exception as exc:  # a TLS handshake that failed, a client that left
            log.debug("front end: a dealt connection could not be served: %s", exc)
            conn.close()

    def _let_idle_go(self) -> None:
        # A connection mid-request finishes its response with keep-alive off (as uvicorn's
        # shutdown() does); one between requests is marked, so that its next response closes
        # it (see the module's docstring for why it is not closed at once).
        clients = set()
        for protocol in list(self.server_state.connections):
            cycle, client = getattr(protocol, "cycle", None), getattr(protocol, "client", None)
            if cycle is not None and not cycle.response_complete:
                cycle.keep_alive = False
            elif client is not None:
                clients.add(client)
            else:  # no address to know its next request by
                protocol.shutdown()
        self._closing.clear()  # marks of connections gone since the last rebalance
        self._closing.update(clients)

    def _stop_reading(self) -> None:
        if self._reading:
            self._reading = False
            try:
                asyncio.get_running_loop().remove_reader(self._channel.fileno())
            except (RuntimeError, ValueError):
                pass

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._stop_reading()
        for task in list(getattr(self, "_adopting", ())):
            task.cancel()
        await super().shutdown(sockets=sockets)  # type: ignore[misc]


class _CloseWhenMarked:
    """ASGI middleware: a response to a client in ``closing`` says ``Connection: close``
    (uvicorn then closes the connection after it) and the mark is spent."""

    def __init__(self, app: Any, closing: set[Any]) -> None:
        self.app, self.closing = app, closing

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        client = scope.get("client")
        if not self.closing or client not in self.closing or scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_closing(message: Any) -> None:
            if message["type"] == "http.response.start" and client in self.closing:
                self.closing.discard(client)
                message = {**message, "headers": [*message.get("headers", ()), (b"connection", b"close")]}
            await send(message)

        await self.app(scope, receive, send_closing)


def adopting_server(config: Any, channel: socket.socket) -> Any:
    """A ``uvicorn.Server`` for ``config`` that listens on nothing and serves the
    connections the engine deals it over ``channel``; run it with ``run(sockets=[])``.
    It stops adopting when it begins to shut down (a connection dealt after that is
    closed), then drains as uvicorn does."""
    import uvicorn

    class AdoptingServer(_Adopting, uvicorn.Server):
        pass

    server = AdoptingServer(config)
    server._channel = channel
    return server
