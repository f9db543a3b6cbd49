"""The HTTP plumbing every ortbatch app shares: the error mapping (:func:`error_response`,
the one place where exceptions become statuses), the route wrapper, body readers with
their size and time limits, disconnect handling, the middleware that counts and measures
requests, and :func:`assemble_app`, which builds a Starlette app from the routes of
what is served. The protocol apps (:mod:`~ortbatch.serve.http.kserve`,
:mod:`~ortbatch.serve.http.openai_api`) only contribute routes.

Errors: bad input 400 with the InvalidInputError text, unknown model 404, body too large
413, queue full 429 with Retry-After, deadline 504, closed 503. Routes under ``/v2`` answer
``{"error": "..."}`` (the protocol's form); routes under ``/v1`` answer OpenAI's
``{"error": {"message": ...}}`` so OpenAI clients show the message. Only a fault of the
server itself is a 500, and its body names a logged incident, never the exception.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import zlib
from collections.abc import Awaitable, Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ...errors import (
    InferenceError,
    InvalidInputError,
    ModelLoadFailedError,
    ModelNotFoundError,
    ModelUnavailableError,
    QueueFullError,
    RequestTimeoutError,
    RequestTooLargeError,
    SessionClosedError,
    UnsupportedError,
)
from ..config import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES
from ..metrics import ServerMetrics
from ..served.protocol import dumps_json

__all__ = [
    "STREAM_WRITE_TIMEOUT_S",
    "event_stream_response",
    "DEFAULT_BODY_TIMEOUT_S",
    "DEFAULT_MAX_BODY_BYTES",
    "AsgiEndpoint",
    "BodyLimits",
    "ClientGone",
    "FastRoutes",
    "HTTPError",
    "Incoming",
    "RequestCounts",
    "Reply",
    "RequestObserver",
    "asgi_route",
    "assemble_app",
    "disconnected",
    "error_reply",
    "error_response",
    "handled_route",
    "header",
    "json_response",
    "offload",
    "openai_error",
    "read_request_body",
    "receive_body",
    "run_or_abandon",
    "send_json",
    "send_reply",
]

log = logging.getLogger("ortbatch.serve")

# Bodies bigger than this are parsed/encoded off the event loop so one large request
# does not stall every other connection.
_OFFLOAD_BYTES = 1 << 20
_RETRY_AFTER_S = "1"
#: asyncio.timeout_at (Python 3.11+): a deadline over many awaits without a task for each
_timeout_at: Any = getattr(asyncio, "timeout_at", None)


@dataclass(frozen=True)
class BodyLimits:
    """How much of a request body a route reads, and how long it waits for it."""

    max_bytes: int = DEFAULT_MAX_BODY_BYTES
    #: the whole body must arrive within this (``None``: no limit)
    timeout_s: float | None = DEFAULT_BODY_TIMEOUT_S

    async def read(self, request: Any) -> bytes:
        """:func:`read_request_body` under these limits."""
        return await read_request_body(request, self.max_bytes, self.timeout_s)


class HTTPError(Exception):
    """An error answered with ``status`` (and optional headers)."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.headers = headers or {}


class ClientGone(Exception):
    """The client disconnected before its response was ready (answered as 499, the
    status nginx uses for it; nobody receives it)."""


async def disconnected(receive: Callable[[], Awaitable[MutableMapping[str, Any]]]) -> None:
    """Return once the client has gone (the body must already be read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def run_or_abandon(receive: Callable[[], Awaitable[MutableMapping[str, Any]]], coro: Awaitable[Any]) -> Any:
    """Await ``coro`` unless the client disconnects first: then cancel it, which drops
    its still-queued requests from the batch queue (no compute for a caller who left),
    and raise :class:`ClientGone`."""
    work = asyncio.ensure_future(coro)
    # the watcher cancels the work itself (cheaper per request than asyncio.wait on both)
    watch = asyncio.ensure_future(_cancel_when_gone(receive, work))
    try:
        return await work
    except asyncio.CancelledError:
        if watch.done() and not watch.cancelled() and watch.result():
            raise ClientGone("the client disconnected before the response was ready") from None
        work.cancel()  # this task was cancelled (e.g. a shutdown)
        raise
    finally:
        watch.cancel()


async def _cancel_when_gone(receive: Callable[[], Awaitable[MutableMapping[str, Any]]], work: Any) -> bool:
    try:
        await disconnected(receive)
    except Exception:  # the connection's receive failing: nobody to answer either
        pass
    return work.cancel()  # False if the work had finished meanwhile


@dataclass
class RequestCounts:
    """HTTP requests that reached the app (``accepted``) and that got a complete
    response (``answered``); after a graceful shutdown the two are equal."""

    accepted: int = 0
    answered: int = 0
    #: requests whose client left before the response was complete (a stream it
    #: abandoned, a request it stopped waiting for): settled, with nobody to answer
    abandoned: int = 0
    by_status: dict[int, int] = field(default_factory=dict)

    @property
    def settled(self) -> int:
        """Requests that need nothing more from the server (answered or abandoned)."""
        return self.answered + self.abandoned


# OpenAI's error types by status, so clients (and the openai package) classify them
_OPENAI_ERROR_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_exceeded",
    503: "service_unavailable",
    504: "timeout_error",
}


# errors of 500 and over whose message is the server's own answer, shown to the client
_ANSWERED_AS_IS = (InferenceError, SessionClosedError, RequestTimeoutError, ModelUnavailableError, UnsupportedError)


def error_response(exc: BaseException, openai: bool = False) -> tuple[int, dict[str, Any], dict[str, str]]:
    """Map an exception to ``(status, body, headers)``: the one place where errors
    become HTTP answers."""
    headers: dict[str, str] = {}
    if isinstance(exc, ClientGone) or type(exc).__name__ == "ClientDisconnect":
        status = 499
    elif isinstance(exc, HTTPError):
        status, headers = exc.status, dict(exc.headers)
    elif isinstance(exc, RequestTooLargeError):
        status = 413
    elif isinstance(exc, (InvalidInputError, ModelLoadFailedError)):
        status = 400
    elif isinstance(exc, ModelNotFoundError):
        status = 404
    elif isinstance(exc, ModelUnavailableError):
        status = 503
    elif isinstance(exc, UnsupportedError):
        status = 501
    elif isinstance(exc, QueueFullError):
        status, headers = 429, {"Retry-After": _RETRY_AFTER_S}
    elif isinstance(exc, RequestTimeoutError):
        status = 504
    elif isinstance(exc, SessionClosedError):
        status = 503
    elif isinstance(exc, InferenceError):
        status = 500
    else:
        status = 500
    if status == 499:
        return status, {"error": "client disconnected"}, headers
    # an HTTPError's message is the server's own answer, as is a 503 naming an unloaded model
    if status < 500 or isinstance(exc, (*_ANSWERED_AS_IS, HTTPError)):
        message = str(exc)
    else:  # a fault of the server itself: logged in full, never echoed to the client
        incident = secrets.token_hex(4)
        log.error("internal error %s", incident, exc_info=exc)
        message = f"internal server error (logged as incident {incident})"
    if openai:
        return status, openai_error(status, message, getattr(exc, "input_name", None)), headers
    return status, {"error": message}, headers


def openai_error(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error body (``{"error": {"message", "type", "param", "code"}}``), which
    the ``openai`` package reads into its exceptions' ``message``, ``type`` and ``param``."""
    kind = _OPENAI_ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


#: seconds one write of a streamed answer may wait for the client to take bytes: a client that
#: stopped reading (its socket full) has its stream cut, its requests cancelled and its
#: connection closed, instead of holding them (and a graceful shutdown) for as long as it likes
STREAM_WRITE_TIMEOUT_S = 15.0


def event_stream_response(
    events: Any, *, on_stall: Callable[[], None] | None = None, headers: dict[str, str] | None = None
) -> Any:
    """A ``text/event-stream`` Starlette ``StreamingResponse`` of ``events`` whose every write
    gives up after :data:`STREAM_WRITE_TIMEOUT_S`: then ``on_stall()`` (cancel the stream's
    requests), the events are closed, and the app returns unfinished, which uvicorn answers by
    closing the connection."""
    from starlette.responses import StreamingResponse

    timeout_s = STREAM_WRITE_TIMEOUT_S

    class _Stalled(Exception):
        pass

    class BoundedWrites(StreamingResponse):
        async def stream_response(self, send: Any) -> None:
            async def write(message: Any) -> None:
                try:
                    await asyncio.wait_for(send(message), timeout_s)
                except asyncio.TimeoutError:
                    raise _Stalled from None

            try:
                await super().stream_response(write)
            except _Stalled:
                log.warning("a stream's client took no bytes for %g s: its requests are cancelled", timeout_s)
                if on_stall is not None:
                    on_stall()
                close = getattr(self.body_iterator, "aclose", None)
                if close is not None:
                    await close()

    return BoundedWrites(events, media_type="text/event-stream", headers=headers)


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Any:
    """A compact JSON ``starlette.responses.Response`` (strict JSON: no NaN/Infinity)."""
    from starlette.responses import Response

    return Response(
        dumps_json(body),
        status_code=status,
        media_type="application/json",
        headers=headers,
    )


async def read_request_body(
    request: Any, max_body_bytes: int, timeout_s: float | None = DEFAULT_BODY_TIMEOUT_S
) -> bytes:
    """The body of ``request`` (a Starlette ``Request`` or an :class:`Incoming`):
    :func:`receive_body` over its scope and ``receive``."""
    return await receive_body(request.scope, request.receive, max_body_bytes, timeout_s)


def header(scope: MutableMapping[str, Any], name: bytes) -> str | None:
    """The first value of header ``name`` (lower case) in an ASGI ``scope``, or None."""
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value).decode("latin-1")
    return None


async def receive_body(
    scope: MutableMapping[str, Any],
    receive: Callable[[], Awaitable[MutableMapping[str, Any]]],
    max_body_bytes: int,
    timeout_s: float | None = DEFAULT_BODY_TIMEOUT_S,
) -> bytes:
    """The request body, decompressed (gzip/deflate), at most ``max_body_bytes`` (else
    413), all of it within ``timeout_s`` seconds (else 408: a client sending a byte a
    second must not hold a connection and its buffer forever); a client that leaves
    first raises :class:`ClientGone`. Reads the ASGI ``receive`` itself."""
    declared = header(scope, b"content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise HTTPError(400, f"invalid Content-Length {declared[:40]!r}") from None
        if size > max_body_bytes:
            raise HTTPError(413, f"request body of {size} bytes exceeds the limit of {max_body_bytes}")
    parts: list[bytes] = []
    received = 0

    async def take_all() -> None:
        nonlocal received
        while True:
            message = await receive()
            if message["type"] != "http.request":  # http.disconnect
                raise ClientGone("the client disconnected before its request body was complete")
            chunk = message.get("body", b"")
            if chunk:
                received += len(chunk)
                if received > max_body_bytes:
                    raise HTTPError(413, f"request body exceeds the limit of {max_body_bytes} bytes")
                parts.append(chunk)
            if not message.get("more_body", False):
                return

    try:
        if timeout_s is None:
            await take_all()
        elif _timeout_at is not None:  # one deadline over the whole body, no task per chunk
            async with _timeout_at(asyncio.get_running_loop().time() + timeout_s):
                await take_all()
        else:  # Python 3.10
            await asyncio.wait_for(take_all(), timeout_s)
    except asyncio.TimeoutError:
        message = f"the request body did not arrive within {timeout_s:g} s"
        raise HTTPError(408, message, {"Connection": "close"}) from None
    data = parts[0] if len(parts) == 1 else b"".join(parts)
    # every Content-Encoding field counts, as one list (RFC 9110 5.3: "identity" then
    # "gzip" in two fields is "identity, gzip": a gzip body, not a plain one)
    listed = b",".join(bytes(v) for k, v in scope["headers"] if k == b"content-encoding").decode("latin-1")
    codings = [c for c in (c.strip().lower() for c in listed.split(",")) if c not in ("", "identity")]
    if not codings:
        return bytes(data)
    encoding = codings[0]
    if len(codings) > 1 or encoding not in ("gzip", "deflate"):
        raise HTTPError(415, f"unsupported Content-Encoding {listed[:40]!r}; use one of gzip, deflate or none")
    # bounded decompression: a small compressed body must not inflate past the limit
    d = zlib.decompressobj(wbits=31 if encoding == "gzip" else 15)
    try:
        out = d.decompress(data, max_body_bytes + 1)
    except zlib.error as exc:
        raise HTTPError(400, f"body is not valid {encoding} data: {exc}") from None
    if len(out) > max_body_bytes or d.unconsumed_tail:
        raise HTTPError(413, f"decompressed request body exceeds the limit of {max_body_bytes} bytes")
    if not d.eof:
        raise HTTPError(400, f"body is truncated {encoding} data")
    return out


async def offload(size: int, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, in a thread when ``size`` (bytes to parse or encode) is large, so one
    big request does not stall every other connection."""
    if size > _OFFLOAD_BYTES:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


def handled_route(path: str, handler: Callable[[Any], Awaitable[Any]], method: str) -> Any:
    """A Starlette ``Route`` whose errors become answers through :func:`error_response`
    (OpenAI's error shape under ``/v1/``), labelled with ``path`` for the metrics."""
    from starlette.routing import Route

    openai = path.startswith("/v1/")

    async def endpoint(request: Any) -> Any:
        request.scope["ortbatch.endpoint"] = path
        try:
            return await handler(request)
        except Exception as exc:
            status, body, headers = error_response(exc, openai)  # logs a fault of the server
            return json_response(body, status, headers)

    return Route(path, endpoint, methods=[method])


class Incoming(NamedTuple):
    """What an :func:`asgi_route` handler gets of its request: the ASGI scope and
    ``receive`` (all that :func:`read_request_body` uses of a Starlette ``Request``)."""

    scope: MutableMapping[str, Any]
    receive: Callable[[], Awaitable[MutableMapping[str, Any]]]

    @property
    def path_params(self) -> dict[str, Any]:
        """The route's path parameters (set when the route matched)."""
        params: dict[str, Any] = self.scope["path_params"]
        return params

    def header(self, name: str) -> str | None:
        """The first value of header ``name`` (any case), or None."""
        return header(self.scope, name.lower().encode("latin-1"))


class Reply(NamedTuple):
    """An answer of an :func:`asgi_route` handler: the body, its media type and any
    further headers (and the status, 200 unless told)."""

    body: bytes
    media_type: str
    headers: Mapping[str, str] | None = None
    status: int = 200


async def send_reply(send: Callable[[dict[str, Any]], Awaitable[None]], reply: Reply) -> None:
    """Answer ``reply`` through a bare ASGI ``send``, as a Starlette ``Response`` would."""
    head = [(b"content-length", b"%d" % len(reply.body)), (b"content-type", reply.media_type.encode("latin-1"))]
    if reply.headers:
        head += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in reply.headers.items()]
    await send({"type": "http.response.start", "status": reply.status, "headers": head})
    await send({"type": "http.response.body", "body": reply.body})


def error_reply(exc: BaseException, openai: bool = False) -> Reply:
    """:func:`error_response` as a JSON :class:`Reply` (logs a fault of the server)."""
    status, body, headers = error_response(exc, openai)
    return Reply(dumps_json(body), "application/json", headers, status)


def asgi_route(path: str, handler: Callable[[Incoming], Awaitable[Reply]], method: str) -> Any:
    """A route for the requests that carry the traffic: ``handler(request)`` gets an
    :class:`Incoming` and answers a :class:`Reply`, with no Starlette ``Request`` or
    ``Response`` built, and :func:`assemble_app` matches it ahead of Starlette's
    middleware and router (:class:`FastRoutes`); its errors become answers through
    :func:`error_response` as :func:`handled_route`'s do."""
    openai = path.startswith("/v1/")

    async def app(scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        scope["ortbatch.endpoint"] = path
        try:
            reply = await handler(Incoming(scope, receive))
        except Exception as exc:
            reply = error_reply(exc, openai)
        await send_reply(send, reply)

    from starlette.routing import Route

    return Route(path, AsgiEndpoint(app), methods=[method])


class AsgiEndpoint:
    """A bare ASGI callable as a route's endpoint: Starlette passes a class instance the
    raw scope (a plain function would be called as a request handler), and
    :func:`assemble_app` matches such routes ahead of Starlette's middleware
    (:class:`FastRoutes`)."""

    def __init__(self, fn: Callable[[MutableMapping[str, Any], Any, Any], Awaitable[None]]) -> None:
        self.fn = fn

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self.fn(scope, receive, send)


class FastRoutes:
    """ASGI: a request that fully matches one of ``routes`` (Starlette routes over an
    :class:`AsgiEndpoint`) goes straight to that endpoint, past Starlette's middleware
    and router, which cost about as much as a small request's own work; everything
    else, and whatever only partly matches (a wrong method: Starlette's 405), goes to
    ``app``, which has the same routes, so the answers are the same either way. The
    routes are tried before ``app``'s others: none may match a path an earlier route
    of ``app`` would take."""

    def __init__(self, app: Any, routes: Sequence[Any]) -> None:
        from starlette.routing import Match

        self.app = app
        self.state = app.state
        self.routes = list(routes)
        self._full = Match.FULL

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            for route in self.routes:
                match, child = route.matches(scope)
                if match is self._full:
                    scope.update(child)
                    await route.endpoint(scope, receive, send)
                    return
        await self.app(scope, receive, send)


def assemble_app(
    routes: list[Any],
    served: Any,
    metrics: ServerMetrics,
    *,
    close_on_shutdown: bool = True,
    docs: Callable[[list[Any]], list[Any]] | None = None,
) -> Any:
    """The Starlette app over ``routes`` (from :func:`handled_route` or :func:`asgi_route`)
    plus the routes every server has (health, ``/v1/models``, ``/metrics``) and, when
    ``docs`` is given, those it makes from the app's whole route list (the API's
    description, :mod:`.openapi`), wrapped in
    :class:`RequestObserver` (and, when some routes are bare ASGI, :class:`FastRoutes`,
    which answers those before Starlette does): JSON 404/405 for unknown routes, and
    ``served.close(drain=True)`` on lifespan shutdown (unless ``close_on_shutdown`` is
    false). ``served`` needs ``name``, ``ready`` and ``close``.

    ``app.state.counts`` is the :class:`RequestCounts`, ``app.state.metrics`` ``metrics``."""
    counts = RequestCounts()
    from contextlib import asynccontextmanager

    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.responses import Response

    async def live(request: Any) -> Any:
        return json_response({"live": True})

    async def ready(request: Any) -> Any:
        if served.ready:
            return json_response({"ready": True})
        return json_response({"error": "the server is shutting down"}, 503)

    def model_ids() -> list[str]:
        # a repository (a ``loaded()`` method) serves the models loaded now, else the one export
        loaded = getattr(served, "loaded", None)
        return [name for name, _ in loaded()] if callable(loaded) else [served.name]

    def model_object(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": 0, "owned_by": "ortbatch"}

    async def list_models(request: Any) -> Any:
        return json_response({"object": "list", "data": [model_object(served.name)]})

    async def retrieve_model(request: Any) -> Any:
        # OpenAI's GET /v1/models/{model} (the openai client's models.retrieve)
        name = request.path_params["name"]
        ids = model_ids()
        if name not in ids:
            raise ModelNotFoundError(f"unknown model {name[:80]!r}; this server serves {', '.join(map(repr, ids))}")
        return json_response(model_object(name))

    async def prometheus(request: Any) -> Any:
        # off the event loop: a collector may wait (over --frontends, for the engine's stats)
        data, ctype = await asyncio.to_thread(metrics.render)
        return Response(data, headers={"Content-Type": ctype})

    routes = [
        *routes,  # first: Starlette tries routes in order, and these take the traffic
        handled_route("/v2/health/live", live, "GET"),
        handled_route("/v2/health/ready", ready, "GET"),
        handled_route("/v1/models", list_models, "GET"),
        handled_route("/v1/models/{name}", retrieve_model, "GET"),
        handled_route("/metrics", prometheus, "GET"),
    ]
    if docs is not None:
        routes += docs(routes)  # the list itself: the description reads what is mounted

    async def http_exception(request: Any, exc: Exception) -> Any:
        assert isinstance(exc, HTTPException)
        message = {404: f"no route {request.url.path!r}", 405: f"method {request.method} not allowed"}.get(
            exc.status_code, str(exc.detail)
        )
        # under /v1/ OpenAI's shape, as the routes' own errors there (an OpenAI client shows the message)
        doc = openai_error(exc.status_code, message) if request.url.path.startswith("/v1/") else {"error": message}
        return json_response(doc, exc.status_code, dict(exc.headers or {}))

    @asynccontextmanager
    async def lifespan(app: Any) -> Any:
        yield
        if close_on_shutdown:
            # close() joins the workers after draining; keep the loop free meanwhile
            await asyncio.to_thread(served.close, True)

    app = Starlette(routes=routes, exception_handlers={HTTPException: http_exception}, lifespan=lifespan)
    app.state.model = served
    app.state.metrics = metrics
    app.state.counts = counts
    fast = [r for r in routes if isinstance(getattr(r, "endpoint", None), AsgiEndpoint)]
    return RequestObserver(FastRoutes(app, fast) if fast else app, metrics, counts)


async def send_json(
    send: Callable[[dict[str, Any]], Awaitable[None]],
    status: int,
    doc: Any,
    headers: Sequence[tuple[bytes, bytes]] = (),
) -> None:
    """Answer ``doc`` as JSON through a bare ASGI ``send`` (for middleware, below the
    routes' :func:`json_response`)."""
    body = dumps_json(doc)
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body})


# The only HTTP methods that become metric labels; anything a client invents is "other",
# so no client can grow the number of series.
_KNOWN_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH"})


class RequestObserver:
    """ASGI middleware: request counts, metrics by route template and known method, and
    a last-resort JSON 500 (never a bare connection drop) for errors outside the
    handlers. A client that leaves before its response is complete counts as
    abandoned (settled), not as a request the server failed to answer."""

    def __init__(self, app: Any, metrics: ServerMetrics, counts: RequestCounts) -> None:
        self.app = app
        self.state = app.state
        self.metrics = metrics
        self.counts = counts

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        self.counts.accepted += 1
        self.metrics.in_flight.inc()
        status = 500
        response_started = False
        complete = False
        gone = False

        async def observed_receive() -> Any:
            nonlocal gone
            message = await receive()
            if message["type"] == "http.disconnect":
                gone = True
            return message

        async def observed_send(message: dict[str, Any]) -> None:
            nonlocal status, response_started, complete, gone
            if message["type"] == "http.response.start":
                status = message["status"]
                response_started = True
            try:
                await send(message)
            except OSError:  # ASGI 2.4: sending to a client that left
                gone = True
                raise
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                complete = True

        try:
            await self.app(scope, observed_receive, observed_send)
        except Exception as exc:
            if gone or type(exc).__name__ == "ClientDisconnect":
                gone = True  # a stream whose client left: nothing to answer, nothing to log
                return
            incident = secrets.token_hex(4)
            log.exception("unhandled error, incident %s", incident)
            if not response_started:
                message = f"internal server error (logged as incident {incident})"
                # the shape of the route's other errors: OpenAI's under /v1/
                openai = str(scope.get("path", "")).startswith("/v1/")
                await send_json(observed_send, 500, openai_error(500, message) if openai else {"error": message})
        finally:
            self.metrics.in_flight.dec()
            endpoint = scope.get("ortbatch.endpoint", "unmatched")
            method = scope.get("method", "")
            self.metrics.observe(endpoint, method if method in _KNOWN_METHODS else "other", status, started)
            if complete:
                self.counts.answered += 1
                self.counts.by_status[status] = self.counts.by_status.get(status, 0) + 1
            elif gone:
                self.counts.abandoned += 1
