"""Every error ortbatch raises, rooted at :class:`OrtBatchError`.

The tree is chosen by what the caller does next::

    OrtBatchError
    ├── InvalidInputError (ValueError)      fix the request; the session keeps serving
    │   │                                   (at submit, or when ORT rejects its values at run
    │   │                                   time, e.g. token ids outside the vocabulary)
    │   └── RequestTooLargeError            send less: the request can never be served as sent
    ├── QueueFullError                      back off and retry (carries queued, max_queue)
    ├── RequestTimeoutError (TimeoutError)  the deadline passed before the request ran
    ├── SessionClosedError                  the session is closed; make a new one
    ├── InferenceError                      ONNX Runtime failed on this request
    │   └── NonFiniteOutputError            the model produced NaN/Inf from finite inputs
    ├── ProviderError                       a requested execution provider is not active
    ├── ModelLoadError                      model.onnx is missing, truncated or corrupt
    ├── ModelContractError (ValueError)     the model cannot be batched as described
    ├── ManifestError (ValueError)          ortbatch.json is missing, malformed or too new
    ├── ModelIntegrityError                 model.onnx's bytes differ from those exported (sha256)
    ├── ServeError                          the server cannot start (address in use, not bindable)
    ├── ModelNotFoundError (LookupError)    the request names a model (or version) not served here
    ├── ModelUnavailableError               the model is known but not serving now; retry later
    ├── ModelLoadFailedError                a served repository could not (re)load a model
    ├── UnsupportedError                    this server does not serve that call for this model
    ├── ExportError                         converting a model to ONNX failed
    │   └── UnsupportedModelError (ValueError)  architecture/task not supported
    └── ValidationError                     an accuracy check failed (carries the report)

onnxruntime's own exceptions are mapped onto this tree at one boundary,
:func:`map_ort_error`, so callers never need to import onnxruntime to catch them.
The server's transports each map the tree once onto their statuses (HTTP:
``serve.http.plumbing.error_response``; gRPC: ``serve.grpc.service.status_for``), so the
serving core raises these and never names a status code.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ExportError",
    "InferenceError",
    "InvalidInputError",
    "ManifestError",
    "ModelIntegrityError",
    "ModelContractError",
    "ModelLoadError",
    "ModelLoadFailedError",
    "ModelNotFoundError",
    "ModelUnavailableError",
    "NonFiniteOutputError",
    "OrtBatchError",
    "ProviderError",
    "QueueFullError",
    "RequestTooLargeError",
    "RequestTimeoutError",
    "ServeError",
    "SessionClosedError",
    "UnsupportedError",
    "UnsupportedModelError",
    "ValidationError",
    "map_ort_error",
]


class OrtBatchError(Exception):
    """Root of every error raised by ortbatch."""


class InvalidInputError(OrtBatchError, ValueError):
    """A request does not fit the model: the message names the input, what was
    expected and what came. Raised at submit; other requests are unaffected."""

    def __init__(self, message: str, *, input_name: str | None = None) -> None:
        super().__init__(message)
        self.input_name = input_name


class RequestTooLargeError(InvalidInputError):
    """The request can never be served as sent (a text over the character limit, more
    texts than the queue holds): answered 413 (HTTP) with the limit."""


class QueueFullError(OrtBatchError):
    """``max_queue`` requests are already waiting: the request was not accepted."""

    def __init__(self, queued: int, max_queue: int) -> None:
        super().__init__(f"queue full: {queued} requests waiting (max_queue={max_queue}); retry later")
        self.queued = queued
        self.max_queue = max_queue


class RequestTimeoutError(OrtBatchError, TimeoutError):
    """The request's deadline passed before it ran; it was dropped unrun."""


class SessionClosedError(OrtBatchError):
    """The session is closed (or closing without drain): the request will not run."""


class InferenceError(OrtBatchError):
    """ONNX Runtime (or a custom collator) failed on this request.

    When a batch fails it is split and retried, so this error reaches only the
    request(s) that fail on their own."""


class NonFiniteOutputError(InferenceError):
    """The model produced NaN or Inf for a request whose inputs were finite: a damaged
    or numerically unstable export. Never answered as a success."""


class ProviderError(OrtBatchError):
    """A requested execution provider (CUDA, TensorRT) is not active in the session,
    e.g. ONNX Runtime silently fell back to CPU."""


class ModelLoadError(OrtBatchError):
    """ONNX Runtime could not load the model file: it is missing, truncated or corrupt.
    ``path`` names the file and ``reason`` is ONNX Runtime's own message."""

    def __init__(self, path: Any, reason: str = "ONNX Runtime could not read it") -> None:
        super().__init__(f"cannot load the ONNX model {path}: {reason} (is it truncated or corrupt? re-export it)")
        self.path = str(path)
        self.reason = reason


class ModelContractError(OrtBatchError, ValueError):
    """The model cannot be served batched as described (e.g. an output without a
    batch axis, a fixed batch dimension). Raised when the session is built."""


class ManifestError(OrtBatchError, ValueError):
    """ortbatch.json is missing, malformed, or from a newer format."""


class ModelIntegrityError(OrtBatchError):
    """A model file's sha256 differs from the one recorded in ortbatch.json at export:
    the file was damaged or changed after it was checked. ``path`` is the file."""

    def __init__(self, message: str, *, path: Any = None) -> None:
        super().__init__(message)
        self.path = path


class ServeError(OrtBatchError):
    """The server cannot start: the address does not resolve, the port is in use or
    not allowed, ..."""


class ModelNotFoundError(OrtBatchError, LookupError):
    """The request names a model (or version) this server does not serve (HTTP 404,
    gRPC NOT_FOUND)."""


class ModelUnavailableError(OrtBatchError):
    """The model is known but does not serve now: unloaded, still loading, or the server
    is shutting down (HTTP 503, gRPC UNAVAILABLE)."""


class ModelLoadFailedError(OrtBatchError):
    """A model repository could not load (or reload) a model; the message says why and
    whether a loaded copy keeps serving (HTTP 400, gRPC INVALID_ARGUMENT, as Triton's)."""


class UnsupportedError(OrtBatchError):
    """The call is not served for this model or by this server (gRPC UNIMPLEMENTED, as
    Triton answers its UNSUPPORTED errors; HTTP 501)."""


class ExportError(OrtBatchError):
    """Converting a model to ONNX failed."""


class UnsupportedModelError(ExportError, ValueError):
    """The architecture or task is not supported; the message lists what is."""


class ValidationError(OrtBatchError):
    """An accuracy check failed. ``report`` holds the full :class:`ValidationReport`."""

    def __init__(self, message: str, report: Any = None) -> None:
        super().__init__(message)
        self.report = report


# Names of onnxruntime.capi.onnxruntime_pybind11_state exceptions that mean the
# *request* was wrong (shape/type/argument), as opposed to a runtime failure.
_ORT_INPUT_ERRORS = frozenset({"InvalidArgument", "InvalidGraph"})


def map_ort_error(exc: BaseException, context: str = "") -> OrtBatchError:
    """Map an exception raised by onnxruntime to the most specific ortbatch error.

    Argument errors become :class:`InvalidInputError`; everything else
    (Fail, RuntimeException, NotImplemented, EP failures, ...) becomes
    :class:`InferenceError`. The original exception is kept as ``__cause__`` by
    the caller (``raise map_ort_error(e) from e``).
    """
    if isinstance(exc, OrtBatchError):
        return exc
    name = type(exc).__name__
    prefix = f"{context}: " if context else ""
    text = f"{prefix}{name}: {exc}"
    if name in _ORT_INPUT_ERRORS:
        return InvalidInputError(text)
    return InferenceError(text)
