"""``ortbatch bench`` end to end on tiny models: the JSON schema, identical requests in every
mode, outputs that agree, and the plot. Timings are never asserted."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ortbatch.cli import main
from ortbatch.manifest import InputSpec, Manifest, OutputSpec
from ortbatch.runtime.executor import cpu_count

pytest.importorskip("onnxruntime")

RESULT_KEYS = {
    "mode",
    "concurrency",
    "completed",
    "errors",
    "error_samples",
    "truncated",
    "hung",
    "elapsed_s",
    "cpu_s",
    "requests_per_s",
    "tokens_per_s",
    "latency_ms",
    "batches",
    "mean_rows_per_batch",
    "padding_fraction",
    "rows_histogram",
    "served",
    "request_digest",
}
TOP_KEYS = {
    "schema",
    "ortbatch",
    "started",
    "machine",
    "config",
    "target",
    "workload",
    "settings",
    "results",
    "ratios",
    "checks",
    "overhead",
}


def _bench(tmp_path: Path, target: Path, *extra: str) -> dict:
    out = tmp_path / "bench.json"
    rc = main(["bench", str(target), "--json", str(out), "--no-progress", "--warmup", "4", *extra])
    assert rc == 0
    return json.loads(out.read_text())


def test_json_schema_and_identical_requests(tmp_path: Path, echo_path: Path, capsys) -> None:
    png = tmp_path / "bench.png"
    data = _bench(
        tmp_path,
        echo_path,
        "--concurrency",
        "1,3",
        "--requests",
        "40",
        "--lengths",
        "2-9",
        "--plot",
        str(png),
        "--no-overhead",
        "--seed",
        "7",
    )
    assert set(data) == TOP_KEYS
    assert data["schema"] == "ortbatch.bench/1"
    assert data["config"]["concurrency"] == [1, 3]
    assert data["config"]["lengths"] == "2-9"
    wl = data["workload"]
    assert wl["requests"] == 40 and 2 <= wl["length"]["min"] <= wl["length"]["max"] <= 9
    assert len(wl["digest"]) == 64

    results = data["results"]
    assert [(r["mode"], r["concurrency"]) for r in results] == [
        ("direct", 1),
        ("batched", 1),
        ("oracle", 1),
        ("direct", 3),
        ("batched", 3),
        ("oracle", 3),
    ]
    for r in results:
        assert set(r) >= RESULT_KEYS, RESULT_KEYS - set(r)
        assert r["completed"] == 40 and r["errors"] == 0 and not r["truncated"] and r["served"] == 40
        assert set(r["latency_ms"]) >= {"p50", "p95", "p99", "mean", "max"}
        assert r["latency_ms"]["p50"] <= r["latency_ms"]["p95"] <= r["latency_ms"]["p99"]
        assert r["requests_per_s"] > 0 and r["tokens_per_s"] > 0
        # every mode served exactly the workload's requests, byte for byte
        assert r["request_digest"] == wl["digest"], r["mode"]
        assert sum(int(k) * v for k, v in r["rows_histogram"].items()) == 40
        assert 0.0 <= r["padding_fraction"] < 1.0
    direct = [r for r in results if r["mode"] == "direct"]
    assert all(r["mean_rows_per_batch"] == 1.0 and r["padding_fraction"] == 0.0 for r in direct)
    oracle = [r for r in results if r["mode"] == "oracle"]
    assert all(r["batches"] == 2 and r["mean_rows_per_batch"] == 20.0 for r in oracle)  # 40 / max batch 32
    # the oracle pads, so unless every length is equal some padding shows
    assert oracle[0]["padding_fraction"] > 0

    assert [r["concurrency"] for r in data["ratios"]] == [1, 3]
    by = {(r["mode"], r["concurrency"]): r for r in results}
    for r in data["ratios"]:
        c = r["concurrency"]
        rps = {m: by[m, c]["requests_per_s"] for m in ("direct", "batched", "oracle")}
        assert r["batched_over_direct"] == pytest.approx(rps["batched"] / rps["direct"], rel=0.01, abs=0.002)
        assert r["batched_over_oracle"] == pytest.approx(rps["batched"] / rps["oracle"], rel=0.01, abs=0.002)
        assert r["oracle_over_direct"] == pytest.approx(rps["oracle"] / rps["direct"], rel=0.01, abs=0.002)
        p50 = {m: by[m, c]["latency_ms"]["p50"] for m in ("direct", "batched")}
        assert r["p50_batched_over_direct"] == pytest.approx(p50["batched"] / p50["direct"], rel=0.01, abs=0.002)
    checks = data["checks"]
    assert checks["reference"] == "direct" and len(checks["probes"]) == 8
    assert checks["batched"]["ok"] and checks["oracle"]["ok"]
    assert set(checks["batched"]["max_abs_diff"]) == {"hidden", "pooled", "extra_out"}

    assert set(data["settings"]) == {"direct", "batched", "oracle"}
    assert data["settings"]["direct"]["session"]["intra_op_num_threads"] == 0  # ORT's default, untouched
    assert data["settings"]["batched"]["max_batch_size"] == 32
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "batched/direct" in printed and "oracle" in printed


def test_poisson_arrivals_are_part_of_the_identical_workload(tmp_path: Path, echo_path: Path) -> None:
    args = ("--concurrency", "2", "--requests", "16", "--lengths", "3-5", "--arrival", "poisson")
    args += ("--no-overhead", "--modes", "direct,batched")
    a = _bench(tmp_path, echo_path, *args, "--rate", "2000")
    b = _bench(tmp_path, echo_path, *args, "--rate", "1000")
    assert a["workload"]["arrival"] == "poisson"
    # same requests, other arrival times: a different workload
    assert a["workload"]["digest"] != b["workload"]["digest"]
    assert [r["mode"] for r in a["results"]] == ["direct", "batched"]
    for run in (a, b):
        assert all(r["request_digest"] == run["workload"]["digest"] for r in run["results"])


def test_export_dir_with_manifest_and_real_text_lengths(tmp_path: Path, echo_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    export = tmp_path / "export"
    export.mkdir()
    (export / "model.onnx").write_bytes(echo_path.read_bytes())
    seq = ("batch", "sequence")
    Manifest(
        inputs={
            "input_ids": InputSpec("int64", seq, 0),
            "attention_mask": InputSpec("int64", seq, 0),
            "extra": InputSpec("float32", ("batch", None), 0),
        },
        outputs={
            "hidden": OutputSpec(("batch", "sequence", None)),
            "pooled": OutputSpec(("batch", None)),
            "extra_out": OutputSpec(("batch", None)),
        },
        limits={"max_batch_size": 64, "max_sequence_length": 64},
    ).save(export)
    words = ["the", "a", "of", "to", "and", "in", "is", "it", "you", "that"]
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.enable_padding(length=64)  # exported tokenizers often pad: the bench must not
    tok.save(str(export / "tokenizer.json"))
    texts = tmp_path / "texts.txt"
    texts.write_text("the a of\nto and in is it you that the a\n\nit\n")

    data = _bench(
        tmp_path, export, "--concurrency", "2", "--requests", "12", "--lengths", f"texts:{texts}", "--no-overhead"
    )
    assert data["target"]["manifest"] is True
    assert data["workload"]["lengths"] == f"texts:{texts}"
    assert {data["workload"]["length"]["min"], data["workload"]["length"]["max"]} <= {1, 3, 9}
    assert all(r["request_digest"] == data["workload"]["digest"] for r in data["results"])
    assert data["checks"]["batched"]["ok"] and data["checks"]["oracle"]["ok"]


def test_overhead_section(tmp_path: Path, echo_path: Path) -> None:
    pytest.importorskip("onnx")
    data = _bench(
        tmp_path,
        echo_path,
        "--concurrency",
        "4",
        "--requests",
        "8",
        "--lengths",
        "4",
        "--modes",
        "direct,batched",
        "--overhead-requests",
        "300",
    )
    o = data["overhead"]
    assert o["concurrency"] == 4 and o["target_us"] == 100.0 and o["requests"] == 300
    labels = [row["label"] for row in o["rows"]]
    assert labels[0].startswith("direct") and labels[1].startswith("batched") and "submit" in labels[2]
    for row in o["rows"]:
        assert row["completed"] == o["requests"] and row["us_per_request"] > 0
    assert o["us_per_request_at_saturation"] == o["rows"][1]["us_per_request"]


@pytest.mark.parametrize(
    "argv",
    [
        ["--concurrency", "0"],
        ["--concurrency", "a,b"],
        ["--arrival", "burst"],
        ["--baseline-option", "noequals"],
    ],
)
def test_bad_arguments_are_usage_errors(echo_path: Path, argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", str(echo_path), *argv])
    assert exc.value.code == 2


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--lengths", "9-3"], "--lengths"),
        (["--arrival", "poisson"], "--rate"),
        (["--modes", "direct,fast"], "unknown mode"),
    ],
)
def test_bad_settings_fail_with_a_message(echo_path: Path, argv: list[str], message: str, capsys) -> None:
    assert main(["bench", str(echo_path), "--no-progress", "--requests", "4", *argv]) == 1
    assert message in capsys.readouterr().err


def test_missing_target(tmp_path: Path, capsys) -> None:
    assert main(["bench", str(tmp_path / "nope.onnx"), "--no-progress"]) == 2  # a bad argument
    assert "does not exist; expected an export directory or a .onnx file" in capsys.readouterr().err


def test_baseline_option_reaches_the_direct_session(tmp_path: Path, echo_path: Path) -> None:
    data = _bench(
        tmp_path,
        echo_path,
        "--concurrency",
        "1",
        "--requests",
        "4",
        "--lengths",
        "3",
        "--no-overhead",
        "--modes",
        "direct,oracle",
        "--baseline-option",
        "intra_op_num_threads=1",
        "--baseline-option",
        "session.intra_op.allow_spinning=0",
    )
    session = data["settings"]["direct"]["session"]
    assert session["intra_op_num_threads"] == 1 and session["intra_op_allow_spinning"] == "0"
    assert data["settings"]["oracle"]["session"] == session
    assert "batched" not in data["settings"]
    assert np.isfinite(data["results"][0]["requests_per_s"])


@pytest.mark.skipif(cpu_count() < 2, reason="no latency session on one core")
def test_latency_session_is_reported_and_can_be_turned_off(tmp_path: Path, echo_path: Path) -> None:
    args = ("--concurrency", "1", "--requests", "4", "--lengths", "3", "--no-overhead", "--modes", "batched")
    on = _bench(tmp_path, echo_path, *args, "--workers", "2")["settings"]["batched"]
    assert on["latency_session"]["intra_op_num_threads"] > on["session"]["intra_op_num_threads"]
    off = _bench(tmp_path, echo_path, *args, "--workers", "2", "--no-latency-session")["settings"]["batched"]
    assert off["latency_session"] is None


def test_duration_alone_sizes_the_run_and_caps_it(tmp_path: Path, echo_path: Path) -> None:
    data = _bench(
        tmp_path,
        echo_path,
        "--concurrency",
        "2",
        "--duration",
        "0.5",
        "--lengths",
        "3-6",
        "--no-overhead",
        "--modes",
        "direct,batched",
    )
    n = data["config"]["requests"]
    assert n >= 64 and data["workload"]["requests"] == n
    for r in data["results"]:
        # either all n were served, or the cap stopped it and it says so
        assert r["completed"] == n or (r["truncated"] and 0 < r["completed"] < n)
        if r["truncated"]:
            assert r["request_digest"] != data["workload"]["digest"]
