"""The wire format on its own: JSON and binary tensors both ways, cross-checked
against tritonclient's own encoder/decoder where it has one."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from ortbatch.errors import InvalidInputError
from ortbatch.serve.served.protocol import (
    DATATYPES,
    decode_bytes_tensor,
    encode_bytes_tensor,
    encode_infer_response,
    parse_infer_request,
)


def binary_request(tensors: dict[str, np.ndarray], **extra: object) -> tuple[bytes, int]:
    """Build a request the way tritonclient does: JSON header + raw blobs."""
    from ortbatch.serve.served.protocol import datatype_of

    inputs, blobs = [], []
    for name, arr in tensors.items():
        blob = encode_bytes_tensor(arr) if arr.dtype == object else arr.astype(arr.dtype.newbyteorder("<")).tobytes()
        inputs.append(
            {
                "name": name,
                "datatype": datatype_of(arr),
                "shape": list(arr.shape),
                "parameters": {"binary_data_size": len(blob)},
            }
        )
        blobs.append(blob)
    header = json.dumps({"inputs": inputs, **extra}).encode()
    return header + b"".join(blobs), len(header)


def test_json_tensors_nested_and_flat_decode_alike():
    flat = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 2], "data": [1, 2.5, 3, 4]}]}
    nested = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 2], "data": [[1, 2.5], [3, 4]]}]}
    a = parse_infer_request(json.dumps(flat).encode()).inputs["x"]
    b = parse_infer_request(json.dumps(nested).encode()).inputs["x"]
    assert a.dtype == np.float32 and a.shape == (2, 2)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, [[1, 2.5], [3, 4]])


def test_binary_and_json_inputs_mix_in_order():
    x = np.arange(6, dtype=np.int64).reshape(2, 3)
    s = np.array([b"hi", "h\u00e9llo".encode(), b""], dtype=object)
    body, hl = binary_request({"x": x, "s": s})
    doc_end = json.loads(body[:hl])
    doc_end["inputs"].insert(1, {"name": "j", "datatype": "BOOL", "shape": [2], "data": [True, False]})
    header = json.dumps(doc_end).encode()
    req = parse_infer_request(header + body[hl:], len(header))
    np.testing.assert_array_equal(req.inputs["x"], x)
    assert req.inputs["s"].tolist() == s.tolist()
    assert req.inputs["j"].tolist() == [True, False]
    assert req.datatypes == {"x": "INT64", "j": "BOOL", "s": "BYTES"}
    assert req.inputs["x"].flags.writeable  # owned, not a view of the body


def test_bytes_codec_matches_tritonclient():
    utils = pytest.importorskip("tritonclient.utils")
    arr = np.array([[b"a", b""], ["\u00fcber".encode(), b"\x00\xff"]], dtype=object)
    ours = encode_bytes_tensor(arr)
    theirs = utils.serialize_byte_tensor(arr).item()
    assert ours == theirs
    assert decode_bytes_tensor(theirs, 4).tolist() == arr.reshape(-1).tolist()
    assert utils.deserialize_bytes_tensor(ours).tolist() == arr.reshape(-1).tolist()


DATA1 = b' "data": [1]}]}'
NINES = b"9" * 5000  # past Python's 4300-digit int conversion limit


@pytest.mark.parametrize(
    ("body", "header_length", "message"),
    [
        (b"{not json", None, "not valid JSON"),
        (b"[1, 2]", None, "must be a JSON object"),
        (b'{"inputs": []}', None, "non-empty list"),
        (b'{"inputs": [{"name": "x", "datatype": "FP99", "shape": [1], "data": [1]}]}', None, "unknown datatype"),
        (b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [-1], "data": [1]}]}', None, "non-negative"),
        (b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [2], "data": [1]}]}', None, "needs 2 elements"),
        (b'{"inputs": [{"name": "x", "datatype": "INT64", "shape": [1], "data": [1.5]}]}', None, "must be integers"),
        (b'{"inputs": [{"name": "x", "datatype": "INT8", "shape": [1], "data": [300]}]}', None, "out of range"),
        (b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": ["a"]}]}', None, "must be numbers"),
        (b'{"inputs": [{"name": "x", "datatype": "FP64", "shape": [1], "data": [1e999999]}]}', None, "finite"),
        (b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1e39]}]}', None, "finite"),
        (b'{"inputs": [{"name": "x", "datatype": "FP16", "shape": [1], "data": [70000]}]}', None, "finite"),
        (b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [NaN]}]}', None, "NaN is not"),
        (b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [-Infinity]}]}', None, "not a JSON"),
        (b'{"inputs": [{"name": "x", "datatype": "INT64", "shape": [1,5], "data": [[1,2],[3,4,5]]}]}', None, "match"),
        (b'{"inputs": [{"name": "x", "datatype": "INT64", "shape": [2,2], "data": [[1,2],[3,[4]]]}]}', None, "deeper"),
        (b'{"inputs": [{"name": "x", "datatype": "INT64", "shape": [4], "data": [[1,2],[3,4]]}]}', None, "match"),
        (b'{"inputs": [{"name": "x", "datatype": [], "shape": [1], "data": [1]}]}', None, "'datatype' must be"),
        (b'{"inputs": [{"name": "x", "datatype": {}, "shape": [1], "data": [1]}]}', None, "'datatype' must be"),
        (b'{"inputs": [{"name": "x", "datatype": "BYTES", "shape": [1], "data": ["\\ud800"]}]}', None, "surrogate"),
        (
            b'{"inputs": [{"name": "x", "datatype": "INT8", "shape": [' + b"1," * 64 + b'1], "data": [1]}]}',
            None,
            "65 dim",
        ),
        (
            b'{"inputs": [{"name": "x", "datatype": "INT8", "shape": [0, 2147483647, 2147483647], "data": []}]}',
            None,
            "more elements",
        ),
        (
            b'{"inputs": [{"name": "x", "datatype": "INT8", "shape": [1], "data": [' + b"9" * 5000 + b"]}]}",
            None,
            "JSON",
        ),
        (
            b'{"parameters": {"timeout": ' + b"9" * 1000 + b'}, "inputs": [{"name": "x", "datatype": "INT8", '
            b'"shape": [1], "data": [1]}]}',
            None,
            "'timeout' must be",
        ),
        (b'{"inputs": [{"name": "x", "datatype": "BYTES", "shape": [1], "data": [1]}]}', None, "must be strings"),
        (b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1]}]}', None, "no 'data'"),
        (
            b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1]},'
            b' {"name": "x", "datatype": "FP32", "shape": [1], "data": [1]}]}',
            None,
            "given twice",
        ),
        (b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1]}]}', 9999, "body has"),
        (
            b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1]}], "outputs": '
            b'[{"name": "y", "parameters": {"classification": 3}}]}',
            None,
            "classification",
        ),
        (
            b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": '
            + b"[" * 5000
            + b"]" * 5000
            + b"}]}",
            None,
            "nested too deeply",
        ),
    ],
)
def test_malformed_requests_raise_invalid_input(body, header_length, message):
    with pytest.raises(InvalidInputError, match=message):
        parse_infer_request(body, header_length)


def test_nested_data_in_the_shape_of_the_tensor_is_accepted():
    body = b'{"inputs": [{"name": "x", "datatype": "INT64", "shape": [2,1,2], "data": [[[1,2]],[[3,4]]]}]}'
    assert parse_infer_request(body).inputs["x"].tolist() == [[[1, 2]], [[3, 4]]]


def test_non_finite_binary_floats_are_refused():
    body, hl = binary_request({"x": np.array([1.0, np.nan, 2.0], np.float32)})
    with pytest.raises(InvalidInputError, match="finite"):
        parse_infer_request(body, hl)


def test_binary_data_without_the_header_length_says_the_header_is_missing():
    body, hl = binary_request({"x": np.arange(3, dtype=np.float32)})
    with pytest.raises(InvalidInputError, match=rf"{hl} bytes of JSON followed by 12 other bytes.*Inference-Header"):
        parse_infer_request(body, None)
    # text after the JSON (not binary data) is named the same way; plain bad JSON is not
    with pytest.raises(InvalidInputError, match="Inference-Header-Content-Length header"):
        parse_infer_request(body[:hl] + b"junk", None)
    with pytest.raises(InvalidInputError, match="not valid JSON") as info:
        parse_infer_request(b'{"inputs": [1, }', None)
    assert "Inference-Header" not in str(info.value)


def test_binary_size_mismatches_are_rejected():
    x = np.arange(3, dtype=np.float32)
    body, hl = binary_request({"x": x})
    with pytest.raises(InvalidInputError, match=r"bytes left over|no input's binary_data_size"):
        parse_infer_request(body + b"junk", hl)
    with pytest.raises(InvalidInputError, match="runs past the end"):
        parse_infer_request(body[:-1], hl)
    doc = json.loads(body[:hl])
    doc["inputs"][0]["shape"] = [4]
    header = json.dumps(doc).encode()
    with pytest.raises(InvalidInputError, match="needs 16"):
        parse_infer_request(header + body[hl:], len(header))
    # a BYTES element that claims more than is there
    bad = struct.pack("<I", 100) + b"abc"
    header = json.dumps(
        {"inputs": [{"name": "s", "datatype": "BYTES", "shape": [1], "parameters": {"binary_data_size": len(bad)}}]}
    ).encode()
    with pytest.raises(InvalidInputError, match="claims 100 bytes"):
        parse_infer_request(header + bad, len(header))
    # a huge declared count cannot allocate anything before it is rejected
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "s",
                    "datatype": "BYTES",
                    "shape": [2**31 - 1, 2**31 - 1],
                    "parameters": {"binary_data_size": 4},
                }
            ]
        }
    ).encode()
    with pytest.raises(InvalidInputError, match=r"need at least|more elements than"):
        parse_infer_request(header + b"\0\0\0\0", len(header))


def test_response_binary_and_json_parse_with_tritonclient():
    http = pytest.importorskip("tritonclient.http")
    y = np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3)
    n = np.array([[7], [-8]], dtype=np.int32)
    h = np.array([1.5, -2], dtype=np.float16)
    s = np.array([b"x", b"yz"], dtype=object)
    outs = [("y", y), ("n", n), ("h", h), ("s", s)]
    for binary in ([True, True, True, True], [False, True, False, True], [False] * 4):
        body, ctype, hl = encode_infer_response("m", "1", outs, binary, request_id="r1")
        assert (hl is None) == (not any(binary))
        assert ctype == ("application/json" if hl is None else "application/octet-stream")
        result = http.InferResult.from_response_body(body, header_length=hl)
        assert result.get_response()["id"] == "r1"
        for name, arr in outs:
            got = result.as_numpy(name)
            assert got.shape == arr.shape
            if arr.dtype == object:
                assert [bytes(v) if not isinstance(v, str) else v.encode() for v in got.reshape(-1)] == list(s)
            else:
                assert got.dtype == arr.dtype
                np.testing.assert_array_equal(got, arr)


def test_wants_binary_defaults_and_overrides():
    doc = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1]}],
        "parameters": {"binary_data_output": True},
        "outputs": [{"name": "a"}, {"name": "b", "parameters": {"binary_data": False}}],
    }
    req = parse_infer_request(json.dumps(doc).encode())
    assert req.wants_binary("a") and not req.wants_binary("b")
    doc["parameters"] = {"timeout": 2500}
    req = parse_infer_request(json.dumps(doc).encode())
    assert not req.wants_binary("a") and req.timeout_s == pytest.approx(0.0025)


numeric = st.sampled_from([k for k in DATATYPES if k != "BYTES"])


@settings(max_examples=60, deadline=None, database=None)
@given(datatype=numeric, data=st.data())
def test_roundtrip_any_numeric_tensor(datatype, data):
    dtype = DATATYPES[datatype]
    # finite values: NaN/Inf are refused both ways (issue 13, item 20)
    finite = hnp.from_dtype(dtype, allow_nan=False, allow_infinity=False) if dtype.kind == "f" else None
    arr = data.draw(hnp.arrays(dtype, hnp.array_shapes(min_dims=1, max_dims=3, max_side=4), elements=finite))
    as_binary = data.draw(st.booleans())
    body, _, hl = encode_infer_response("m", None, [("t", arr)], [as_binary])
    doc = json.loads(body[: hl or len(body)])
    tensor = doc["outputs"][0]
    tensor.pop("parameters", None) if not as_binary else None
    # turn the response tensor into a request input and parse it back
    req_doc = {"inputs": [tensor]}
    header = json.dumps(req_doc).encode()
    req = parse_infer_request(header + (body[hl:] if hl else b""), len(header) if hl else None)
    got = req.inputs["t"]
    assert got.dtype == dtype and got.shape == arr.shape
    np.testing.assert_array_equal(got, arr)


def test_a_response_never_carries_bare_nan():
    with pytest.raises(ValueError, match="JSON compliant"):
        encode_infer_response("m", None, [("t", np.array([np.nan], np.float32))], [False])


@settings(max_examples=40, deadline=None, database=None)
@given(st.lists(st.binary(max_size=12), min_size=0, max_size=6))
def test_bytes_roundtrip(items):
    arr = np.array([*items, b""], dtype=object)[: len(items)] if items else np.empty(0, dtype=object)
    assert decode_bytes_tensor(encode_bytes_tensor(arr), len(items)).tolist() == items
