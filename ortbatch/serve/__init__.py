"""``ortbatch serve``: an Open Inference Protocol (KServe v2) HTTP server over one
:class:`~ortbatch.BatchedSession`, so many HTTP clients are batched together; for a
text-generation export, OpenAI-compatible ``/v1/completions`` and chat over one
:class:`~ortbatch.BatchedGenerator`.

The rooms (arrows point down; docs/architecture.md draws them): the runners
(:mod:`~ortbatch.serve.server`, :mod:`~ortbatch.serve.frontends`) over
:mod:`~ortbatch.serve.assembly` and :mod:`~ortbatch.serve.listen`; the transports
:mod:`~ortbatch.serve.http` and :mod:`~ortbatch.serve.grpc`, which never import each other;
the transport-neutral core :mod:`~ortbatch.serve.served` (what is served, the repository,
the v2 wire format, the completion and task logic, the one model lookup, the model-kind
registry :mod:`~ortbatch.serve.served.kinds`, whose encoder and decoder kinds
:mod:`~ortbatch.serve.kinds` declares and this package registers on import); and serve's floor,
:mod:`~ortbatch.serve.config`, :mod:`~ortbatch.serve.auth`, :mod:`~ortbatch.serve.metrics`.

Needs the ``serve`` extra (starlette, uvicorn, prometheus-client, tokenizers)::

    from ortbatch.serve import ServedModel, ServeConfig, serve, BackgroundServer

    serve("exports/minilm", ServeConfig(port=8000))            # foreground, until SIGTERM
    with BackgroundServer(ServedModel.load("exports/minilm")) as srv:   # a thread
        print(srv.url)

Importing this package is light; starlette/uvicorn are imported when an app is built.
"""

from __future__ import annotations

from ..errors import NonFiniteOutputError, RequestTooLargeError
from . import (
    kinds,  # noqa: F401 - registers the encoder and decoder model kinds (ortbatch.serve.kinds)
    vision_kind,  # noqa: F401 - registers the image model kind, after those two
)
from .config import ServeConfig
from .http.app import build_app, create_app, create_completions_app
from .http.plumbing import DEFAULT_MAX_BODY_BYTES, BodyLimits, RequestCounts, assemble_app, error_response
from .listen import bind_socket
from .served.generator import ServedGenerator, is_generation_export
from .served.model import EmbeddingResult, ServedModel, TensorMetadata
from .served.protocol import InferRequest, RequestedOutput, encode_infer_response, parse_infer_request
from .server import BackgroundServer, serve

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "BackgroundServer",
    "BodyLimits",
    "EmbeddingResult",
    "InferRequest",
    "NonFiniteOutputError",
    "RequestCounts",
    "RequestTooLargeError",
    "RequestedOutput",
    "ServeConfig",
    "ServedGenerator",
    "ServedModel",
    "TensorMetadata",
    "assemble_app",
    "bind_socket",
    "build_app",
    "create_app",
    "create_completions_app",
    "encode_infer_response",
    "error_response",
    "is_generation_export",
    "parse_infer_request",
    "serve",
]
