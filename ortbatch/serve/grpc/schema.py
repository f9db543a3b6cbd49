"""The KServe v2 / Triton gRPC messages this server speaks, built at import time.

The wire protocol is ``inference.GRPCInferenceService`` of the Open Inference Protocol
(KServe v2), as Triton's ``grpc_service.proto`` and ``model_config.proto`` define it
(field numbers checked against tritonclient 2.73's stubs, Triton r25.x). Only the
messages and fields this server reads or writes are declared: protobuf skips unknown
fields on the wire, so a client built from the full protos talks to it unchanged.

Why not ``protoc``-generated modules: generated code pins the protobuf runtime it
accepts (gencode 6.x refuses or warns under protobuf 5 or 7), and registering the
``inference.*`` names in protobuf's *default* pool collides with tritonclient's own
stubs when both are imported in one process. Here the descriptors are assembled from
the table below into a private :class:`~google.protobuf.descriptor_pool.DescriptorPool`,
which works on every protobuf from 4.x on and collides with nothing.

Each field is ``(name, number, type)`` or ``(name, number, type, oneof)``; a type is a
scalar (``"string"``), a message or enum of this file (``"InferParameter"``), either
prefixed with ``"repeated "``, or ``"map<T>"`` (``map<string, T>``).
"""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

__all__ = ["PACKAGE", "SERVICE", "message"]

PACKAGE = "inference"
SERVICE = f"{PACKAGE}.GRPCInferenceService"

_Field = tuple[Any, ...]

_PARAM_MAP = "map<InferParameter>"

_MESSAGES: dict[str, list[_Field]] = {
    "ServerLiveRequest": [],
    "ServerLiveResponse": [("live", 1, "bool")],
    "ServerReadyRequest": [],
    "ServerReadyResponse": [("ready", 1, "bool")],
    "ModelReadyRequest": [("name", 1, "string"), ("version", 2, "string")],
    "ModelReadyResponse": [("ready", 1, "bool")],
    "ServerMetadataRequest": [],
    "ServerMetadataResponse": [
        ("name", 1, "string"),
        ("version", 2, "string"),
        ("extensions", 3, "repeated string"),
    ],
    "ModelMetadataRequest": [("name", 1, "string"), ("version", 2, "string")],
    "ModelMetadataResponse": [
        ("name", 1, "string"),
        ("versions", 2, "repeated string"),
        ("platform", 3, "string"),
        ("inputs", 4, "repeated ModelMetadataResponse.TensorMetadata"),
        ("outputs", 5, "repeated ModelMetadataResponse.TensorMetadata"),
    ],
    "ModelMetadataResponse.TensorMetadata": [
        ("name", 1, "string"),
        ("datatype", 2, "string"),
        ("shape", 3, "repeated int64"),
    ],
    "InferParameter": [
        ("bool_param", 1, "bool", "parameter_choice"),
        ("int64_param", 2, "int64", "parameter_choice"),
        ("string_param", 3, "string", "parameter_choice"),
        ("double_param", 4, "double", "parameter_choice"),
        ("uint64_param", 5, "uint64", "parameter_choice"),
    ],
    "InferTensorContents": [
        ("bool_contents", 1, "repeated bool"),
        ("int_contents", 2, "repeated int32"),
        ("int64_contents", 3, "repeated int64"),
        ("uint_contents", 4, "repeated uint32"),
        ("uint64_contents", 5, "repeated uint64"),
        ("fp32_contents", 6, "repeated float"),
        ("fp64_contents", 7, "repeated double"),
        ("bytes_contents", 8, "repeated bytes"),
    ],
    "ModelInferRequest": [
        ("model_name", 1, "string"),
        ("model_version", 2, "string"),
        ("id", 3, "string"),
        ("parameters", 4, _PARAM_MAP),
        ("inputs", 5, "repeated ModelInferRequest.InferInputTensor"),
        ("outputs", 6, "repeated ModelInferRequest.InferRequestedOutputTensor"),
        ("raw_input_contents", 7, "repeated bytes"),
    ],
    "ModelInferRequest.InferInputTensor": [
        ("name", 1, "string"),
        ("datatype", 2, "string"),
        ("shape", 3, "repeated int64"),
        ("parameters", 4, _PARAM_MAP),
        ("contents", 5, "InferTensorContents"),
    ],
    "ModelInferRequest.InferRequestedOutputTensor": [("name", 1, "string"), ("parameters", 2, _PARAM_MAP)],
    "ModelInferResponse": [
        ("model_name", 1, "string"),
        ("model_version", 2, "string"),
        ("id", 3, "string"),
        ("parameters", 4, _PARAM_MAP),
        ("outputs", 5, "repeated ModelInferResponse.InferOutputTensor"),
        ("raw_output_contents", 6, "repeated bytes"),
    ],
    "ModelInferResponse.InferOutputTensor": [
        ("name", 1, "string"),
        ("datatype", 2, "string"),
        ("shape", 3, "repeated int64"),
        ("parameters", 4, _PARAM_MAP),
        ("contents", 5, "InferTensorContents"),
    ],
    "ModelStreamInferResponse": [("error_message", 1, "string"), ("infer_response", 2, "ModelInferResponse")],
    "ModelConfigRequest": [("name", 1, "string"), ("version", 2, "string")],
    # the model repository extension (grpc_service.proto), served by a ModelRepository
    "ModelRepositoryParameter": [
        ("bool_param", 1, "bool", "parameter_choice"),
        ("int64_param", 2, "int64", "parameter_choice"),
        ("string_param", 3, "string", "parameter_choice"),
        ("bytes_param", 4, "bytes", "parameter_choice"),
    ],
    "RepositoryIndexRequest": [("repository_name", 1, "string"), ("ready", 2, "bool")],
    "RepositoryIndexResponse": [("models", 1, "repeated RepositoryIndexResponse.ModelIndex")],
    "RepositoryIndexResponse.ModelIndex": [
        ("name", 1, "string"),
        ("version", 2, "string"),
        ("state", 3, "string"),
        ("reason", 4, "string"),
    ],
    "RepositoryModelLoadRequest": [
        ("repository_name", 1, "string"),
        ("model_name", 2, "string"),
        ("parameters", 3, "map<ModelRepositoryParameter>"),
    ],
    "RepositoryModelLoadResponse": [],
    "RepositoryModelUnloadRequest": [
        ("repository_name", 1, "string"),
        ("model_name", 2, "string"),
        ("parameters", 3, "map<ModelRepositoryParameter>"),
    ],
    "RepositoryModelUnloadResponse": [],
    "ModelConfigResponse": [("config", 1, "ModelConfig")],
    # model_config.proto (same package), the parts ServedModel.triton_config() fills
    "ModelConfig": [
        ("name", 1, "string"),
        ("platform", 2, "string"),
        ("backend", 17, "string"),
        ("max_batch_size", 4, "int32"),
        ("input", 5, "repeated ModelInput"),
        ("output", 6, "repeated ModelOutput"),
        ("dynamic_batching", 11, "ModelDynamicBatching", "scheduling_choice"),
        ("model_transaction_policy", 19, "ModelTransactionPolicy"),
    ],
    "ModelTransactionPolicy": [("decoupled", 1, "bool")],
    "ModelInput": [
        ("name", 1, "string"),
        ("data_type", 2, "DataType"),
        ("dims", 4, "repeated int64"),
        ("allow_ragged_batch", 7, "bool"),
        ("optional", 8, "bool"),
    ],
    "ModelOutput": [("name", 1, "string"), ("data_type", 2, "DataType"), ("dims", 3, "repeated int64")],
    "ModelDynamicBatching": [
        ("preferred_batch_size", 1, "repeated int32"),
        ("max_queue_delay_microseconds", 2, "uint64"),
    ],
}

_ENUMS: dict[str, list[str]] = {
    "DataType": [
        "TYPE_INVALID",
        "TYPE_BOOL",
        "TYPE_UINT8",
        "TYPE_UINT16",
        "TYPE_UINT32",
        "TYPE_UINT64",
        "TYPE_INT8",
        "TYPE_INT16",
        "TYPE_INT32",
        "TYPE_INT64",
        "TYPE_FP16",
        "TYPE_FP32",
        "TYPE_FP64",
        "TYPE_STRING",
        "TYPE_BF16",
    ],
}

_F = descriptor_pb2.FieldDescriptorProto
_SCALARS = {
    "bool": _F.TYPE_BOOL,
    "string": _F.TYPE_STRING,
    "bytes": _F.TYPE_BYTES,
    "int32": _F.TYPE_INT32,
    "int64": _F.TYPE_INT64,
    "uint32": _F.TYPE_UINT32,
    "uint64": _F.TYPE_UINT64,
    "float": _F.TYPE_FLOAT,
    "double": _F.TYPE_DOUBLE,
}


def _set_type(field: Any, type_name: str) -> None:
    if type_name in _SCALARS:
        field.type = _SCALARS[type_name]
    elif type_name in _ENUMS:
        field.type = _F.TYPE_ENUM
        field.type_name = f".{PACKAGE}.{type_name}"
    elif type_name in _MESSAGES:
        field.type = _F.TYPE_MESSAGE
        field.type_name = f".{PACKAGE}.{type_name}"
    else:
        raise KeyError(f"schema: unknown type {type_name!r}")


def _file() -> descriptor_pb2.FileDescriptorProto:
    fdp = descriptor_pb2.FileDescriptorProto(name="ortbatch/kserve_v2_grpc.proto", package=PACKAGE, syntax="proto3")
    for name, values in _ENUMS.items():
        enum = fdp.enum_type.add(name=name)
        for number, value in enumerate(values):
            enum.value.add(name=value, number=number)
    protos: dict[str, Any] = {}
    for full in _MESSAGES:  # parents are listed before their nested messages
        parent, _, leaf = full.rpartition(".")
        container = protos[parent].nested_type if parent else fdp.message_type
        protos[full] = container.add(name=leaf)
    for full, fields in _MESSAGES.items():
        msg = protos[full]
        oneofs: dict[str, int] = {}
        for name, number, type_name, *oneof in fields:
            field = msg.field.add(name=name, number=number, label=_F.LABEL_OPTIONAL)
            if type_name.startswith("map<"):
                entry = msg.nested_type.add(name="".join(p.title() for p in name.split("_")) + "Entry")
                entry.options.map_entry = True
                entry.field.add(name="key", number=1, label=_F.LABEL_OPTIONAL, type=_F.TYPE_STRING)
                _set_type(entry.field.add(name="value", number=2, label=_F.LABEL_OPTIONAL), type_name[4:-1])
                field.label = _F.LABEL_REPEATED
                field.type = _F.TYPE_MESSAGE
                field.type_name = f".{PACKAGE}.{full}.{entry.name}"
                continue
            if type_name.startswith("repeated "):
                field.label = _F.LABEL_REPEATED
                type_name = type_name.removeprefix("repeated ")
            _set_type(field, type_name)
            if oneof:
                if oneof[0] not in oneofs:
                    oneofs[oneof[0]] = len(msg.oneof_decl)
                    msg.oneof_decl.add(name=oneof[0])
                field.oneof_index = oneofs[oneof[0]]
    return fdp


_POOL = descriptor_pool.DescriptorPool()
_POOL.Add(_file())
_CLASSES: dict[str, Any] = {}


def message(name: str) -> Any:
    """The message class ``inference.<name>`` (``"ModelInferRequest"``)."""
    cls = _CLASSES.get(name)
    if cls is None:
        cls = _CLASSES[name] = message_factory.GetMessageClass(_POOL.FindMessageTypeByName(f"{PACKAGE}.{name}"))
    return cls
