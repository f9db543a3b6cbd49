"""The Open Inference Protocol (KServe v2) wire format: JSON tensors and the binary
tensor data extension, both ways. Pure numpy + json; no web framework in here.

A request body is a JSON object, optionally followed by raw tensor bytes. When it is,
the ``Inference-Header-Content-Length`` header says how many leading bytes are JSON,
and each input that travels as bytes says how many with its ``binary_data_size``
parameter; the inputs' bytes follow the JSON in the order the inputs are listed.
Binary data is little-endian, row-major, unpadded; BOOL is one byte per element and
each BYTES element is a 4-byte little-endian length followed by that many bytes.

Every malformed request raises :class:`~ortbatch.errors.InvalidInputError` with a
message that says what was wrong, so the server can answer 400 with it.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...errors import InvalidInputError

__all__ = [
    "DATATYPES",
    "MAX_DIMS",
    "InferRequest",
    "RequestedOutput",
    "check_tensor_spec",
    "check_finite",
    "datatype_of",
    "decode_binary_tensor",
    "decode_bytes_tensor",
    "decode_values_tensor",
    "encode_binary_tensor",
    "dumps_json",
    "encode_bytes_tensor",
    "encode_infer_response",
    "loads_json",
    "ort_type_to_datatype",
    "short_repr",
    "parse_infer_request",
    "timeout_s_of",
]

#: Protocol datatype -> numpy dtype. BYTES tensors are numpy object arrays of ``bytes``.
DATATYPES: dict[str, np.dtype[Any]] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
    "BYTES": np.dtype(object),
}

_BY_NUMPY = {dt: name for name, dt in DATATYPES.items() if name != "BYTES"}

_ORT_TYPES = {
    "tensor(bool)": "BOOL",
    "tensor(uint8)": "UINT8",
    "tensor(uint16)": "UINT16",
    "tensor(uint32)": "UINT32",
    "tensor(uint64)": "UINT64",
    "tensor(int8)": "INT8",
    "tensor(int16)": "INT16",
    "tensor(int32)": "INT32",
    "tensor(int64)": "INT64",
    "tensor(float16)": "FP16",
    "tensor(float)": "FP32",
    "tensor(double)": "FP64",
    "tensor(string)": "BYTES",
    "tensor(bfloat16)": "BF16",
}

# JSON parameters are free-form; these are the ones this server acts on.
_INPUT_KEYS = frozenset({"name", "shape", "datatype", "parameters", "data"})
_MAX_JSON_DEPTH = 64
#: most dimensions a tensor may have (numpy's own limit)
MAX_DIMS = 64
# numpy needs every dim (and the element count) to fit an intp; no real tensor comes near.
_MAX_DIM = 2**31 - 1
_MAX_ELEMENTS = 2**40


# a year in microseconds: longer is no deadline anyone means
_MAX_TIMEOUT_US = 365 * 24 * 3600 * 10**6


def short_repr(value: Any, limit: int = 80) -> str:
    """``repr`` cut to ``limit`` characters: an error message must not echo a huge value
    (nor fail on an integer with more digits than Python prints)."""
    try:
        text = repr(value)
    except ValueError:
        return f"a {type(value).__name__} holding an integer with thousands of digits"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def ort_type_to_datatype(ort_type: str) -> str:
    """``'tensor(float)'`` -> ``'FP32'``; unknown element types keep a readable name."""
    return _ORT_TYPES.get(ort_type, ort_type.upper())


def datatype_of(array: np.ndarray) -> str:
    """The protocol datatype of a numpy array (object/str/bytes arrays are BYTES)."""
    if array.dtype.kind in "OSU":
        return "BYTES"
    name = _BY_NUMPY.get(array.dtype.newbyteorder("="))
    if name is None:
        raise InvalidInputError(f"numpy dtype {array.dtype} has no Open Inference Protocol datatype")
    return name


@dataclass(frozen=True)
class RequestedOutput:
    """One entry of the request's ``outputs``: its name and whether it wants binary data
    (``None``: the request-level ``binary_data_output`` default applies)."""

    name: str
    binary: bool | None = None


@dataclass
class InferRequest:
    """A decoded inference request."""

    inputs: dict[str, np.ndarray]
    datatypes: dict[str, str]
    id: str | None = None
    outputs: list[RequestedOutput] | None = None
    binary_output: bool = False
    timeout_s: float | None = None
    parameters: dict[str, Any] = field(default_factory=dict)

    def wants_binary(self, name: str) -> bool:
        """Whether output ``name`` goes back as binary data."""
        for out in self.outputs or ():
            if out.name == name and out.binary is not None:
                return out.binary
        return self.binary_output


# -- BYTES ---------------------------------------------------------------------------


def encode_bytes_tensor(array: np.ndarray) -> bytes:
    """Serialize a BYTES tensor: each element (row-major) as a 4-byte little-endian
    length followed by its bytes (``str`` elements are UTF-8 encoded)."""
    parts: list[bytes] = []
    for item in array.reshape(-1).tolist():
        if isinstance(item, str):
            item = item.encode("utf-8")
        elif not isinstance(item, bytes):
            item = str(item).encode("utf-8")
        parts.append(struct.pack("<I", len(item)))
        parts.append(item)
    return b"".join(parts)


def decode_bytes_tensor(buf: bytes | memoryview, count: int, where: str = "tensor") -> np.ndarray:
    """Parse ``count`` length-prefixed elements that must fill ``buf`` exactly."""
    view = memoryview(buf)
    if count * 4 > len(view):
        raise InvalidInputError(
            f"{where}: {count} BYTES elements need at least {count * 4} bytes, binary data has {len(view)}"
        )
    out = np.empty(count, dtype=object)
    offset = 0
    for i in range(count):
        if offset + 4 > len(view):
            raise InvalidInputError(
                f"{where}: BYTES data ends after {i} of {count} elements (need a 4-byte length at "
                f"offset {offset}, have {len(view)} bytes)"
            )
        (n,) = struct.unpack_from("<I", view, offset)
        offset += 4
        if offset + n > len(view):
            raise InvalidInputError(f"{where}: BYTES element {i} claims {n} bytes but only {len(view) - offset} remain")
        out[i] = bytes(view[offset : offset + n])
        offset += n
    if offset != len(view):
        raise InvalidInputError(f"{where}: {len(view) - offset} bytes left over after {count} BYTES elements")
    return out


# -- requests ------------------------------------------------------------------------


def _refuse_constant(name: str) -> Any:
    raise InvalidInputError(f"{name} is not a JSON number (JSON has no NaN or Infinity)")


def loads_json(data: bytes | memoryview | str, what: str = "request body") -> Any:
    """Parse strict JSON (no ``NaN``/``Infinity``); every failure, including integers
    with more digits than Python converts, is an :class:`InvalidInputError` naming ``what``."""
    try:
        return json.loads(data if isinstance(data, (bytes, str)) else bytes(data), parse_constant=_refuse_constant)
    except InvalidInputError as exc:
        raise InvalidInputError(f"{what} is not valid JSON: {exc}") from None
    except RecursionError:
        raise InvalidInputError(f"{what} is nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, too many digits
        raise InvalidInputError(f"{what} is not valid JSON: {exc}") from None


def dumps_json(doc: Any) -> bytes:
    """Compact JSON bytes; a non-finite float raises ValueError (never a bare ``NaN``)."""
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode("utf-8")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _parameters(obj: dict[str, Any], where: str) -> dict[str, Any]:
    params = obj.get("parameters")
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise InvalidInputError(f"{where}: 'parameters' must be an object, got {type(params).__name__}")
    return params


def _flatten(data: Any, shape: tuple[int, ...], where: str) -> list[Any]:
    """Row-major flattening of JSON ``data``: either flat, or nested exactly as ``shape``
    (``[[1, 2], [3, 4, 5]]`` is not a tensor of any shape). Without recursion."""
    if not isinstance(data, list):
        raise InvalidInputError(f"{where}: 'data' must be a list, got {type(data).__name__}")
    if not any(isinstance(x, list) for x in data):
        return data
    out: list[Any] = []
    # (list, depth): every list at depth d must hold shape[d] items, lists above the last dim
    stack: list[tuple[list[Any], int]] = [(data, 0)]
    while stack:
        items, depth = stack.pop()
        if depth >= len(shape) or len(items) != shape[depth]:
            want = f"{shape[depth]} items" if depth < len(shape) else "a number, not a list"
            raise InvalidInputError(
                f"{where}: nested 'data' does not match shape {list(shape)}: a list at depth {depth} has "
                f"{len(items)} items, expected {want}"
            )
        inner = depth + 1 < len(shape)
        if inner:
            if not all(isinstance(x, list) for x in items):
                raise InvalidInputError(f"{where}: nested 'data' does not match shape {list(shape)} at depth {depth}")
            stack.extend((x, depth + 1) for x in reversed(items))
        else:
            if any(isinstance(x, list) for x in items):
                raise InvalidInputError(f"{where}: nested 'data' is deeper than shape {list(shape)}")
            out.extend(items)
    return out


def _json_tensor(data: Any, datatype: str, shape: tuple[int, ...], where: str) -> np.ndarray:
    flat = _flatten(data, shape, where)
    count = math.prod(shape)
    if len(flat) != count:
        raise InvalidInputError(f"{where}: shape {list(shape)} needs {count} elements but 'data' has {len(flat)}")
    if datatype == "BYTES":
        out = np.empty(count, dtype=object)
        for i, item in enumerate(flat):
            if not isinstance(item, str):
                raise InvalidInputError(
                    f"{where}: BYTES elements in JSON must be strings, element {i} is {type(item).__name__}"
                )
            try:
                out[i] = item.encode("utf-8")
            except UnicodeEncodeError:  # a lone surrogate such as "\ud800"
                raise InvalidInputError(f"{where}: element {i} is not valid Unicode (a lone surrogate)") from None
        return out.reshape(shape)
    dtype = DATATYPES[datatype]
    if datatype == "BOOL":
        if not all(isinstance(x, bool) for x in flat):
            raise InvalidInputError(f"{where}: BOOL data must be true/false")
        return np.array(flat, dtype=np.bool_).reshape(shape)
    if dtype.kind in "iu":
        if not all(_is_int(x) for x in flat):
            bad = next(x for x in flat if not _is_int(x))
            raise InvalidInputError(f"{where}: {datatype} data must be integers, got {bad!r}")
        info = np.iinfo(dtype)
        if flat and (min(flat) < info.min or max(flat) > info.max):
            raise InvalidInputError(f"{where}: a value is out of range for {datatype} [{info.min}, {info.max}]")
        return np.array(flat, dtype=dtype).reshape(shape)
    # floats: JSON numbers (ints are fine; NaN/Infinity were refused with the JSON)
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in flat):
        bad = next(x for x in flat if not isinstance(x, (int, float)) or isinstance(x, bool))
        raise InvalidInputError(f"{where}: {datatype} data must be numbers, got {bad!r}")
    try:
        with np.errstate(over="ignore"):
            array = np.array(flat, dtype=dtype).reshape(shape)
    except OverflowError:
        raise InvalidInputError(f"{where}: a value is out of range for {datatype}") from None
    # a finite JSON number beyond the type's range (1e39 as FP32) would silently become inf
    check_finite(array, where)
    return array


def check_finite(array: np.ndarray, where: str) -> None:
    """Refuse a floating-point input holding NaN or +-Inf (or a value that overflowed
    its type): the model's answer to it would be meaningless or non-finite."""
    if array.dtype.kind == "f" and array.size and not np.isfinite(array).all():
        info = np.finfo(array.dtype)
        raise InvalidInputError(
            f"{where}: values must be finite numbers within the range of {datatype_of(array)} "
            f"(about +-{float(info.max):.4g}); got NaN, Infinity or an overflowing value"
        )


def check_tensor_spec(where: str, datatype: Any, shape: Any) -> tuple[str, tuple[int, ...]]:
    """Check an input's datatype and shape; returns them typed. Every transport's
    requests go through here, so HTTP and gRPC refuse the same things with the same
    messages."""
    if not isinstance(datatype, str):
        raise InvalidInputError(f"{where}: 'datatype' must be a string, got {short_repr(datatype)}")
    if datatype not in DATATYPES:
        if datatype == "BF16":
            raise InvalidInputError(f"{where}: BF16 tensors are not supported by this server")
        raise InvalidInputError(
            f"{where}: unknown datatype {short_repr(datatype)}; expected one of {sorted(DATATYPES)}"
        )
    if not isinstance(shape, list) or not all(_is_int(d) and 0 <= d <= _MAX_DIM for d in shape):
        raise InvalidInputError(
            f"{where}: 'shape' must be a list of non-negative integers (each at most {_MAX_DIM}), "
            f"got {short_repr(shape)}"
        )
    if len(shape) > MAX_DIMS:
        raise InvalidInputError(f"{where}: 'shape' has {len(shape)} dimensions; at most {MAX_DIMS} are supported")
    if math.prod(max(d, 1) for d in shape) > _MAX_ELEMENTS:
        raise InvalidInputError(f"{where}: 'shape' {short_repr(shape)} has more elements than any request can carry")
    return str(datatype), tuple(int(d) for d in shape)


def decode_binary_tensor(buf: bytes | memoryview, datatype: str, shape: tuple[int, ...], where: str) -> np.ndarray:
    """A tensor from its raw bytes (the binary tensor data extension's layout, which is
    also gRPC's ``raw_input_contents``); an owned, writable, native-order array."""
    return _binary_tensor(memoryview(buf), datatype, shape, where)


def decode_values_tensor(values: list[Any], datatype: str, shape: tuple[int, ...], where: str) -> np.ndarray:
    """A non-BYTES tensor from a flat list of Python values (JSON ``data``, gRPC typed
    ``contents``), with the same type and range checks as JSON data."""
    return _json_tensor(values, datatype, shape, where)


def _binary_tensor(buf: memoryview, datatype: str, shape: tuple[int, ...], where: str) -> np.ndarray:
    count = math.prod(shape)
    if datatype == "BYTES":
        return decode_bytes_tensor(buf, count, where).reshape(shape)
    dtype = DATATYPES[datatype]
    expected = count * dtype.itemsize
    if len(buf) != expected:
        raise InvalidInputError(
            f"{where}: binary_data_size is {len(buf)} bytes but shape {list(shape)} of {datatype} needs {expected}"
        )
    array = np.frombuffer(buf, dtype=dtype.newbyteorder("<")).reshape(shape)
    if datatype == "BOOL" and array.size and array.view(np.uint8).max() > 1:
        raise InvalidInputError(f"{where}: BOOL binary data must be bytes 0 or 1")
    check_finite(array, where)
    # frombuffer views the request body (read-only); a native-order copy is owned and writable
    return array.astype(dtype, copy=True)


def parse_infer_request(body: bytes, header_length: int | None = None) -> InferRequest:
    """Decode an inference request body.

    ``header_length`` is the ``Inference-Header-Content-Length`` header: the size of
    the JSON part when binary tensor data follows it (``None``: the body is all JSON).
    Raises :class:`InvalidInputError` for anything malformed, including binary sizes
    that do not add up to the body.
    """
    view = memoryview(body)
    if header_length is None:
        header, binary = view, view[len(view) :]
    else:
        if header_length < 0 or header_length > len(view):
            raise InvalidInputError(
                f"Inference-Header-Content-Length is {header_length} but the body has {len(view)} bytes"
            )
        header, binary = view[:header_length], view[header_length:]
    try:
        doc = loads_json(header, "request body")
    except InvalidInputError:
        json_length = _json_prefix_length(view) if header_length is None else None
        if json_length is None:
            raise
        raise InvalidInputError(
            f"request body is {json_length} bytes of JSON followed by {len(view) - json_length} other bytes; "
            "binary tensor data needs the Inference-Header-Content-Length header (the JSON's length in bytes)"
        ) from None
    if not isinstance(doc, dict):
        raise InvalidInputError(f"request body must be a JSON object, got {type(doc).__name__}")

    req_id = doc.get("id")
    if req_id is not None and not isinstance(req_id, str):
        raise InvalidInputError(f"'id' must be a string, got {type(req_id).__name__}")
    params = _parameters(doc, "request")
    binary_output = params.get("binary_data_output", False)
    if not isinstance(binary_output, bool):
        raise InvalidInputError("parameter 'binary_data_output' must be a boolean")
    timeout_s = timeout_s_of(params)
    inputs, datatypes = _parse_inputs(doc.get("inputs"), binary)
    return InferRequest(
        inputs=inputs,
        datatypes=datatypes,
        id=req_id,
        outputs=_parse_outputs(doc["outputs"]) if doc.get("outputs") is not None else None,
        binary_output=binary_output,
        timeout_s=timeout_s,
        parameters=params,
    )


def _json_prefix_length(view: memoryview) -> int | None:
    """The byte length of the JSON object that starts a body when other bytes follow it
    (binary data sent without its header); None otherwise. Only on the error path."""
    text = bytes(view).decode("utf-8", "replace")
    try:
        _, end = json.JSONDecoder().raw_decode(text)
    except (ValueError, RecursionError):
        return None
    if not text[end:].strip():
        return None
    return len(text[:end].encode("utf-8"))


def timeout_s_of(params: dict[str, Any]) -> float | None:
    """The request's ``timeout`` parameter in seconds (None: none, or 0); HTTP's and
    gRPC's requests are checked here alike."""
    if "timeout" not in params:
        return None
    # Triton's request timeout parameter is in microseconds.
    timeout = params["timeout"]
    if not _is_int(timeout) or not 0 <= timeout <= _MAX_TIMEOUT_US:
        raise InvalidInputError(
            f"parameter 'timeout' must be an integer number of microseconds in [0, {_MAX_TIMEOUT_US}], "
            f"got {short_repr(timeout)}"
        )
    return timeout / 1e6 if timeout else None


def _parse_inputs(raw_inputs: Any, binary: memoryview) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The request's input tensors and their datatypes, by name: each from its JSON
    ``data`` or its ``binary_data_size`` bytes of ``binary``, which they must use up."""
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise InvalidInputError("'inputs' must be a non-empty list of input tensors")
    inputs: dict[str, np.ndarray] = {}
    datatypes: dict[str, str] = {}
    cursor = 0
    for i, raw in enumerate(raw_inputs):
        if not isinstance(raw, dict):
            raise InvalidInputError(f"inputs[{i}] must be an object, got {type(raw).__name__}")
        name = raw.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidInputError(f"inputs[{i}]: 'name' must be a non-empty string")
        where = f"input {short_repr(name)}"
        if name in inputs:
            raise InvalidInputError(f"{where} is given twice")
        datatype, shape_t = check_tensor_spec(where, raw.get("datatype"), raw.get("shape"))
        p = _parameters(raw, where)
        if "shared_memory_region" in p:
            raise InvalidInputError(f"{where}: shared memory is not supported by this server")
        size = p.get("binary_data_size")
        if size is not None:
            if not _is_int(size) or size < 0:
                raise InvalidInputError(f"{where}: binary_data_size must be a non-negative integer, got {size!r}")
            if "data" in raw:
                raise InvalidInputError(f"{where}: has both 'data' and binary_data_size")
            if cursor + size > len(binary):
                raise InvalidInputError(
                    f"{where}: binary_data_size {size} runs past the end of the body "
                    f"({len(binary) - cursor} binary bytes left)"
                )
            inputs[name] = _binary_tensor(binary[cursor : cursor + size], datatype, shape_t, where)
            cursor += size
        elif "data" in raw:
            inputs[name] = _json_tensor(raw["data"], datatype, shape_t, where)
        else:
            raise InvalidInputError(f"{where}: no 'data' and no binary_data_size parameter")
        datatypes[name] = datatype
    if cursor != len(binary):
        raise InvalidInputError(
            f"the body has {len(binary) - cursor} bytes of binary data that no input's binary_data_size accounts for"
        )
    return inputs, datatypes


def _parse_outputs(raw_outputs: Any) -> list[RequestedOutput]:
    """The outputs the request asks for, each once, and whether each is wanted binary."""
    if not isinstance(raw_outputs, list):
        raise InvalidInputError("'outputs' must be a list")
    outputs = []
    seen: set[str] = set()
    for i, raw in enumerate(raw_outputs):
        if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
            raise InvalidInputError(f"outputs[{i}] must be an object with a 'name' string")
        name = raw["name"]
        what = f"output {short_repr(name)}"
        if name in seen:
            raise InvalidInputError(f"{what} is requested twice")
        seen.add(name)
        p = _parameters(raw, what)
        if p.get("classification"):
            raise InvalidInputError(f"{what}: the classification extension is not supported")
        if "shared_memory_region" in p:
            raise InvalidInputError(f"{what}: shared memory is not supported by this server")
        wants = p.get("binary_data")
        if wants is not None and not isinstance(wants, bool):
            raise InvalidInputError(f"{what}: parameter 'binary_data' must be a boolean")
        outputs.append(RequestedOutput(name, wants))
    return outputs


# -- responses -----------------------------------------------------------------------


def _json_data(array: np.ndarray) -> list[Any]:
    flat = array.reshape(-1)
    if array.dtype.kind in "OSU":
        out = []
        for item in flat.tolist():
            if isinstance(item, bytes):
                try:
                    item = item.decode("utf-8")
                except UnicodeDecodeError:
                    raise InvalidInputError("a BYTES output is not UTF-8; request it with binary_data=true") from None
            out.append(item if isinstance(item, str) else str(item))
        return out
    if array.dtype == np.float16:
        flat = flat.astype(np.float32)
    return flat.tolist()


def encode_binary_tensor(array: np.ndarray) -> bytes:
    """A tensor's raw bytes: little-endian, row-major; BYTES length-prefixed."""
    if array.dtype.kind in "OSU":
        return encode_bytes_tensor(array)
    return np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()


def encode_infer_response(
    model_name: str,
    model_version: str | None,
    outputs: Sequence[tuple[str, np.ndarray]],
    binary: Sequence[bool],
    request_id: str | None = None,
) -> tuple[bytes, str, int | None]:
    """Encode outputs as a response body.

    Returns ``(body, content_type, header_length)``: ``header_length`` is the value
    for the ``Inference-Header-Content-Length`` header, or ``None`` when every output
    went as JSON (then the body is plain ``application/json``).
    """
    doc: dict[str, Any] = {"model_name": model_name}
    if model_version is not None:
        doc["model_version"] = model_version
    if request_id is not None:
        doc["id"] = request_id
    tensors = []
    blobs: list[bytes] = []
    for (name, array), as_binary in zip(outputs, binary, strict=True):
        tensor: dict[str, Any] = {"name": name, "datatype": datatype_of(array), "shape": list(array.shape)}
        if as_binary:
            blob = encode_binary_tensor(array)
            tensor["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            tensor["data"] = _json_data(array)
        tensors.append(tensor)
    doc["outputs"] = tensors
    header = dumps_json(doc)
    if not blobs:
        return header, "application/json", None
    return b"".join([header, *blobs]), "application/octet-stream", len(header)
