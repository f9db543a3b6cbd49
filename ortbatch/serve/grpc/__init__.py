"""gRPC for ``ortbatch serve``: the KServe v2 / Triton ``GRPCInferenceService``
(``ortbatch serve DIR --grpc-port 8001``), so ``tritonclient.grpc`` works unchanged.

Needs the ``serve`` extra (grpcio, protobuf)::

    from ortbatch.serve import ServedModel
    from ortbatch.serve.grpc import GrpcServer

    with GrpcServer(ServedModel.load("exports/minilm"), port=8001) as srv:
        ...  # tritonclient.grpc.InferenceServerClient(srv.address)

``GrpcServer(repository)`` serves every model of a
:class:`~ortbatch.serve.served.repository.ModelRepository` (after its ``load_all()``), with the
repository RPCs (index, load, unload).
"""

from __future__ import annotations

from ..._extras import require

require("grpc", "serve")
require("google.protobuf", "serve")

from .codec import decode_infer_request, encode_infer_response  # noqa: E402
from .service import (  # noqa: E402
    GrpcCounts,
    GrpcServer,
    InferenceServicer,
    status_for,
)

__all__ = [
    "GrpcCounts",
    "GrpcServer",
    "InferenceServicer",
    "decode_infer_request",
    "encode_infer_response",
    "status_for",
]
