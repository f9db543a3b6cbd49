"""The connection under the apps: uvicorn's HTTP/1.1 protocol with a header timeout
(uvicorn waits for headers forever) and :class:`CoalescingTransport` (a response in one
write), and :func:`uvicorn_config`, uvicorn's settings for a :class:`ServeConfig`.
"""

from __future__ import annotations

import json
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


def header_timeout_protocol(timeout_s: float, parser: str = "auto") -> type[Any]:
    """uvicorn's HTTP/1.1 protocol (httptools when installed, else h11; ``parser`` picks
    one), closing a connection whose request headers have not all arrived ``timeout_s``
    seconds after its first byte (or after it opened): uvicorn itself waits for headers
    forever, so a client sending a byte a second would hold its connection (and a file
    descriptor) as long as it likes. httptools (llhttp, in C) costs less CPU per request
    than h11 (pure Python). Headers still incomplete after :data:`MAX_HEADER_BYTES` are
    a 400 and a closed connection with either parser (h11 caps them the same way)."""
    if parser not in ("auto", "httptools", "h11"):
        raise OrtBatchError(f"the HTTP parser must be 'auto', 'httptools' or 'h11', got {parser!r}")
    if parser == "httptools" or (parser == "auto" and _httptools_available()):
        return _httptools_protocol(timeout_s)
    return _h11_protocol(timeout_s)


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
    """The header timeout, mixed in before one of uvicorn's protocols: armed when a
    connection opens and whenever data leaves a request's headers incomplete, disarmed
    once they are complete; on expiry the connection is closed. The protocol writes
    through a :class:`CoalescingTransport`."""

    _timeout_s = 10.0
    _header_timer: Any = None
    loop: Any
    transport: Any

    def _headers_incomplete(self) -> bool:
        raise NotImplementedError

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        # after uvicorn's own setup: its flow control keeps the real transport
        self.transport = CoalescingTransport(transport, self.loop)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)  # type: ignore[misc]

    def _rearm(self) -> None:
        if self._headers_incomplete():
            self._arm()
        else:
            self._disarm()

    def _arm(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self._timeout_s, self._expire)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _expire(self) -> None:
        self._header_timer = None
        if self._headers_incomplete() and not self.transport.is_closing():
            self.transport.close()


def _h11_protocol(timeout_s: float) -> type[Any]:
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderTimeoutProtocol(_HeaderTimer, H11Protocol):
        _timeout_s = timeout_s

        def _headers_incomplete(self) -> bool:
            return bool(self.conn.their_state is h11.IDLE)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._rearm()

    return HeaderTimeoutProtocol


def _httptools_protocol(timeout_s: float) -> type[Any]:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class HttpToolsHeaderTimeoutProtocol(_HeaderTimer, HttpToolsProtocol):
        _timeout_s = timeout_s
        # a request has begun (its first byte parsed) and its headers have not ended
        _in_headers = False
        _header_bytes = 0

        def _headers_incomplete(self) -> bool:
            # or no request yet: the connection has sent nothing a request begins with
            return self._in_headers or self.cycle is None

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._in_headers:
                # httptools buffers a header line until it ends: bound what it may hold
                self._header_bytes += len(data)
                if self._header_bytes > MAX_HEADER_BYTES and not self.transport.is_closing():
                    self.send_400_response(f"Request line and headers over {MAX_HEADER_BYTES} bytes.")
                    return
            self._rearm()

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
            self._in_headers = True
            self._header_bytes = 0
            super().on_message_begin()

        def on_headers_complete(self) -> None:
            self._in_headers = False
            super().on_headers_complete()

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
        http=header_timeout_protocol(config.header_timeout_s, config.http_parser),
        timeout_keep_alive=config.keep_alive_s,
        limit_concurrency=config.limit_concurrency,
    )
