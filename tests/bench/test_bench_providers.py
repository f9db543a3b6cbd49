"""ortbatch bench resolves providers as BatchedSession does: manifest options merged per
key, relative TensorRT cache paths under the export directory (defect 9), and output
checks against the tolerance of the arithmetic really used (defect 8)."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import numpy as np

import ortbatch._ort as ort_layer
from ortbatch.bench import runner

TRT = "TensorrtExecutionProvider"


def test_baseline_cache_paths_land_in_the_export_not_the_cwd(tmp_path, echo_path, monkeypatch):
    export = tmp_path / "export"
    export.mkdir()
    shutil.copy(echo_path, export / "model.onnx")
    opts = {"trt_engine_cache_enable": True, "trt_engine_cache_path": "trt_cache/k/engines", "trt_fp16_enable": True}
    manifest = {"format": 1, "model": "model.onnx", "providers": [[TRT, opts], ["CPUExecutionProvider", {}]]}
    (export / "ortbatch.json").write_text(json.dumps(manifest))
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    seen = []
    monkeypatch.setattr(ort_layer, "build_session", lambda model, providers, **kw: seen.append(providers) or "sess")
    assert runner.baseline_for(export, "trt", {}) == "sess"
    trt_opts = dict(seen[0])[TRT]
    assert trt_opts["trt_engine_cache_path"] == str(export / "trt_cache/k/engines")
    assert trt_opts["trt_fp16_enable"] is True
    assert not any(elsewhere.iterdir())  # nothing created in the current directory


def _session(provider, options):
    return SimpleNamespace(get_providers=lambda: [provider], get_provider_options=lambda: {provider: options})


def test_output_check_tolerance_follows_the_provider():
    ref = {0: [np.zeros(4, np.float32), np.zeros(2, np.int64)]}
    names = ["hidden", "ids"]
    assert runner._tolerance(ref, "ids", names, _session("CUDAExecutionProvider", {})) == 0.0
    cpu = runner._tolerance(ref, "hidden", names, _session("CPUExecutionProvider", {}))
    tf32 = runner._tolerance(ref, "hidden", names, _session("CUDAExecutionProvider", {"use_tf32": "1"}))
    fp16 = runner._tolerance(ref, "hidden", names, _session(TRT, {"trt_fp16_enable": "1"}))
    assert cpu == 1e-3 and tf32 == 1e-2 and fp16 == 5e-2
