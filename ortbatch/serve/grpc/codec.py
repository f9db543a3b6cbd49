"""ModelInferRequest -> :class:`~ortbatch.serve.served.protocol.InferRequest` and outputs ->
ModelInferResponse. The tensor checks are :mod:`ortbatch.serve.served.protocol`'s, so a
request refused over HTTP is refused over gRPC with the same message.

Tensor data comes either in ``raw_input_contents`` (one entry per input, in input
order, laid out as the binary tensor data extension lays it out: what tritonclient
sends) or in each input's typed ``contents``; outputs always go back as
``raw_output_contents``, as Triton answers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ...errors import InvalidInputError
from ..served.protocol import (
    InferRequest,
    RequestedOutput,
    check_tensor_spec,
    datatype_of,
    decode_binary_tensor,
    decode_values_tensor,
    encode_binary_tensor,
    short_repr,
    timeout_s_of,
)
from .schema import message

__all__ = ["decode_infer_request", "encode_infer_response", "parameters"]

# The typed ``contents`` field each datatype's values travel in (Triton's rule);
# FP16 has none: it is sent raw.
_CONTENTS_FIELD = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}
_ALL_CONTENTS = sorted(set(_CONTENTS_FIELD.values()))


def parameters(params: Any) -> dict[str, Any]:
    """A ``map<string, InferParameter>`` as a plain dict (unset values are ``None``)."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        which = value.WhichOneof("parameter_choice")
        out[key] = getattr(value, which) if which else None
    return out


def _from_contents(tensor: Any, datatype: str, shape: tuple[int, ...], where: str) -> np.ndarray:
    field = _CONTENTS_FIELD.get(datatype)
    contents = tensor.contents
    given = [f for f in _ALL_CONTENTS if len(getattr(contents, f))]
    if field is None:
        raise InvalidInputError(f"{where}: {datatype} data must be sent in raw_input_contents")
    if not tensor.HasField("contents") and math.prod(shape) != 0:
        raise InvalidInputError(f"{where}: no contents and no raw_input_contents")
    wrong = [f for f in given if f != field]
    if wrong:
        raise InvalidInputError(f"{where}: {datatype} data goes in {field}, got {', '.join(wrong)}")
    values = list(getattr(contents, field))
    count = math.prod(shape)
    if len(values) != count:
        raise InvalidInputError(f"{where}: shape {list(shape)} needs {count} elements but {field} has {len(values)}")
    if datatype == "BYTES":
        out = np.empty(count, dtype=object)
        out[:] = values
        return out.reshape(shape)
    return decode_values_tensor(values, datatype, shape, where)


def _requested_outputs(raw_outputs: Sequence[Any]) -> list[RequestedOutput] | None:
    if not raw_outputs:
        return None
    outputs = []
    seen: set[str] = set()
    for i, raw in enumerate(raw_outputs):
        name = raw.name
        if not name:
            raise InvalidInputError(f"outputs[{i}]: 'name' must be a non-empty string")
        what = f"output {short_repr(name)}"
        if name in seen:
            raise InvalidInputError(f"{what} is requested twice")
        seen.add(name)
        p = parameters(raw.parameters)
        if p.get("classification"):
            raise InvalidInputError(f"{what}: the classification extension is not supported")
        if "shared_memory_region" in p:
            raise InvalidInputError(f"{what}: shared memory is not supported by this server")
        outputs.append(RequestedOutput(name, True))
    return outputs


def decode_infer_request(msg: Any) -> InferRequest:
    """Decode a ``ModelInferRequest`` message (the model name is checked by the caller).
    Raises :class:`~ortbatch.errors.InvalidInputError` for anything malformed."""
    params = parameters(msg.parameters)
    timeout_s = timeout_s_of(params)
    if not msg.inputs:
        raise InvalidInputError("'inputs' must be a non-empty list of input tensors")
    raw = msg.raw_input_contents
    if raw and len(raw) != len(msg.inputs):
        raise InvalidInputError(
            f"raw_input_contents has {len(raw)} entries but the request has {len(msg.inputs)} inputs: "
            "send every input's data raw, or none"
        )
    inputs: dict[str, np.ndarray] = {}
    datatypes: dict[str, str] = {}
    for i, tensor in enumerate(msg.inputs):
        name = tensor.name
        if not name:
            raise InvalidInputError(f"inputs[{i}]: 'name' must be a non-empty string")
        where = f"input {short_repr(name)}"
        if name in inputs:
            raise InvalidInputError(f"{where} is given twice")
        datatype, shape = check_tensor_spec(where, tensor.datatype, list(tensor.shape))
        if "shared_memory_region" in parameters(tensor.parameters):
            raise InvalidInputError(f"{where}: shared memory is not supported by this server")
        if raw:
            if tensor.HasField("contents"):
                raise InvalidInputError(f"{where}: has both contents and raw_input_contents")
            inputs[name] = decode_binary_tensor(raw[i], datatype, shape, where)
        else:
            inputs[name] = _from_contents(tensor, datatype, shape, where)
        datatypes[name] = datatype
    return InferRequest(
        inputs=inputs,
        datatypes=datatypes,
        id=msg.id or None,
        outputs=_requested_outputs(msg.outputs),
        binary_output=True,
        timeout_s=timeout_s,
        parameters=params,
    )


def encode_infer_response(
    model_name: str, model_version: str, outputs: Sequence[tuple[str, np.ndarray]], request_id: str | None
) -> Any:
    """A ``ModelInferResponse`` with every output's bytes in ``raw_output_contents``."""
    response = message("ModelInferResponse")(model_name=model_name, model_version=model_version, id=request_id or "")
    for name, array in outputs:
        response.outputs.add(name=name, datatype=datatype_of(array), shape=list(array.shape))
        response.raw_output_contents.append(encode_binary_tensor(array))
    return response
