"""The KServe v2 ``inference.GRPCInferenceService`` over one
:class:`~ortbatch.serve.served.model.ServedModel` or every model of a
:class:`~ortbatch.serve.served.repository.ModelRepository`: ServerLive/Ready, ModelReady,
ServerMetadata, ModelMetadata, ModelConfig (as Triton answers it), ModelInfer, the
bidirectional ModelStreamInfer and, for a repository, RepositoryIndex,
RepositoryModelLoad and RepositoryModelUnload, on a grpcio asyncio server.

Requests go to the model's one BatchedSession, so gRPC callers are batched together
with HTTP and in-process ones. Errors map to status codes at one place,
:func:`status_for`, the way Triton maps them: bad input INVALID_ARGUMENT, unknown
model NOT_FOUND, queue full RESOURCE_EXHAUSTED, deadline DEADLINE_EXCEEDED, shutting
down or a model not loaded UNAVAILABLE, a missing or wrong API key UNAUTHENTICATED,
an RPC this server or model does not serve UNIMPLEMENTED; INTERNAL only for a fault of
the model run or of the server itself. The rest of Triton's service (statistics, shared
memory, trace, log settings) answers UNIMPLEMENTED.

Every answered request is counted in the server's ``/metrics`` (``ortbatch_grpc_*``,
:class:`~ortbatch.serve.metrics.GrpcMetrics`) when the server is given the HTTP side's
:class:`~ortbatch.serve.metrics.ServerMetrics`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import secrets
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ... import __version__
from ..._extras import require
from ...errors import (
    InferenceError,
    InvalidInputError,
    ModelLoadFailedError,
    ModelNotFoundError,
    ModelUnavailableError,
    OrtBatchError,
    QueueFullError,
    RequestTimeoutError,
    SessionClosedError,
    UnsupportedError,
)
from ..auth import ApiKey
from ..metrics import GrpcMetrics, ServerMetrics
from ..served.decoupled import FINAL_RESPONSE, GenerationModel
from ..served.generator import ServedGenerator
from ..served.model import ServedModel
from ..served.repository import ModelRepository
from ..tracing import Tracing, active, traced_request
from .codec import decode_infer_request, encode_infer_response, parameters
from .routing import router_for
from .schema import PACKAGE, SERVICE, message

__all__ = ["GrpcCounts", "GrpcServer", "InferenceServicer", "ResponseTooLargeError", "status_for"]

log = logging.getLogger("ortbatch.serve")

#: RPCs that answer without an API key, like HTTP's /v2/health/live and /ready.
OPEN_METHODS = frozenset({"ServerLive", "ServerReady"})


@dataclass
class GrpcCounts:
    """ModelInfer/ModelStreamInfer requests received and answered (an answer may be an
    error status); equal after a graceful stop."""

    accepted: int = 0
    answered: int = 0


#: longest status message sent (in UTF-8 bytes): it travels in the trailers, non-ASCII bytes
#: percent-encoded (three each), and a client takes 8 KiB of metadata by default; a longer one
#: (a 100 kB model name echoed) reached the client as RESOURCE_EXHAUSTED "Stream removed"
MAX_DETAILS_BYTES = 2000


def status_for(exc: BaseException) -> tuple[Any, str]:
    """``(grpc.StatusCode, message)`` for an exception: the one place where errors
    become gRPC statuses (the message cut to :data:`MAX_DETAILS_BYTES`)."""
    code, text = _status_for(exc)
    if len(text.encode("utf-8", "replace")) > MAX_DETAILS_BYTES:
        cut = text.encode("utf-8", "replace")[: MAX_DETAILS_BYTES - 3].decode("utf-8", "ignore")
        text = cut + "..."
    return code, text


def _status_for(exc: BaseException) -> tuple[Any, str]:
    grpc = require("grpc", "serve")
    code = grpc.StatusCode
    if isinstance(exc, ResponseTooLargeError):
        return code.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, (InvalidInputError, ModelLoadFailedError)):
        return code.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, ModelNotFoundError):
        return code.NOT_FOUND, str(exc)
    if isinstance(exc, ModelUnavailableError):
        return code.UNAVAILABLE, str(exc)
    if isinstance(exc, QueueFullError):
        return code.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, RequestTimeoutError):
        return code.DEADLINE_EXCEEDED, str(exc)
    if isinstance(exc, SessionClosedError):
        return code.UNAVAILABLE, str(exc)
    if isinstance(exc, UnsupportedError):
        return code.UNIMPLEMENTED, str(exc)
    if isinstance(exc, InferenceError):
        return code.INTERNAL, str(exc)
    # a fault of the server itself: as over HTTP (http.plumbing.error_response), logged in
    # full with an incident id and never echoed to the client
    incident = secrets.token_hex(4)
    log.error("internal error %s", incident, exc_info=exc)
    return code.INTERNAL, f"internal server error (logged as incident {incident})"


#: bytes an answer may take beyond its tensors' (names, shapes, datatypes, ids) before it is
#: measured against the message limit
_MEASURE_SLACK = 1 << 20


class ResponseTooLargeError(OrtBatchError):
    """An answer over the server's message limit: RESOURCE_EXHAUSTED, as grpcio itself
    would answer it, but found before the write, so that on a ModelStreamInfer stream it
    is that request's ``error_message`` and not the end of the stream."""


class InferenceServicer:
    """The service's handlers (``await servicer.ModelInfer(request, context)``).

    Args:
        model: a ServedModel (and its ``{name}_text`` entry), or a ModelRepository whose
            models are reached by the request's model name (and version).
        metrics: where each request of a ModelStreamInfer stream is counted (the unary
            RPCs are counted by the server's handlers).
        max_message_bytes: the server's largest message: an inference answer over it is
            refused with :class:`ResponseTooLargeError` (None: no check).
    """

    def __init__(
        self,
        model: ServedModel | ServedGenerator | ModelRepository,
        metrics: GrpcMetrics | None = None,
        max_message_bytes: int | None = None,
    ) -> None:
        self.model = model
        self.router = router_for(model)
        self.metrics = metrics
        self.counts = GrpcCounts()
        self.max_message_bytes = max_message_bytes
        #: set (on the server's loop) when the server stops: an open ModelStreamInfer stream
        #: then takes no more requests, so an idle one does not hold the stop for its grace
        self.stopping: asyncio.Event | None = None

    def _fits(self, response: Any, outputs: Sequence[tuple[str, np.ndarray]], request_id: str | None) -> Any:
        """``response`` (carrying ``outputs`` and the request's id), or ResponseTooLargeError
        when grpcio would refuse to send it."""
        limit = self.max_message_bytes
        if limit is None:
            return response
        # upb's ByteSize serializes the whole message (slower than sending it): the tensors'
        # bytes and the id are nearly all of an answer, so only one near the limit is measured
        known = sum(a.nbytes for _, a in outputs) + len((request_id or "").encode("utf-8", "replace"))
        if all(a.dtype.kind not in "OSU" for _, a in outputs) and known + _MEASURE_SLACK < limit:
            return response
        if (size := response.ByteSize()) > limit:
            raise ResponseTooLargeError(
                f"the answer is {size} bytes, over this server's gRPC message limit of {limit} bytes "
                "(--max-body-bytes): ask for fewer rows or outputs per request"
            )
        return response

    # -- health and metadata ------------------------------------------------------------
    async def ServerLive(self, request: Any, context: Any) -> Any:
        return message("ServerLiveResponse")(live=True)

    async def ServerReady(self, request: Any, context: Any) -> Any:
        return message("ServerReadyResponse")(ready=self.router.ready)

    async def ModelReady(self, request: Any, context: Any) -> Any:
        return message("ModelReadyResponse")(ready=self.router.model_ready(request.name, request.version))

    async def ServerMetadata(self, request: Any, context: Any) -> Any:
        return message("ServerMetadataResponse")(
            name="ortbatch", version=__version__, extensions=list(self.router.extensions)
        )

    async def ModelMetadata(self, request: Any, context: Any) -> Any:
        from google.protobuf import json_format

        with self.router.hold(request.name, request.version) as m:
            doc = m.metadata()
        return json_format.ParseDict(doc, message("ModelMetadataResponse")(), ignore_unknown_fields=True)

    async def ModelConfig(self, request: Any, context: Any) -> Any:
        from google.protobuf import json_format

        with self.router.hold(request.name, request.version) as m:
            doc = m.triton_config()
        response = message("ModelConfigResponse")()
        json_format.ParseDict(doc, response.config, ignore_unknown_fields=True)
        return response

    # -- model repository ---------------------------------------------------------------
    @staticmethod
    def _check_repository_name(request: Any) -> None:
        if request.repository_name:  # as Triton answers it
            raise UnsupportedError(
                f"'repository_name' specification is not supported (got {request.repository_name!r}): "
                "this server has one repository"
            )

    async def RepositoryIndex(self, request: Any, context: Any) -> Any:
        self._check_repository_name(request)
        response = message("RepositoryIndexResponse")()
        for item in self.router.index(request.ready):
            response.models.add(
                name=item["name"], version=item.get("version", ""), state=item["state"], reason=item["reason"]
            )
        return response

    async def RepositoryModelLoad(self, request: Any, context: Any) -> Any:
        self._check_repository_name(request)
        await self.router.load(_model_name(request), parameters(request.parameters))
        return message("RepositoryModelLoadResponse")()

    async def RepositoryModelUnload(self, request: Any, context: Any) -> Any:
        self._check_repository_name(request)
        await self.router.unload(_model_name(request), parameters(request.parameters))
        return message("RepositoryModelUnloadResponse")()

    # -- inference ----------------------------------------------------------------------
    async def _infer(self, request: Any) -> Any:
        with self.router.hold(request.model_name, request.model_version) as m:
            req = decode_infer_request(request)
            outputs = await m.infer(req)
            return self._fits(encode_infer_response(m.name, m.version, outputs, req.id), outputs, req.id)

    async def ModelInfer(self, request: Any, context: Any) -> Any:
        self.counts.accepted += 1
        try:
            return await self._infer(request)
        finally:
            self.counts.answered += 1

    async def _responses(self, request: Any) -> AsyncGenerator[Any, None]:
        """The stream responses to one request: one for a tensor model; one per piece of
        text for a generation export (a decoupled model, :mod:`.generation`). The model
        is held (a repository's unload waits) until the last one is written."""
        stream_response = message("ModelStreamInferResponse")
        with self.router.hold(request.model_name, request.model_version) as m:
            req = decode_infer_request(request)
            if not isinstance(m, GenerationModel):
                outputs = await m.infer(req)
                response = encode_infer_response(m.name, m.version, outputs, req.id)
                yield self._fits(stream_response(infer_response=response), outputs, req.id)
                return
            async for outputs, final in m.stream(req):
                response = encode_infer_response(m.name, m.version, outputs, req.id)
                response.parameters[FINAL_RESPONSE].bool_param = final
                yield self._fits(stream_response(infer_response=response), outputs, req.id)

    async def ModelStreamInfer(self, requests: AsyncIterator[Any], context: Any) -> None:
        """Each request of the stream runs as soon as it arrives (so they batch
        together); each answer, or its error in ``error_message``, is written as it
        is ready, carrying the request's ``id``. A bad request does not end the stream."""
        write_lock = asyncio.Lock()
        tasks: set[asyncio.Task[None]] = set()

        async def write(response: Any) -> None:
            try:
                async with write_lock:
                    await context.write(response)
            except Exception as exc:  # the stream is gone: nothing more can be answered on it
                raise _StreamGone() from exc

        async def one(request: Any) -> None:
            started = time.perf_counter()
            code = "OK"
            if self.metrics is not None:
                self.metrics.in_flight.inc()
            error = None
            try:
                async with contextlib.aclosing(self._responses(request)) as responses:
                    async for response in responses:
                        await write(response)
            except _StreamGone:
                code = "CANCELLED"
                raise
            except Exception as exc:
                status, text = status_for(exc)
                code = status.name
                _log_internal(exc)
                error = message("ModelStreamInferResponse")(
                    error_message=text,
                    infer_response=message("ModelInferResponse")(
                        model_name=request.model_name, model_version=request.model_version, id=request.id
                    ),
                )
            except asyncio.CancelledError:
                code = "CANCELLED"
                raise
            finally:
                if self.metrics is not None:
                    self.metrics.in_flight.dec()
                    self.metrics.observe("ModelStreamInfer", code, started)
                self.counts.answered += 1  # last: once equal to accepted, all is recorded
            if error is not None:
                await write(error)

        iterator = requests.__aiter__()
        stop = asyncio.ensure_future(self.stopping.wait()) if self.stopping is not None else None
        try:
            while (request := await _next_request(iterator, stop)) is not _END:
                if request is _STOPPING:
                    # the server is stopping: what this stream asked is answered, then it ends
                    # with UNAVAILABLE (a request its client sends from now on is not read),
                    # where an idle stream used to hold the stop for the whole grace period
                    if tasks:
                        await asyncio.gather(*tasks)
                    raise SessionClosedError("the server is shutting down: this stream takes no more requests")
                self.counts.accepted += 1
                task = asyncio.ensure_future(one(request))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            if tasks:
                await asyncio.gather(*tasks)
        except _StreamGone:
            pass  # the client closed the stream: its other requests are cancelled below
        except Exception:
            # refused as a whole (a frame that does not parse): the handler aborts the call
            # next. A write of an earlier answer may be in progress: cancelling it midway, or
            # aborting during it, left the call hung until the client's deadline. So let it
            # finish (the lock), then stop the other requests before they write again.
            async with write_lock:
                for task in tasks:
                    task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        finally:
            for task in tasks:
                task.cancel()
            if stop is not None:
                stop.cancel()


class _StreamGone(Exception):
    """Writing to the stream failed: its client is gone."""


#: the grace that stands for "no limit" (grpcio's own None aborts every RPC at once)
_WAIT_FOR_ALL_S = 10.0 * 365 * 24 * 3600

#: what :func:`_next_request` answers at the end of a stream, and once the server stops
_END, _STOPPING = object(), object()


async def _next_request(iterator: AsyncIterator[Any], stop: asyncio.Future[Any] | None) -> Any:
    """The stream's next request; :data:`_END` when its client has closed it;
    :data:`_STOPPING` once ``stop`` is done (the server stopping) before one arrives."""
    if stop is None:
        try:
            return await iterator.__anext__()
        except StopAsyncIteration:
            return _END
    if stop.done():
        return _STOPPING
    read = asyncio.ensure_future(iterator.__anext__())
    await asyncio.wait((read, stop), return_when=asyncio.FIRST_COMPLETED)
    if not read.done():
        read.cancel()
        await asyncio.gather(read, return_exceptions=True)
        return _STOPPING
    try:
        return read.result()  # arrived as the stop came: it is answered
    except StopAsyncIteration:
        return _END


def _model_name(request: Any) -> str:
    if not request.model_name:
        raise InvalidInputError("'model_name' must be a non-empty string")
    return str(request.model_name)


def _log_internal(exc: BaseException) -> None:
    if not isinstance(exc, (OrtBatchError, asyncio.CancelledError)):
        log.exception("internal error", exc_info=exc)


def _parse(name: str, data: bytes) -> Any:
    """Deserialize here rather than in grpcio, which answers a message that does not
    parse with INTERNAL: a malformed request is the client's fault."""
    from google.protobuf.message import DecodeError

    try:
        return message(name).FromString(data)
    except DecodeError as exc:
        raise InvalidInputError(f"the request is not a valid {PACKAGE}.{name} message: {exc}") from None


async def _parsed(name: str, frames: AsyncIterator[bytes]) -> AsyncIterator[Any]:
    async for data in frames:
        yield _parse(name, data)


_UNARY = {
    "ServerLive": ("ServerLiveRequest", "ServerLiveResponse"),
    "ServerReady": ("ServerReadyRequest", "ServerReadyResponse"),
    "ModelReady": ("ModelReadyRequest", "ModelReadyResponse"),
    "ServerMetadata": ("ServerMetadataRequest", "ServerMetadataResponse"),
    "ModelMetadata": ("ModelMetadataRequest", "ModelMetadataResponse"),
    "ModelConfig": ("ModelConfigRequest", "ModelConfigResponse"),
    "ModelInfer": ("ModelInferRequest", "ModelInferResponse"),
    "RepositoryIndex": ("RepositoryIndexRequest", "RepositoryIndexResponse"),
    "RepositoryModelLoad": ("RepositoryModelLoadRequest", "RepositoryModelLoadResponse"),
    "RepositoryModelUnload": ("RepositoryModelUnloadRequest", "RepositoryModelUnloadResponse"),
}


#: how a stream ends without being refused (not counted: its requests are)
_STREAM_ENDS = frozenset({"OK", "CANCELLED", "DEADLINE_EXCEEDED"})


def _handlers(servicer: InferenceServicer, api_key: ApiKey | None, metrics: GrpcMetrics | None) -> Any:
    grpc = require("grpc", "serve")
    traces = active()

    def guard(method: str, request_type: str, streaming: bool) -> Callable[[Any, Any], Awaitable[Any]]:
        fn = getattr(servicer, method)
        if traces is not None:  # only then: an untraced server pays nothing
            fn = _traced(traces, method, fn)

        async def handler(data: Any, context: Any) -> Any:
            started = time.perf_counter()
            outcome = "OK"
            # a stream's requests are counted one by one (ModelStreamInfer); the stream
            # itself only when it is refused as a whole (a missing key, a frame that does
            # not parse), not when its client closes it
            unary = metrics if not streaming else None
            if unary is not None:
                unary.in_flight.inc()
            try:
                if api_key is not None and method not in OPEN_METHODS:
                    value = dict(context.invocation_metadata() or ()).get("authorization")
                    if not api_key.allows(value):
                        what = "missing API key" if value is None else "invalid API key"
                        outcome = grpc.StatusCode.UNAUTHENTICATED.name
                        await context.abort(
                            grpc.StatusCode.UNAUTHENTICATED, f"{what}: send the metadata 'authorization: Bearer <key>'"
                        )
                try:
                    request = _parsed(request_type, data) if streaming else _parse(request_type, data)
                    return await fn(request, context)
                except Exception as exc:
                    if isinstance(exc, grpc.aio.AbortError):  # the handler already chose its status
                        raise
                    code, text = status_for(exc)
                    outcome = code.name
                    _log_internal(exc)
                    await context.abort(code, text)
            except asyncio.CancelledError:  # the client went away, or its deadline passed
                remaining = context.time_remaining()
                outcome = "DEADLINE_EXCEEDED" if remaining is not None and remaining <= 0 else "CANCELLED"
                raise
            finally:
                if unary is not None:
                    unary.in_flight.dec()
                    unary.observe(method, outcome, started)
                elif metrics is not None and outcome not in _STREAM_ENDS:
                    metrics.observe(method, outcome, started)

        return handler

    methods = {
        name: grpc.unary_unary_rpc_method_handler(
            guard(name, req, False), response_serializer=message(resp).SerializeToString
        )
        for name, (req, resp) in _UNARY.items()
    }
    methods["ModelStreamInfer"] = grpc.stream_stream_rpc_method_handler(
        guard("ModelStreamInfer", "ModelInferRequest", True),
        response_serializer=message("ModelStreamInferResponse").SerializeToString,
    )
    return grpc.method_handlers_generic_handler(SERVICE, methods)


def _traced(traces: Tracing, method: str, fn: Callable[[Any, Any], Awaitable[Any]]) -> Any:
    """``fn`` inside a SERVER span, the child of the client's ``traceparent`` metadata (one
    span for a whole ModelStreamInfer stream)."""

    async def call(request: Any, context: Any) -> Any:
        carrier = [(k, v) for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)]
        attributes = {"rpc.system": "grpc", "rpc.service": SERVICE, "rpc.method": method}
        with traced_request(traces, f"{SERVICE}/{method}", carrier, **attributes):
            return await fn(request, context)

    return call


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


#: grpcio servers per process on the gRPC port (see ``GrpcServer``'s ``accept_loops``)
DEFAULT_ACCEPT_LOOPS = 4


def _check_port_free(host: str, port: int) -> None:
    """Raise OrtBatchError when ``host:port`` is taken: the accept loops share their port
    through SO_REUSEPORT, which would also join another process listening with it."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        raise OrtBatchError(f"gRPC cannot listen on {_address(host, port)}: {exc}") from None
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as probe:
            # as grpcio binds: a port left in TIME_WAIT is free, one with a listener is not
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(sockaddr)
            except OSError as exc:
                raise OrtBatchError(
                    f"gRPC cannot listen on {_address(host, port)} (in use or not an address of this machine): {exc}"
                ) from None


class GrpcServer:
    """The gRPC service on ``host:port`` (``port=0``: a free one, see :attr:`port`),
    run by a grpcio asyncio server on its own thread and event loop.

    Args:
        model: the served model, or a model repository (whose models are reached by
            the request's model name; the repository RPCs load and unload them). It is
            *not* closed by :meth:`stop`.
        api_key: when set, every RPC but ServerLive/ServerReady needs the metadata
            ``authorization: Bearer <api_key>``.
        ssl_certfile / ssl_keyfile: PEM files for TLS (both or neither).
        max_message_bytes: largest request or response message (grpcio's default is
            4 MiB; a bigger request is RESOURCE_EXHAUSTED).
        metrics: the HTTP server's :class:`~ortbatch.serve.metrics.ServerMetrics`, so
            its ``/metrics`` counts the gRPC requests too (``ortbatch_grpc_*``).
        reuse_port: share the port with other processes of this user that also set
            SO_REUSEPORT (the kernel spreads connections over them: ``--frontends``);
            off by default, so a port in use is an error.
        accept_loops: how many grpcio servers listen on the port in this process (the
            kernel spreads connections over them). A grpcio asyncio server asks its core
            for the next call only once it has started the last one, so one server
            starts one RPC per turn of the event loop and its RPCs reach the
            BatchedSession one by one; several take calls in parallel on the same loop,
            which is both cheaper per RPC and lets them batch (docs/benchmarks-log.md). They
            share the port through SO_REUSEPORT; unless ``reuse_port``, the port is first
            checked to be free, so a port in use is still an error.
    """

    def __init__(
        self,
        model: ServedModel | ServedGenerator | ModelRepository,
        *,
        host: str = "127.0.0.1",
        port: int = 8001,
        api_key: str | None = None,
        ssl_certfile: str | None = None,
        ssl_keyfile: str | None = None,
        max_message_bytes: int = 64 * 1024 * 1024,
        metrics: ServerMetrics | None = None,
        reuse_port: bool = False,
        accept_loops: int = DEFAULT_ACCEPT_LOOPS,
    ) -> None:
        require("grpc", "serve")
        if accept_loops < 1:
            raise OrtBatchError(f"accept_loops must be >= 1, got {accept_loops}")
        if (ssl_certfile is None) != (ssl_keyfile is None):
            raise OrtBatchError("TLS needs both --ssl-certfile and --ssl-keyfile")
        self._metrics = metrics.grpc() if metrics is not None else None
        self.servicer = InferenceServicer(model, self._metrics, max_message_bytes)
        self.host = host
        self.port = port
        self.tls = ssl_certfile is not None
        self._api_key = ApiKey(api_key) if api_key is not None else None
        self._cert = (ssl_certfile, ssl_keyfile)
        self._max = max_message_bytes
        self._reuse_port = reuse_port
        self.accept_loops = accept_loops
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: Any = None  # the first of the accept loops' servers, once started
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._stopping: asyncio.Event | None = None
        self._grace: float | None = None
        self._finished: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._error: BaseException | None = None

    @property
    def address(self) -> str:
        """``host:port`` for a client's channel (``[::1]:port`` for IPv6)."""
        return _address(self.host, self.port)

    @property
    def counts(self) -> GrpcCounts:
        return self.servicer.counts

    def _credentials(self) -> Any:
        grpc = require("grpc", "serve")
        cert, key = self._cert
        assert cert is not None and key is not None
        try:
            with open(cert, "rb") as fc, open(key, "rb") as fk:
                pair = (fk.read(), fc.read())
        except OSError as exc:
            raise OrtBatchError(f"cannot read the TLS certificate or key: {exc}") from None
        return grpc.ssl_server_credentials([pair])

    def _bind(self, server: Any, address: str) -> int:
        try:
            if self.tls:
                port = server.add_secure_port(address, self._credentials())
            else:
                port = server.add_insecure_port(address)
        except RuntimeError as exc:
            raise OrtBatchError(f"gRPC cannot listen on {address}: {exc}") from None
        if not port:
            raise OrtBatchError(f"gRPC cannot listen on {address} (in use or not an address of this machine)")
        return int(port)

    async def _serve(self) -> None:
        grpc = require("grpc", "serve")
        shared = self._reuse_port or self.accept_loops > 1
        options = [
            ("grpc.max_receive_message_length", self._max),
            ("grpc.max_send_message_length", self._max),
            # a port in use must fail, not be shared with another process (unless asked)
            ("grpc.so_reuseport", 1 if shared else 0),
        ]
        if shared and not self._reuse_port and self.port != 0:
            _check_port_free(self.host, self.port)
        handlers = (_handlers(self.servicer, self._api_key, self._metrics),)
        servers = []
        port = self.port
        for _ in range(self.accept_loops):
            server = grpc.aio.server(options=options)
            server.add_generic_rpc_handlers(handlers)
            # port 0: the first server picks a free port, the others join it
            port = self._bind(server, _address(self.host, port))
            servers.append(server)
        self.port = port
        stopping = asyncio.Event()
        self._stopping = stopping
        self.servicer.stopping = stopping
        for server in servers:
            await server.start()
        self._server = servers[0]
        self._started.set()
        await stopping.wait()
        # grpcio's stop(None) aborts every RPC at once; ours (as uvicorn's) waits for them all
        grace = self._grace if self._grace is not None else _WAIT_FOR_ALL_S
        await asyncio.gather(*(server.stop(grace) for server in servers))

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._serve())
        except BaseException as exc:
            self._error = exc
        finally:
            self._started.set()
            loop.close()
            self._finished.set_result(None)

    def start(self, timeout: float = 30.0) -> GrpcServer:
        """Bind and start serving; raises what went wrong (a port in use, a bad
        certificate) instead of leaving a thread that serves nothing."""
        self._thread = threading.Thread(target=self._run, name="ortbatch-grpc", daemon=True)
        self._thread.start()
        if not self._started.wait(timeout) or self._server is None:
            self.stop(timeout=5.0)
            error = self._error
            if isinstance(error, OrtBatchError):
                raise error
            raise OrtBatchError(f"the gRPC server did not start: {error!r}")
        return self

    def stop_soon(self, grace: float | None = None) -> concurrent.futures.Future[None]:
        """Stop accepting RPCs and let those in flight finish for up to ``grace``
        seconds (None: wait for all); the returned future is done once stopped."""
        self._grace = grace
        loop, stopping = self._loop, self._stopping
        if loop is not None and stopping is not None:
            try:
                loop.call_soon_threadsafe(stopping.set)
            except RuntimeError:  # the loop has already closed: nothing left to stop
                pass
        elif self._thread is None and not self._finished.done():  # never started
            self._finished.set_result(None)
        return self._finished

    def stop(self, grace: float | None = None, timeout: float = 60.0) -> None:
        """Stop (graceful for ``grace`` seconds) and join the thread."""
        self.stop_soon(grace)
        if self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self) -> GrpcServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop(grace=5.0)
