"""The connection under the apps: uvicorn's HTTP/1.1 protocol with a header timeout
(uvicorn waits for headers forever) and :class:`CoalescingTransport` (a response in one
write), and :func:`uvicorn_config`, uvicorn's settings for a :class:`ServeConfig`.
"""

from __future__ import annotations

import json
import socket
from typing import Any

from ..._extras import require
from ...errors import OrtBatchError
from ..config import ServeConfig

__all__ = ["MAX_HEADER_BYTES", "CoalescingTransport", "header_timeout_protocol", "uvicorn_config"]

#: most bytes of a request line and headers still incomplete (h11's own cap; over it: 400, closed)
MAX_HEADER_BYTES = 16 * 1024


def _httptools_available() -> bool:
    try:
        import httptools  # noqa: F401
    except ImportError:
        return False
    return True


def header_timeout_protocol(
    timeout_s: float,
    parser: str = "auto",
    first_byte_s: float | None = None,
    idle_per_address: int | None = None,
    body_timeout_s: float | None = None,
) -> type[Any]:
    """uvicorn's HTTP/1.1 protocol (httptools when installed, else h11; ``parser`` picks
    one), closing a connection whose request headers have not all arrived ``timeout_s``
    seconds after its first byte (or after it opened): uvicorn itself waits for headers
    forever, so a client sending a byte a second would hold its connection (and a file
    descriptor) as long as it likes. httptools (llhttp, in C) costs less CPU per request
    than h11 (pure Python). Headers still incomplete after :data:`MAX_HEADER_BYTES` are
    a 400 and a closed connection with either parser (h11 caps them the same way).
    A connection that has sent nothing yet is idle (:class:`_IdleConnections`): closed after
    ``first_byte_s``, at most ``idle_per_address`` per client address, and not counted
    toward uvicorn's ``limit_concurrency``. Nor is one whose request is still arriving (its
    first byte came, its last has not): its deadline counts from that first byte, ``timeout_s``
    for the headers and ``timeout_s + body_timeout_s`` for the whole request (the app's own
    body timeout answers 408 first; this closes what no route reads), so a client trickling
    a byte a second holds no place that a complete request needs."""
    if parser not in ("auto", "httptools", "h11"):
        raise OrtBatchError(f"the HTTP parser must be 'auto', 'httptools' or 'h11', got {parser!r}")
    if parser == "httptools" or (parser == "auto" and _httptools_available()):
        protocol = _httptools_protocol(timeout_s)
    else:
        protocol = _h11_protocol(timeout_s)
    # one class per server: its idle bookkeeping is that server's
    return type(
        protocol.__name__,
        (protocol,),
        {
            "_first_byte_s": first_byte_s,
            "_body_timeout_s": body_timeout_s,
            "_idle": _IdleConnections(idle_per_address),
        },
    )


def _has_sent(protocol: Any) -> bool:
    """Whether bytes from this connection's client wait in the kernel, not read yet (or it
    closed its end): a peek at a duplicate of the socket, which leaves them in place."""
    raw = protocol.transport.get_extra_info("socket")
    if raw is None:
        return False
    try:
        with socket.fromfd(raw.fileno(), raw.family, raw.type) as dup:
            dup.setblocking(False)
            dup.recv(1, socket.MSG_PEEK)
    except BlockingIOError:
        return False
    except OSError:
        return True  # reset or closed: nothing to keep it for either way
    return True


class _IdleConnections:
    """One server's connections that have not sent a byte yet, by client address (oldest
    first), and how many are still receiving a request (its first byte came, its last has
    not). Both are left out of uvicorn's ``limit_concurrency`` count (see
    ``_HeaderTimer.limit_concurrency``): otherwise a client opening connections that send
    nothing, or a byte a second, fills the limit, and every request, health checks
    included, is a 503. Neither is unbounded: each is closed at its deadline.

    Over ``per_address``, the address's oldest idle connection is closed, unless its client
    has in fact sent (the bytes are in the kernel, read on the loop's next turn: a health
    probe accepted in the same burst as many idle connections of its address); such a one
    is no longer idle, and the next oldest goes instead."""

    def __init__(self, per_address: int | None) -> None:
        self.per_address = per_address
        self.by_address: dict[Any, dict[Any, None]] = {}
        self.count = 0
        self.receiving = 0

    def add(self, address: Any, protocol: Any) -> None:
        idle = self.by_address.setdefault(address, {})
        idle[protocol] = None
        self.count += 1
        while self.per_address is not None and len(idle) > self.per_address:
            oldest = next(iter(idle))
            if _has_sent(oldest):
                oldest._leave_idle()  # its data_received comes next turn
                continue
            self.discard(address, oldest)
            oldest.transport.close()

    def discard(self, address: Any, protocol: Any) -> None:
        idle = self.by_address.get(address)
        if idle is not None and protocol in idle:
            del idle[protocol]
            self.count -= 1
            if not idle:
                del self.by_address[address]


class CoalescingTransport:
    """A transport whose writes made in one turn of the event loop leave in one send.

    uvicorn writes a response's status line and headers, then its body, each with its
    own ``write``: two system calls and, with TCP_NODELAY, two packets per response.
    Here the first write of a turn schedules a flush at the end of it, and the flush
    hands the joined bytes to the real transport; closing flushes first, aborting
    drops them. Everything else is the real transport's."""

    __slots__ = ("_loop", "_parts", "_transport")

    def __init__(self, transport: Any, loop: Any) -> None:
        self._transport = transport
        self._loop = loop
        self._parts: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not data:
            return
        if not self._parts:
            self._loop.call_soon(self.flush)
        self._parts.append(data)

    def writelines(self, lines: Any) -> None:
        for data in lines:
            self.write(data)

    def flush(self) -> None:
        """Hand what was written so far to the real transport."""
        parts, self._parts = self._parts, []
        if parts and not self._transport.is_closing():
            self._transport.write(parts[0] if len(parts) == 1 else b"".join(parts))

    def get_write_buffer_size(self) -> int:
        return int(self._transport.get_write_buffer_size()) + sum(len(p) for p in self._parts)

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        self._parts = []
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class _HeaderTimer:
    """The request deadlines, mixed in before one of uvicorn's protocols. A new connection
    has ``_first_byte_s`` to send its first byte; a request, from its first byte, has
    ``_timeout_s`` for its headers and ``_timeout_s + _body_timeout_s`` to arrive whole;
    past its deadline the connection is closed. While a request arrives the connection
    is counted as receiving (see :class:`_IdleConnections`). The protocol writes through
    a :class:`CoalescingTransport`."""

    _timeout_s = 10.0
    _header_timer: Any = None
    #: seconds to the first byte (None: the header timeout)
    _first_byte_s: float | None = None
    #: seconds, after the headers' deadline, the body has to arrive (None: no deadline)
    _body_timeout_s: float | None = None
    _idle: _IdleConnections | None = None
    #: this connection's client address while it is idle (has sent nothing)
    _idle_address: Any = None
    _is_idle = False
    #: loop time of the first byte of the request now arriving (None: none is)
    _request_start: float | None = None
    #: whether this connection is counted in ``_idle.receiving``
    _counted = False
    #: a request has arrived whole since ``_request_start`` (set by the parser's callback)
    _complete = False
    _limit: int | None = None
    loop: Any
    transport: Any

    # uvicorn answers 503 when len(connections) >= limit_concurrency: reading the limit
    # raised by the idle and receiving connections is what leaves them out of that count
    @property
    def limit_concurrency(self) -> int | None:
        if self._limit is None or self._idle is None:
            return self._limit
        return self._limit + self._idle.count + self._idle.receiving

    @limit_concurrency.setter
    def limit_concurrency(self, value: int | None) -> None:
        self._limit = value

    def _in_headers(self) -> bool:
        """A request has begun arriving and its headers have not ended."""
        raise NotImplementedError

    def _request_done(self) -> bool:
        """No request is arriving now (the last one arrived whole, or none began)."""
        raise NotImplementedError

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        # after uvicorn's own setup: its flow control keeps the real transport
        self.transport = CoalescingTransport(transport, self.loop)
        self._is_idle = True
        if self._idle is not None:
            peer = transport.get_extra_info("peername")
            self._idle_address = peer[0] if isinstance(peer, tuple) and peer else peer
            self._idle.add(self._idle_address, self)
        self._arm(self._first_byte_s or self._timeout_s)

    def data_received(self, data: bytes) -> None:
        self._leave_idle()
        if data:
            self._begin()
        super().data_received(data)  # type: ignore[misc]
        if self._request_done():
            self._end()

    def _begin(self) -> None:
        """A request's first byte: its deadlines count from now."""
        if self._request_start is None:
            self._disarm()  # the first-byte timer, or none
            self._request_start = self.loop.time()
            self._complete = False
            self._arm(self._timeout_s)
        if not self._counted and self._idle is not None:
            self._counted = True
            self._idle.receiving += 1

    def _end(self) -> None:
        """The request arrived whole (or the connection ended): no deadline, counted again."""
        if self._request_start is not None:
            self._request_start = None
            self._disarm()
        if self._counted and self._idle is not None:
            self._counted = False
            self._idle.receiving -= 1

    def _leave_idle(self) -> None:
        if self._is_idle:
            self._is_idle = False
            if self._idle is not None:
                self._idle.discard(self._idle_address, self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._leave_idle()
        self._end()
        self._disarm()
        super().connection_lost(exc)  # type: ignore[misc]

    def _arm(self, timeout_s: float) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(timeout_s, self._expire)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _expire(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        if self._request_start is None:
            if self._is_idle:
                self.transport.close()  # nothing sent within the first-byte timeout
            return
        if self._in_headers() or (self._body_timeout_s is not None and not self._request_done()):
            late = self._request_start + self._timeout_s + (self._body_timeout_s or 0.0) - self.loop.time()
            if self._in_headers() or late <= 0:
                self.transport.close()
                return
            self._header_timer = self.loop.call_later(late, self._expire)


def _h11_protocol(timeout_s: float) -> type[Any]:
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderTimeoutProtocol(_HeaderTimer, H11Protocol):
        _timeout_s = timeout_s

        def _in_headers(self) -> bool:
            # h11 keeps the bytes of headers still incomplete in its buffer
            return bool(self.conn.their_state is h11.IDLE and self.conn.trailing_data[0])

        def _request_done(self) -> bool:
            state = self.conn.their_state
            return state is not h11.SEND_BODY and not (state is h11.IDLE and self.conn.trailing_data[0])

    return HeaderTimeoutProtocol


def _httptools_protocol(timeout_s: float) -> type[Any]:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class HttpToolsHeaderTimeoutProtocol(_HeaderTimer, HttpToolsProtocol):
        _timeout_s = timeout_s
        # a request has begun (its first byte parsed) and its headers have not ended
        _in_header_lines = False
        # its headers ended, its body has not
        _in_body = False
        _header_bytes = 0

        def _in_headers(self) -> bool:
            # or bytes came that began no request yet (a request line not yet recognised)
            return self._in_header_lines or (not self._complete and not self._in_body)

        def _request_done(self) -> bool:
            return self._complete and not self._in_header_lines and not self._in_body

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._in_header_lines:
                # httptools buffers a header line until it ends: bound what it may hold
                self._header_bytes += len(data)
                if self._header_bytes > MAX_HEADER_BYTES and not self.transport.is_closing():
                    self.send_400_response(f"Request line and headers over {MAX_HEADER_BYTES} bytes.")

        def send_400_response(self, msg: str) -> None:
            # uvicorn answers what the parser refuses (an unknown method, a malformed
            # line, headers over the cap) in plain text; every error of this server is JSON
            body = json.dumps({"error": msg}).encode()
            head = [b"HTTP/1.1 400 Bad Request\r\n"]
            head += [name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers]
            head.append(
                b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(body)
            )
            self.transport.write(b"".join(head) + body)
            self.transport.close()

        # the parser's callbacks
        def on_message_begin(self) -> None:
            self._in_header_lines = True
            self._header_bytes = 0
            if self._request_start is None:  # a pipelined request after one that completed
                self._begin()
            super().on_message_begin()

        def on_headers_complete(self) -> None:
            self._in_header_lines = False
            self._in_body = True
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._in_body = False
            self._complete = True
            super().on_message_complete()

    return HttpToolsHeaderTimeoutProtocol


def uvicorn_config(app: Any, config: ServeConfig) -> Any:
    """uvicorn's settings for serving ``app`` as ``config`` says (TLS, timeouts, limits,
    and the header-timeout protocol writing through :class:`CoalescingTransport`)."""
    uvicorn = require("uvicorn")
    if (config.ssl_certfile is None) != (config.ssl_keyfile is None):
        raise OrtBatchError("TLS needs both --ssl-certfile and --ssl-keyfile")
    return uvicorn.Config(
        app,
        lifespan="on",
        log_level=config.log_level,
        access_log=config.access_log,
        timeout_graceful_shutdown=config.graceful_timeout_s,
        backlog=config.backlog,
        server_header=False,
        ssl_certfile=config.ssl_certfile,
        ssl_keyfile=config.ssl_keyfile,
        http=header_timeout_protocol(
            config.header_timeout_s,
            config.http_parser,
            config.first_byte_timeout_s,
            config.max_idle_per_address,
            config.body_timeout_s,
        ),
        timeout_keep_alive=config.keep_alive_s,
        limit_concurrency=config.limit_concurrency,
    )
