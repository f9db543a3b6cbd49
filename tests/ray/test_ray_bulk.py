"""``ortbatch run --ray`` (``ortbatch.bulk.ray_data``) on a real two-node local Ray cluster:
the same bytes as the local run, no row lost or duplicated when a worker (an actor process)
is SIGKILLed mid-job, and a resume after the driver is SIGKILLed.

Ray listens on all interfaces, so the cluster tests run only inside a network namespace that
has nothing but loopback: outside one, :func:`test_on_a_ray_cluster_in_a_loopback_only_namespace`
re-runs this module under ``unshare -n`` (skipped, with the reason, where unshare is not
permitted), as ``tests/ray/test_ray_serve.py`` does. One cluster for the module: two nodes of
one CPU each, so the job's two workers run one on each node.

Kills happen at events, never after a sleep: the worker given window ``PAUSED`` writes its pid
to a file and waits there (``ortbatch.bulk.ray_data.PAUSE_ENV``, armed by a file per test);
the test kills that pid (or the driver) once the file appears.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ray.data")
pytest.importorskip("pyarrow")
pytest.importorskip("tokenizers")
pytest.importorskip("onnx")

from tests.ray.netns import RAY_WARNINGS, inner_only, outer_only, rerun_in_loopback_namespace

pytestmark = [pytest.mark.slow, *RAY_WARNINGS]

REPO = Path(__file__).resolve().parents[2]
ROWS, WINDOW, PAUSED = 70, 8, 3  # 9 windows; the worker given window 3 is the one killed


@outer_only
@pytest.mark.timeout(900)
def test_on_a_ray_cluster_in_a_loopback_only_namespace() -> None:
    """Runs the cluster tests below in ``unshare -n`` with only ``lo`` up."""
    rerun_in_loopback_namespace(__file__, 900)


# -- the cluster (inner run only) --------------------------------------------------------------


@pytest.fixture(scope="module")
def pause_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("pause")


@pytest.fixture(scope="module")
def cluster(pause_folder: Path) -> Iterator[str]:
    """Two Ray nodes of one CPU each on this machine; yields the head's address."""
    import ray
    from ray.cluster_utils import Cluster

    from ortbatch.bulk.ray_data import PAUSE_ENV

    # the nodes' workers inherit it (set before the nodes start); it acts only while armed
    os.environ[PAUSE_ENV] = f"{PAUSED}:{pause_folder}"
    os.environ["PYTHONPATH"] = str(REPO)
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        c.add_node(num_cpus=1)
        c.wait_for_nodes()
        ray.init(address=c.address, log_to_driver=False)
        yield c.address
        ray.shutdown()
    finally:
        c.shutdown()


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny encoder, an input with rows that fail, and the local run's output."""
    import ortbatch
    from tests.bulk.conftest import mixed_texts, write_jsonl
    from tests.serve.tinymodels import build_encoder

    root = tmp_path_factory.mktemp("bulk-ray")
    export = build_encoder(root / "tiny-encoder", max_batch_size=4)
    docs: list[object] = [{"id": f"r{i}", "text": t} for i, t in enumerate(mixed_texts(ROWS, seed=7))]
    docs[5] = {"id": "long", "text": " ".join(["dog"] * 30)}  # too long: the errors file is compared too
    docs[20] = b'{"id": "latin1", "text": "caf\xe9"}'  # not UTF-8, read on the driver's node as locally
    src = write_jsonl(root / "in.jsonl", docs)
    summary = ortbatch.run(export, src, root / "local", window=WINDOW, id_column="id", progress=False)
    assert (summary.rows, summary.failed) == (ROWS, 2)
    return {"export": export, "input": src, "local": root / "local", "root": root}


def _output_bytes(out: Path) -> dict[str, bytes]:
    names = [*sorted(p.name for p in out.iterdir() if p.name.startswith("part-")), "_errors.jsonl"]
    return {n: (out / n).read_bytes() for n in names}


def _wait_for_file(path: Path, timeout_s: float = 300) -> None:
    """Block until ``path`` exists (the paused worker wrote it): an event, polled."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"timed out waiting for {path}"
        time.sleep(0.05)


def _workers() -> list[dict[str, object]]:
    """Every actor of the job's map stage, alive or dead: pid, node, state."""
    from ray._private.state import actors

    return [a for a in actors().values() if "ShardWorker" in str(a.get("ActorClassName", ""))]


@pytest.fixture
def armed(pause_folder: Path) -> Iterator[Path]:
    for p in pause_folder.iterdir():
        p.unlink()
    (pause_folder / "armed").touch()
    try:
        yield pause_folder / f"shard-{PAUSED}.pid"
    finally:
        (pause_folder / "armed").unlink()


@inner_only
def test_a_killed_worker_loses_and_duplicates_no_row_and_the_output_is_the_local_runs(
    cluster: str, job: dict[str, Path], armed: Path
) -> None:
    import ortbatch
    from ortbatch.bulk import RayOptions

    out = job["root"] / "ray"
    before = {str(a["ActorID"]) for a in _workers()}
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(
            ortbatch.run,
            job["export"],
            job["input"],
            out,
            window=WINDOW,
            id_column="id",
            progress=False,
            ray=RayOptions(concurrency=2),
        )
        _wait_for_file(armed)  # a worker holds window PAUSED and waits
        victim = int(armed.read_text())
        os.kill(victim, signal.SIGKILL)
        summary = running.result(timeout=600)
    assert (summary.rows, summary.succeeded, summary.failed, summary.resumed_rows) == (ROWS, ROWS - 2, 2, 0)
    assert summary.failures == {"invalid_utf8": 1, "too_long": 1}
    assert _output_bytes(out) == _output_bytes(job["local"])
    import pyarrow.parquet as pq

    rows = pq.read_table(out, columns=["row"]).column("row").to_pylist()
    assert rows == [r for r in range(ROWS) if r not in (5, 20)]  # each once, in order
    # the job's two workers ran one on each node; the victim's was restarted (once) in a new
    # process, which computed its window again
    mine = [a for a in _workers() if str(a["ActorID"]) not in before]
    assert len(mine) == 2 and len({a["Address"]["NodeID"] for a in mine}) == 2, mine  # type: ignore[index]
    assert sum(int(a["NumRestarts"]) for a in mine) == 1, mine  # type: ignore[call-overload]
    assert victim not in {a["Pid"] for a in mine}


def _cli(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "ortbatch.cli", "run", *args, "--quiet"],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@inner_only
def test_the_driver_sigkilled_mid_job_then_rerun_gives_the_local_bytes(
    cluster: str, job: dict[str, Path], armed: Path
) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.bulk.conftest import mixed_texts

    # a Parquet input this time: windows start inside its row groups
    src = job["root"] / "in.parquet"
    pq.write_table(pa.table({"passage": mixed_texts(ROWS, seed=8)}), src, row_group_size=5)
    local = job["root"] / "local-parquet"
    out = job["root"] / "ray-parquet"
    args = (str(job["export"]), str(src), "--text-column", "passage", "--window", str(WINDOW))
    ref = subprocess.run(
        [sys.executable, "-m", "ortbatch.cli", "run", *args, "-o", str(local), "--quiet"],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ref.returncode == 0, ref.stderr
    ray_args = (*args, "-o", str(out), "--ray", "--ray-address", cluster, "--ray-concurrency", "2")
    driver = _cli(*ray_args)
    _wait_for_file(armed)  # mid-job: window PAUSED is held by a worker
    driver.kill()
    driver.communicate(timeout=60)
    assert driver.returncode == -signal.SIGKILL
    committed = len(list((out / "_shards").glob("*.json")))
    assert committed < -(-ROWS // WINDOW)  # the job was cut short
    # the part files of the shards committed when the driver died (no window has failures)
    kept = {p.stem: (out / f"part-{p.stem}.parquet").stat().st_ino for p in (out / "_shards").glob("*.json")}
    again = _cli(*ray_args)
    _, stderr = again.communicate(timeout=600)
    assert again.returncode == 0, stderr
    assert "resumed after" in stderr or committed == 0, stderr
    assert _output_bytes(out) == _output_bytes(local)
    # the rerun computed only what was missing: the shards committed before the kill are
    # the same files, not written again
    assert {k: (out / f"part-{k}.parquet").stat().st_ino for k in kept} == kept
    assert not list(out.glob(".*.tmp")) and not list((out / "_shards").glob(".*"))


@inner_only
def test_generation_and_batch_api_jobs_give_the_local_bytes(cluster: str, job: dict[str, Path], tmp_path: Path) -> None:
    """The other kinds of job: a text-generation export (each worker owns a BatchedGenerator),
    an OpenAI Batch API file of embeddings lines, and one of completion lines (greedy, seeded,
    sampled with the line's derived seed, n choices; a chat line the export has no template
    for) on the text-generation export."""
    pytest.importorskip("torch")
    import ortbatch
    from ortbatch.bulk import RayOptions
    from tests.bulk.conftest import write_jsonl
    from tests.generation.conftest import CORPUS, _build

    gpt2 = _build("gpt2", tmp_path)
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": CORPUS[i % 4][: 5 + 7 * i]} for i in range(9)])
    lines = [
        {"custom_id": f"c{i}", "method": "POST", "url": "/v1/embeddings", "body": {"input": text}}
        for i, text in enumerate(["hello world", ["a lazy dog", "the quick brown fox"], "fox " * 30, "many callers"])
    ]
    lines.insert(2, {"custom_id": "gen", "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi"}})
    batch = write_jsonl(tmp_path / "batch.jsonl", lines)
    bodies: list[tuple[str, dict[str, Any]]] = [
        ("completions", {"prompt": "Once upon", "max_tokens": 6, "temperature": 0}),
        ("completions", {"prompt": "The quick", "max_tokens": 6}),
        ("chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("completions", {"prompt": ["a lazy", "Héllo"], "n": 2, "max_tokens": 4, "seed": 5}),
        ("completions", {"prompt": "Continuous", "max_tokens": 5, "top_k": 9, "seed": 1}),
    ]
    completions = write_jsonl(
        tmp_path / "completions.jsonl",
        [{"custom_id": f"g{i}", "method": "POST", "url": f"/v1/{u}", "body": b} for i, (u, b) in enumerate(bodies)],
    )
    cases = [(gpt2.export, prompts, {"max_new_tokens": 6}), (job["export"], batch, {}), (gpt2.export, completions, {})]
    for k, (export, src, extra) in enumerate(cases):
        common = {"window": 2, "output_format": "jsonl", "progress": False, **extra}
        local = ortbatch.run(export, src, tmp_path / f"local-{k}", **common)
        on_ray = ortbatch.run(export, src, tmp_path / f"ray-{k}", ray=RayOptions(concurrency=2), **common)
        timing = {"seconds": 0, "rows_per_s": 0, "tokens_per_s": 0, "output": "", "errors_file": ""}
        assert local.to_dict() | timing == on_ray.to_dict() | timing  # the same counts, failures and shards
        assert _output_bytes(tmp_path / f"ray-{k}") == _output_bytes(tmp_path / f"local-{k}")
        assert local.rows == len(src.read_text().splitlines())


@inner_only
def test_an_export_the_workers_cannot_load_is_a_clear_error_before_any_window(
    cluster: str, job: dict[str, Path], tmp_path: Path
) -> None:
    import ortbatch
    from ortbatch.errors import OrtBatchError

    broken = tmp_path / "broken"
    shutil.copytree(job["export"], broken)
    (broken / "model.onnx").write_bytes(b"not an onnx model")
    with pytest.raises(OrtBatchError, match=r"model\.onnx") as caught:
        ortbatch.run(broken, job["input"], tmp_path / "out", window=WINDOW, progress=False, ray=True)
    assert "Traceback" not in str(caught.value)
    assert not (tmp_path / "out").exists()  # nothing was written: no window was computed
