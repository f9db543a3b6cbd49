"""``ortbatch serve``: an Open Inference Protocol (KServe v2) HTTP server over one
:class:`~ortbatch.BatchedSession`, so many HTTP clients are batched together; for a
text-generation export, an OpenAI-compatible ``/v1/completions`` over one
:class:`~ortbatch.BatchedGenerator` (:mod:`ortbatch.serve.completions`).

Needs the ``serve`` extra (starlette, uvicorn, prometheus-client, tokenizers)::

    from ortbatch.serve import ServedModel, ServeConfig, serve, BackgroundServer

    serve("exports/minilm", ServeConfig(port=8000))            # foreground, until SIGTERM
    with BackgroundServer(ServedModel.load("exports/minilm")) as srv:   # a thread
        print(srv.url)

Importing this package is light; starlette/uvicorn are imported when an app is built.
"""

from __future__ import annotations

from .app import DEFAULT_MAX_BODY_BYTES, RequestCounts, create_app, error_response
from .completions import ServedGenerator, create_completions_app, is_generation_export
from .model import EmbeddingResult, ServedModel, TensorMetadata
from .protocol import InferRequest, RequestedOutput, encode_infer_response, parse_infer_request
from .server import BackgroundServer, ServeConfig, bind_socket, serve

__all__ = [
    "BackgroundServer",
    "DEFAULT_MAX_BODY_BYTES",
    "EmbeddingResult",
    "InferRequest",
    "RequestCounts",
    "RequestedOutput",
    "ServeConfig",
    "ServedGenerator",
    "ServedModel",
    "TensorMetadata",
    "bind_socket",
    "create_app",
    "create_completions_app",
    "encode_infer_response",
    "error_response",
    "is_generation_export",
    "parse_infer_request",
    "serve",
]
