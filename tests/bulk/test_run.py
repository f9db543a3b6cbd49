"""``ortbatch run`` / ``ortbatch.run``: every row computed as it would be alone, in its
place; failures in the errors file; SIGKILL at fixed points and a rerun give the bytes an
uninterrupted run gives."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import ortbatch
from ortbatch.bulk import OutputError, RunConfig

from .conftest import alone, cli, mixed_texts, output_bytes, write_jsonl


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_rows_equal_the_session_alone_in_input_order(encoder: Path, tmp_path: Path) -> None:
    texts = mixed_texts(53)
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": t, "key": f"k{i}"} for i, t in enumerate(texts)])
    summary = ortbatch.run(encoder, src, tmp_path / "out", window=16, id_column="key", progress=False)
    assert (summary.rows, summary.succeeded, summary.failed, summary.exit_code) == (53, 53, 0, 0)
    assert summary.shards == 4
    table = pq.read_table(tmp_path / "out")  # the folder reads as one dataset (_files skipped)
    assert table.column("row").to_pylist() == list(range(53))
    assert table.column("id").to_pylist() == [f"k{i}" for i in range(53)]
    assert pa.types.is_fixed_size_list(table.schema.field("embedding").type)
    got = table.column("embedding").to_numpy(zero_copy_only=False)
    ref = alone(encoder, texts)
    for i, (g, r) in enumerate(zip(got, ref, strict=True)):
        assert _cos(np.asarray(g), r) >= 0.9999, i
    manifest = json.loads((tmp_path / "out" / "_manifest.json").read_text())
    assert [(s["start"], s["end"]) for s in manifest["shards"]] == [(0, 16), (16, 32), (32, 48), (48, 53)]


def test_jsonl_output_csv_parquet_and_folder_inputs(encoder: Path, tmp_path: Path) -> None:
    texts = mixed_texts(12, seed=1)
    folder = tmp_path / "in"
    folder.mkdir()
    with open(folder / "a.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["text"])
        w.writerows([[t] for t in texts[:5]])
    pq.write_table(pa.table({"text": texts[5:9]}), folder / "b.parquet", row_group_size=2)
    write_jsonl(folder / "c.jsonl", [{"text": t} for t in texts[9:]])
    summary = ortbatch.run(encoder, folder, tmp_path / "out", window=5, output_format="jsonl", progress=False)
    assert summary.ok
    lines = [json.loads(x) for p in sorted((tmp_path / "out").glob("part-*.jsonl")) for x in p.read_text().splitlines()]
    assert [x["row"] for x in lines] == list(range(12))
    for line, ref in zip(lines, alone(encoder, texts), strict=True):
        assert _cos(np.array(line["embedding"]), ref) >= 0.9999


def test_failed_rows_go_to_the_errors_file_with_their_ids(poisoned: tuple[Path, list[str]], tmp_path: Path) -> None:
    export, bad_words = poisoned
    good = mixed_texts(9, seed=2)
    good = [" ".join(w for w in t.split() if w not in bad_words) or "hello" for t in good]
    lines: list[object] = [{"id": f"g{i}", "text": t} for i, t in enumerate(good)]
    lines.insert(2, {"id": "long", "text": " ".join(["fox"] * 40)})  # 42 tokens > 16
    lines.insert(4, b'{"id": "latin1", "text": "caf\xe9"}')  # not UTF-8
    lines.insert(6, {"id": "poison", "text": f"hello {bad_words[0]} world"})  # the model fails on it
    lines.insert(8, {"id": "notext", "body": 1})
    lines.insert(9, {"id": "surrogate", "text": "\ud800"})
    src = write_jsonl(tmp_path / "in.jsonl", lines)
    summary = ortbatch.run(export, src, tmp_path / "out", window=8, id_column="id", progress=False)
    assert summary.rows == 14 and summary.succeeded == 9 and summary.failed == 5 and summary.exit_code == 3
    errors = [json.loads(x) for x in (tmp_path / "out" / "_errors.jsonl").read_text().splitlines()]
    by_row = {e["row"]: e for e in errors}
    assert by_row[2]["id"] == "long" and by_row[2]["error"] == "too_long"
    assert by_row[4]["error"] == "invalid_utf8"  # an undecodable line has no id to give
    assert by_row[6]["id"] == "poison" and by_row[6]["error"] == "rejected"
    assert by_row[8]["id"] == "notext" and by_row[8]["error"] == "invalid_input"
    assert by_row[9]["id"] == "surrogate" and by_row[9]["error"] == "invalid_utf8"
    table = pq.read_table(tmp_path / "out")
    assert table.column("id").to_pylist() == [f"g{i}" for i in range(9)]
    for g, r in zip(table.column("embedding").to_numpy(zero_copy_only=False), alone(export, good), strict=True):
        assert _cos(np.asarray(g), r) >= 0.9999
    # --truncate: the long row is cut to the limit and succeeds
    again = ortbatch.run(export, src, tmp_path / "cut", window=8, id_column="id", truncate=True, progress=False)
    assert again.failed == 4 and "too_long" not in again.failures


@pytest.fixture(scope="module")
def reference_run(encoder: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, bytes]]:
    root = tmp_path_factory.mktemp("ref")
    texts = mixed_texts(40, seed=3)
    docs: list[object] = [{"text": t} for t in texts]
    docs[13] = {"text": " ".join(["dog"] * 30)}  # one failure, so the errors file is compared too
    src = write_jsonl(root / "in.jsonl", docs)
    proc = cli(str(encoder), str(src), "-o", str(root / "out"), "--window", "8")
    assert proc.returncode == 3, proc.stderr
    return src, output_bytes(root / "out")


@pytest.mark.parametrize("point", ["1:committed", "2:computed", "2:written", "3:renamed"])
def test_sigkill_then_rerun_gives_the_uninterrupted_bytes(
    encoder: Path, reference_run: tuple[Path, dict[str, bytes]], tmp_path: Path, point: str
) -> None:
    src, want = reference_run
    out = tmp_path / "out"
    args = (str(encoder), str(src), "-o", str(out), "--window", "8")
    killed = cli(*args, env={"ORTBATCH_RUN_KILL_AT": point})
    assert killed.returncode == -9, killed.stderr  # it really died by SIGKILL, there
    shard = int(point.split(":")[0])
    committed = len(list((out / "_shards").glob("*.json")))
    assert committed == (shard + 1 if point.endswith("committed") else shard)
    again = cli(*args)
    assert again.returncode == 3, again.stderr
    assert f"resumed after {committed * 8} rows" in again.stderr
    assert output_bytes(out) == want
    assert not list(out.glob(".*.tmp")) and not list((out / "_shards").glob(".*"))


def test_ctrl_c_keeps_the_committed_shards_and_a_rerun_completes_them(
    encoder: Path, reference_run: tuple[Path, dict[str, bytes]], tmp_path: Path
) -> None:
    src, want = reference_run
    out = tmp_path / "out"
    args = (str(encoder), str(src), "-o", str(out), "--window", "8")
    stopped = cli(*args, env={"ORTBATCH_RUN_KILL_AT": "2:written:INT"})  # Ctrl-C while shard 2 is written
    assert stopped.returncode == 130, stopped.stderr
    assert "rerun the same command to resume" in stopped.stderr and "Traceback" not in stopped.stderr
    assert len(list((out / "_shards").glob("*.json"))) == 2
    again = cli(*args)
    assert again.returncode == 3 and "resumed after 16 rows" in again.stderr
    assert output_bytes(out) == want


@pytest.mark.parametrize("kind", ["parquet", "csv", "folder"])
def test_resume_skips_exactly_the_committed_rows_of_each_input_kind(encoder: Path, tmp_path: Path, kind: str) -> None:
    texts = mixed_texts(17, seed=6)
    if kind == "parquet":
        src = tmp_path / "in.parquet"
        pq.write_table(pa.table({"text": texts}), src, row_group_size=4)  # resume points inside row groups
    elif kind == "csv":
        src = tmp_path / "in.csv"
        with open(src, "w", newline="") as f:
            csv.writer(f).writerows([["text"], *([t.replace(" ", "\n", 1)] for t in texts)])  # quoted newlines
    else:
        src = tmp_path / "in"
        src.mkdir()
        write_jsonl(src / "a.jsonl", [{"text": t} for t in texts[:5]])
        pq.write_table(pa.table({"text": texts[5:11]}), src / "b.parquet", row_group_size=4)
        write_jsonl(src / "c.jsonl", [{"text": t} for t in texts[11:]])
    out = tmp_path / "out"
    ortbatch.run(encoder, src, out, window=3, progress=False)
    want = output_bytes(out)
    # as after a crash once shard 1 was committed: later shards' manifests gone, their files left over
    for p in sorted((out / "_shards").glob("*.json"))[2:]:
        p.unlink()
    again = ortbatch.run(encoder, src, out, window=3, progress=False)
    assert again.resumed_rows == 6 and again.rows == 17
    assert output_bytes(out) == want


def test_resume_computes_only_the_windows_missing_between_committed_ones(encoder: Path, tmp_path: Path) -> None:
    """A ``--ray`` run commits shards as they finish, so an interrupted one leaves gaps; a
    resume (here the local one) computes just those windows and writes the same bytes."""
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in mixed_texts(23, seed=8)])
    out = tmp_path / "out"
    ortbatch.run(encoder, src, out, window=4, progress=False)
    want = output_bytes(out)
    for k in (1, 3, 5):  # windows 1, 3 and 5 (the short last one) were not committed
        (out / "_shards" / f"{k:06d}.json").unlink()
    (out / "part-000003.parquet").unlink()
    kept = {p.name: p.stat().st_ino for p in out.glob("part-*") if p.name[5:11] not in ("000001", "000003", "000005")}
    again = ortbatch.run(encoder, src, out, window=4, progress=False)
    assert (again.rows, again.resumed_rows, again.shards) == (23, 23 - 4 - 4 - 3, 6)
    assert output_bytes(out) == want
    assert {name: (out / name).stat().st_ino for name in kept} == kept  # the committed ones were left alone


def test_resume_refuses_other_settings_and_restart_starts_over(encoder: Path, tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in mixed_texts(10, seed=4)])
    out = tmp_path / "out"
    ortbatch.run(encoder, src, out, window=4, progress=False)
    with pytest.raises(OutputError, match="different window"):
        ortbatch.run(encoder, src, out, window=5, progress=False)
    redo = ortbatch.run(encoder, src, out, RunConfig(window=5, restart=True, progress=False))
    assert redo.resumed_rows == 0 and redo.shards == 2
    done = ortbatch.run(encoder, src, out, window=5, progress=False)  # complete: nothing left to do
    assert done.resumed_rows == 10 and done.succeeded == 10
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(OutputError, match="did not write"):
        ortbatch.run(encoder, src, tmp_path / "mine", progress=False)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_cli_bad_arguments_are_one_line_errors(encoder: Path, tmp_path: Path) -> None:
    proc = cli(str(encoder), str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "out"))
    assert proc.returncode == 2 and "does not exist" in proc.stderr and "Traceback" not in proc.stderr
    proc = cli(str(tmp_path), str(tmp_path), "-o", str(tmp_path / "out"))
    assert proc.returncode == 2 and "is not an export" in proc.stderr and "Traceback" not in proc.stderr
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("x")
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "hello"}])
    proc = cli(str(encoder), str(src), "-o", str(tmp_path / "taken"))
    assert proc.returncode == 2 and "did not write" in proc.stderr and "Traceback" not in proc.stderr
    proc = cli(str(encoder), str(src), "-o", str(tmp_path / "out"), "--ray-concurrency", "2")
    assert proc.returncode == 2 and "--ray-concurrency needs --ray" in proc.stderr and "Traceback" not in proc.stderr
    proc = cli(str(encoder), str(src), "-o", str(tmp_path / "out"), "--ray", "--ray-cpus", "0")
    assert proc.returncode == 2 and "--ray-cpus: must be above 0" in proc.stderr and "Traceback" not in proc.stderr
    proc = cli(str(encoder), str(src), "-o", str(tmp_path / "out"), "--max-batch-size", "0")
    assert proc.returncode == 2 and "max_batch_size must be at least 1" in proc.stderr
    assert "Traceback" not in proc.stderr
    # an output the system will not create (here under a file): one line, not mkdir's traceback
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    proc = cli(str(encoder), str(src), "-o", str(blocker / "out"))
    assert proc.returncode == 1 and f"Not a directory: {blocker / 'out'}" in proc.stderr
    assert "Traceback" not in proc.stderr
    # a file that is not what its suffix says: one line naming it, nothing written
    fake = tmp_path / "fake.parquet"
    fake.write_text('{"text": "hello"}\n')
    proc = cli(str(encoder), str(fake), "-o", str(tmp_path / "fake-out"))
    assert proc.returncode == 2 and "fake.parquet is not a readable Parquet file" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_progress_lines_when_not_a_terminal(encoder: Path, tmp_path: Path) -> None:
    import io

    src = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in mixed_texts(6, seed=5)])
    stream = io.StringIO()
    ortbatch.run(encoder, src, tmp_path / "out", window=3, progress_every_s=0.0, stream=stream)
    lines = stream.getvalue().splitlines()
    assert lines[-1].startswith("ortbatch run: 6/6 rows") and "rows/s" in lines[-1] and "0 errors" in lines[-1]
    assert not any("\r" in x for x in lines)
    shutil.rmtree(tmp_path / "out")
