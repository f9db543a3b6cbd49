"""The ONNX Runtime layer (ortbatch._ort): sessions without silent fallback, one typed
error for a model that does not load, IOBinding that lets ORT copy inputs on its stream,
tolerances from the arithmetic really used, and the one place provider names live."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

from ortbatch import BatchedSession, ModelLoadError, OrtBatchError
from ortbatch._ort import (
    DeviceRunner,
    arithmetic,
    build_session,
    device_of,
    fp32_parity_options,
    load_error,
    output_tolerance,
    parity_tolerances,
)
from ortbatch.errors import InferenceError, ProviderError

CPU, CUDA, TRT = "CPUExecutionProvider", "CUDAExecutionProvider", "TensorrtExecutionProvider"
REPO = Path(__file__).resolve().parents[2]


def _feed(n: int = 2) -> dict[str, np.ndarray]:
    return {
        "input_ids": np.arange(1, n + 1, dtype=np.int64)[None],
        "attention_mask": np.ones((1, n), np.int64),
        "extra": np.zeros((1, 3), np.float32),
    }


# -- defect 5: no silent rebuild on the fallback providers ---------------------------------


def test_every_built_session_has_fallback_off(echo_path):
    sess = build_session(echo_path, [(CPU, {})])
    assert sess._enable_fallback is False  # onnxruntime's own flag, read by run()/run_with_iobinding()


class _FailingCSession:
    """Stands in for the C session inside an InferenceSession: its run raises the EP
    failure that makes onnxruntime >= 1.31 rebuild the session when fallback is on."""

    def __init__(self, real):
        self.real = real
        self.runs = 0

    def run(self, *args, **kwargs):
        from onnxruntime.capi.onnxruntime_pybind11_state import EPFail

        self.runs += 1
        raise EPFail("CUDA failure 700: an illegal memory access was encountered")

    def __getattr__(self, name):
        return getattr(self.real, name)


def test_an_ep_failure_reaches_the_caller_and_the_session_is_not_rebuilt(echo_path):
    with BatchedSession(str(echo_path), providers="cpu", latency_session=False) as bs:
        fake = _FailingCSession(bs.session._sess)
        bs.session._sess = fake
        with pytest.raises(InferenceError, match="illegal memory access"):
            bs.run(None, _feed())
        # the session (and every worker's IOBinding made from it) is still the one we built
        assert bs.session._sess is fake and fake.runs >= 1


# -- issue 13 item 5: a model that does not load is one typed error --------------------------


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_corrupt_model_is_one_model_load_error_with_path_and_reason(tmp_path, echo_path, damage):
    data = echo_path.read_bytes()
    bad = tmp_path / "model.onnx"
    bad.write_bytes({"truncate": data[: len(data) // 2], "garbage": b"\xff" * 4096, "empty": b""}[damage])
    with pytest.raises(ModelLoadError) as info:
        BatchedSession(str(bad))
    err = info.value
    assert isinstance(err, OrtBatchError) and err.path == str(bad) and err.reason
    assert str(bad) in str(err)


def test_load_error_mapping():
    from onnxruntime.capi.onnxruntime_pybind11_state import Fail, InvalidProtobuf

    assert isinstance(load_error(InvalidProtobuf("Protobuf parsing failed"), "m.onnx", [(CUDA, {})]), ModelLoadError)
    assert isinstance(load_error(Fail("bad node"), "m.onnx"), ModelLoadError)
    # TensorRT's plugin registration raises a plain RuntimeError naming its libraries
    trt = RuntimeError("Please install TensorRT libraries as mentioned in the GPU requirements page")
    err = load_error(trt, "m.onnx", [(TRT, {}), (CPU, {})])
    assert isinstance(err, ProviderError) and "install TensorRT" in str(err)


def test_cli_says_one_line_for_a_corrupt_model(tmp_path, echo_path):
    bad = tmp_path / "model.onnx"
    bad.write_bytes(echo_path.read_bytes()[:100])
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "ortbatch.cli", "bench", str(bad), "--requests", "4", "--concurrency", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1
    assert "Traceback" not in out.stderr and "cannot load the ONNX model" in out.stderr


# -- defect 12 and 7: IOBinding on a device ----------------------------------------------------


class _RecordingBinding:
    def __init__(self):
        self.calls: list[tuple] = []

    def clear_binding_inputs(self):
        self.calls.append(("clear_in",))

    def clear_binding_outputs(self):
        self.calls.append(("clear_out",))

    def bind_cpu_input(self, name, arr):
        self.calls.append(("cpu_input", name, arr.flags["C_CONTIGUOUS"]))

    def bind_ortvalue_input(self, name, value):  # pragma: no cover - must not be used
        self.calls.append(("ortvalue_input", name))

    def bind_output(self, name, device, device_id):
        self.calls.append(("output", name, device, device_id))

    def copy_outputs_to_cpu(self):
        return [np.zeros(2, np.float32)]


class _CudaSession:
    """A session on CUDA device 1 as far as the runner can tell (no GPU needed)."""

    def __init__(self):
        self.io = _RecordingBinding()
        self.runs = 0

    def get_providers(self):
        return [CUDA, CPU]

    def get_provider_options(self):
        return {CUDA: {"device_id": "1"}, CPU: {}}

    def io_binding(self):
        return self.io

    def run_with_iobinding(self, io):
        self.runs += 1


def test_device_inputs_are_bound_from_the_host_so_ort_copies_them_on_its_stream():
    sess = _CudaSession()
    runner = DeviceRunner(sess)
    assert device_of(sess) == ("cuda", 1)  # from the provider's options, not a hard-coded 0
    binding = runner.binding()
    feed = {"x": np.arange(6, dtype=np.float32).reshape(2, 3)[:, ::2]}  # not contiguous
    out = runner.run(binding, feed, ["y"])
    assert sess.runs == 1 and len(out) == 1
    assert ("cpu_input", "x", True) in sess.io.calls
    assert ("output", "y", "cuda", 1) in sess.io.calls
    assert not [c for c in sess.io.calls if c[0] == "ortvalue_input"]


# -- defect 8: tolerances from the arithmetic really used ---------------------------------------


def test_arithmetic_and_tolerances_follow_the_provider_not_the_dtype():
    assert arithmetic(CPU) == "fp32"
    assert arithmetic(CUDA) == "tf32"  # the CUDA EP's default
    assert arithmetic(CUDA, {"use_tf32": "0"}) == "fp32"
    assert arithmetic(TRT, {"trt_fp16_enable": True}) == "fp16"  # fp32 I/O, fp16 inside
    assert arithmetic(TRT, {}) == "tf32"
    assert arithmetic(CPU, {}, "fp16") == "fp16"
    assert output_tolerance(CPU) < output_tolerance(CUDA) < output_tolerance(TRT, {"trt_fp16_enable": "1"})
    assert fp32_parity_options(CUDA) == {"use_tf32": "0"}
    assert fp32_parity_options(CUDA, {"use_tf32": "1"}) == {"use_tf32": "1"}  # the user's choice stands
    assert fp32_parity_options(TRT, {"a": 1}) == {"a": 1}
    fp32, fp16 = {"atol": 1e-4, "rtol": 1e-3, "cosine": 0.9999}, {"atol": 2e-2, "rtol": 2e-2}
    assert parity_tolerances("fp32", fp32, fp16) == fp32
    assert parity_tolerances("fp16", fp32, fp16) == fp16
    tf32 = parity_tolerances("tf32", fp32, fp16)
    assert tf32["atol"] == 1e-2 and tf32["cosine"] == 0.999


# -- acceptance 2: provider names live in one layer -------------------------------------------


def test_provider_names_appear_only_in_the_ort_layer():
    hits = []
    for path in sorted((REPO / "ortbatch").rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        if rel.startswith("ortbatch/_ort/"):
            continue
        for no, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"(CUDA|Tensorrt|CPU)ExecutionProvider", line):
                hits.append(f"{rel}:{no}: {line.strip()}")
    assert not hits, "\n".join(hits)


def test_runtime_does_not_import_export():
    for path in sorted((REPO / "ortbatch" / "runtime").glob("*.py")):
        text = path.read_text()
        assert "..export" not in text and "ortbatch.export" not in text, path
