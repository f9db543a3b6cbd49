"""The generation benchmark's modes agree token for token (on the fake decoder, no torch)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    path = ROOT / "benchmarks" / "generation.py"
    spec = importlib.util.spec_from_file_location("ortbatch_generation_bench", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def test_modes_agree_and_report(bench, fake_dir: Path, tmp_path: Path, no_thread_leak: None) -> None:
    out_json, out_md = tmp_path / "b.json", tmp_path / "b.md"
    rc = bench.main(
        [
            "--model",
            str(fake_dir),
            "--requests",
            "10",
            "--prompt-lengths",
            "2-12",
            "--new-tokens",
            "3-20",
            "--max-batch-size",
            "4",
            "--modes",
            "sequential,static,continuous,continuous-logprobs,continuous-export-graph,genai",
            "--json",
            str(out_json),
            "--markdown",
            str(out_md),
            "--save-outputs",
        ]
    )
    assert rc == 0
    data = json.loads(out_json.read_text())
    modes = {r["mode"]: r for r in data["results"]}
    for r in modes.values():  # --save-outputs: the tokens whose digest outputs_sha256 is (to compare peers)
        assert len(r["outputs"]) == 10 and sum(map(len, r["outputs"])) == r["tokens"]
        assert hashlib.sha256(json.dumps(r["outputs"]).encode()).hexdigest() == r["outputs_sha256"]
    assert set(modes) == {"sequential", "static", "continuous", "continuous-logprobs", "continuous-export-graph"}
    assert all(r["same_as_sequential"] == 10 for r in modes.values())
    assert len({r["tokens"] for r in modes.values()}) == 1
    assert "genai" in data["skipped"]  # not a Llama preset: said why, not silently dropped
    assert "| continuous |" in out_md.read_text()
    assert "continuous-logprobs / continuous tokens/s:" in out_md.read_text()
    assert modes["continuous-logprobs"]["note"].startswith("logprobs=5 on every row")


def test_baselines_on_the_rewritten_graph(bench, tiny_gpt2, tmp_path: Path, no_thread_leak: None) -> None:
    """--baseline-graph rewritten: the plain loop runs BatchedGenerator's graph on the
    export's own cache; every mode, rewritten or not, in place or not, with or without the
    prefix cache, produces the same tokens, and each says which graph and cache it ran."""
    out_json, out_md = tmp_path / "b.json", tmp_path / "b.md"
    args = ["--model", str(tiny_gpt2.export), "--requests", "6", "--prompt-lengths", "3-9", "--new-tokens", "2-9"]
    modes = "sequential,static,continuous,continuous-concat,continuous-no-prefix-cache,continuous-export-graph"
    rc = bench.main(
        [
            *args,
            *("--max-batch-size", "3", "--shared-prefix", "20", "--modes", modes, "--baseline-graph", "rewritten"),
            *("--json", str(out_json), "--markdown", str(out_md)),
        ]
    )
    assert rc == 0
    results = {r["mode"]: r for r in json.loads(out_json.read_text())["results"]}
    assert not any("outputs" in r for r in results.values())  # only with --save-outputs
    assert all(r["same_as_sequential"] == 6 for r in results.values())
    assert len({r["outputs_sha256"] for r in results.values()}) == 1
    rewritten = "graph rewrites: attention-scale-after-scores, last-position-logits"
    for mode in ("sequential", "static", "continuous-concat"):
        assert rewritten in results[mode]["note"], mode
    assert "graph rewrites: in-place-kv-cache, last-position-logits" in results["continuous"]["note"]
    assert results["continuous"]["kv_cache"] == "in-place" and results["continuous-concat"]["kv_cache"] == "concat"
    assert "prefix cache 5 hits, 80 tokens saved" in results["continuous"]["note"]  # 16 of the shared 20
    assert "prefix cache" not in results["continuous-no-prefix-cache"]["note"]
    assert "graph rewrites: none" in results["continuous-export-graph"]["note"]
    text = out_md.read_text()
    assert "continuous / continuous-concat: tokens/s" in text and "same tokens 6/6" in text


def test_decode_floor_bounds_a_run(bench, tiny_gpt2, tmp_path: Path, no_thread_leak: None) -> None:
    """benchmarks/decode_floor.py charges a run's decode steps at the free-cache step time: a
    ceiling on tokens/s that the run itself cannot be far above (only timing noise: the floor
    is measured separately), and refuses runs of different workloads."""
    run = tmp_path / "run.json"
    common = ["--model", str(tiny_gpt2.export), "--requests", "6", "--prompt-lengths", "3-9", "--new-tokens", "4-9"]
    assert bench.main([*common, "--max-batch-size", "3", "--modes", "continuous", "--json", str(run)]) == 0
    stats = json.loads(run.read_text())["results"][0]
    assert stats["decode_steps"] > 0 and 0 < stats["mean_decode_rows"] <= 3
    assert stats["decode_time_s"] > 0 and stats["prefill_time_s"] > 0

    spec = importlib.util.spec_from_file_location("ortbatch_decode_floor", ROOT / "benchmarks" / "decode_floor.py")
    assert spec is not None and spec.loader is not None
    floor = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(floor)
    out = tmp_path / "floor.json"
    args = ["--export", str(tiny_gpt2.export), "--new", str(run), "--old", str(run), "--rows", "1,2,3", "--reps", "3"]
    assert floor.main([*args, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["export_graph_step_ms"]) == {"1", "2", "3"} and result["generator_step_ms"]
    assert result["free_cache_decode_s"] == pytest.approx(stats["decode_steps"] * result["free_cache_step_ms"] / 1e3)
    assert result["ceiling_tokens_per_s"] == pytest.approx(
        stats["tokens"] / (stats["prefill_time_s"] + result["free_cache_decode_s"])
    )
    other = tmp_path / "other.json"
    data = json.loads(run.read_text())
    data["results"][0]["tokens"] += 1
    other.write_text(json.dumps(data))
    with pytest.raises(SystemExit, match="not the same workload"):
        floor.main([*args[:4], "--old", str(other)])


def test_vllm_script_reports_with_the_same_digest(bench, monkeypatch: pytest.MonkeyPatch) -> None:
    # benchmarks/vllm_cpu.py (run in a vLLM venv, not here) imports without vLLM and digests
    # its tokens with generation.py's function, so equal digests mean equal tokens across the two
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("ortbatch_vllm_bench", ROOT / "benchmarks" / "vllm_cpu.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    outputs = [[5, 7, 9], [], [11]]
    want = hashlib.sha256(json.dumps(outputs).encode()).hexdigest()
    assert module.outputs_sha256(outputs) == want == bench.outputs_sha256(outputs)
    assert "vllm" not in sys.modules


def test_provider_options_reach_the_first_provider(bench) -> None:
    # --provider-option use_tf32=0 (how the GPU check compares TF32 with full fp32 on CUDA)
    assert bench.provider_chain("cpu") == "cpu"
    chain = bench.provider_chain("cuda", ["use_tf32=0", "device_id=0"])
    assert chain == [("CUDAExecutionProvider", {"use_tf32": "0", "device_id": "0"}), ("CPUExecutionProvider", {})]
    with pytest.raises(ValueError, match="KEY=VALUE, got 'use_tf32'"):
        bench.provider_chain("cuda", ["use_tf32"])


def test_the_baselines_run_cuda_as_batchedgenerator_does(bench, fake_dir: Path, monkeypatch) -> None:
    # TF32 off unless asked for, in the plain loop too: otherwise "same tokens as sequential"
    # would compare fp32 with TF32 arithmetic on a GPU
    import ortbatch._ort as ort_layer

    seen, real = [], ort_layer.build_session

    def recording(model, providers, **kw):  # record what was asked; build it on CPU here
        seen.append(providers)
        return real(model, [("CPUExecutionProvider", {})], **kw)

    monkeypatch.setattr(ort_layer, "build_session", recording)
    bench.DirectLoop(fake_dir, providers="cuda")
    bench.DirectLoop(fake_dir, providers=bench.provider_chain("cuda", ["use_tf32=1"]))
    assert seen[0][0] == ("CUDAExecutionProvider", {"use_tf32": "0"})
    assert seen[1][0] == ("CUDAExecutionProvider", {"use_tf32": "1"})
