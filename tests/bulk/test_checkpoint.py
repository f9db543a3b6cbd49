"""Checkpoints inside a window (issue 46): ``ortbatch run`` on 2,000 rows SIGKILLed twice in the
middle of a window, then resumed, writes the bytes of an uninterrupted run, and redoes none of the
rows its progress had shown done (they are restored from the window's journal); the journal keeps
numpy outcomes exactly and drops a torn tail."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ortbatch.bulk.checkpoint import JOURNAL_DIR, WindowJournal, decode_outcome, encode_outcome, journal_rows
from ortbatch.bulk.sources import Row
from ortbatch.bulk.tasks import RowFailure
from tests.signals import sigint_default

from .conftest import REPO, mixed_texts, output_bytes, write_jsonl

ROWS = 2000
_PROGRESS = re.compile(r"^ortbatch run: (\d+)/(\d+) rows", re.M)


def _run(args: list[str], out: Path, log: Path, kill_at: str | None = None) -> subprocess.Popen[bytes]:
    """``ortbatch run`` in a real process, progress lines every batch into ``log`` (a file, so
    a stopped process never waits on a full pipe)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("ORTBATCH_RUN_KILL_AT", None)
    if kill_at is not None:
        env["ORTBATCH_RUN_KILL_AT"] = kill_at
    with open(log, "wb") as f:
        return subprocess.Popen(
            [sys.executable, "-m", "ortbatch.cli", "run", *args, "-o", str(out), "--progress-every", "0.001"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=f,
            preexec_fn=sigint_default,
        )


def _shown(log: Path) -> list[int]:
    """The rows done each progress line showed."""
    return [int(m.group(1)) for m in _PROGRESS.finditer(log.read_text())]


def _journal_rows(out: Path) -> int:
    """Rows the open window's journal holds (read as a resumed run reads it)."""
    (path,) = (out / JOURNAL_DIR).glob("*.log")
    return journal_rows(path)


class Job:
    """2,000 rows, and what an uninterrupted run writes for them with each window size."""

    def __init__(self, encoder: Path, root: Path) -> None:
        self.root = root
        src = write_jsonl(root / "in.jsonl", [{"text": t} for t in mixed_texts(ROWS, seed=46)])
        self.args = [str(encoder), str(src)]
        self._whole: dict[int, dict[str, bytes]] = {}

    def whole(self, window: int) -> dict[str, bytes]:
        if window not in self._whole:
            out, log = self.root / f"whole-{window}", self.root / f"whole-{window}.log"
            proc = _run([*self.args, "--window", str(window)], out, log)
            assert proc.wait(timeout=300) == 0, log.read_text()
            self._whole[window] = output_bytes(out)
        return self._whole[window]


@pytest.fixture(scope="module")
def job(encoder: Path, tmp_path_factory: pytest.TempPathFactory) -> Job:
    return Job(encoder, tmp_path_factory.mktemp("checkpoint"))


@pytest.mark.parametrize("window", [4096, 700])
def test_two_sigkills_mid_window_lose_no_row_shown_done_and_the_output_is_unchanged(
    job: Job, tmp_path: Path, window: int
) -> None:
    want = job.whole(window)
    args = [*job.args, "--window", str(window)]
    out = tmp_path / "out"
    # 1: the process SIGKILLs itself once the window's journal holds 300 rows or more
    first_shard = 0 if window > ROWS else 1
    killed = _run(args, out, tmp_path / "1.log", kill_at=f"{first_shard}:rows:300")
    assert killed.wait(timeout=300) == -signal.SIGKILL, (tmp_path / "1.log").read_text()
    held = _journal_rows(out)
    shown = _shown(tmp_path / "1.log")
    committed = first_shard * window
    assert held >= 300 and shown and max(shown) <= committed + held  # every row shown done is durable

    # 2: stopped once the next window's journal holds 200 rows more; SIGKILLed from here
    second_shard = 0 if window > ROWS else 2
    target = held + 200 if second_shard == first_shard else 200
    stopped = _run(args, out, tmp_path / "2.log", kill_at=f"{second_shard}:rows:{target}:STOP")
    _, status = os.waitpid(stopped.pid, os.WUNTRACED)  # the event: it stopped there
    assert os.WIFSTOPPED(status), (tmp_path / "2.log").read_text()
    stopped.kill()
    assert stopped.wait(timeout=60) == -signal.SIGKILL
    shown2 = _shown(tmp_path / "2.log")
    if second_shard == first_shard:  # it restored what the first run left, not computed it again
        assert shown2[0] >= committed + held
    held2 = _journal_rows(out)
    committed2 = second_shard * window
    assert held2 >= target and max(shown2) <= committed2 + held2

    # 3: resumed to the end
    done = _run(args, out, tmp_path / "3.log")
    assert done.wait(timeout=300) == 0, (tmp_path / "3.log").read_text()
    log = (tmp_path / "3.log").read_text()
    assert f"resumed after {committed2} rows; {held2} more restored from a checkpoint" in log, log
    # the rows this run computed: those after what the killed run had finished, no more
    assert f"{ROWS}/{ROWS} rows" in log
    assert _shown(tmp_path / "3.log")[0] >= committed2 + held2
    assert output_bytes(out) == want
    assert not list((out / JOURNAL_DIR).iterdir())  # removed once their shards are committed
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["summary"]["restored_rows"] == held2 and manifest["summary"]["resumed_rows"] == committed2


def test_a_journal_written_under_other_batching_is_not_restored(job: Job, tmp_path: Path) -> None:
    base, want = [*job.args, "--window", "4096"], job.whole(4096)
    out = tmp_path / "out"
    killed = _run([*base, "--max-batch-size", "2"], out, tmp_path / "1.log", kill_at="0:rows:100")
    assert killed.wait(timeout=300) == -signal.SIGKILL, (tmp_path / "1.log").read_text()
    assert _journal_rows(out) >= 100
    # the same job (the batch size is not part of it), batched as the reference run was: the
    # journal's batches were cut otherwise, so the window is computed again, whole
    again = _run(base, out, tmp_path / "2.log")
    assert again.wait(timeout=300) == 0, (tmp_path / "2.log").read_text()
    assert "restored" not in (tmp_path / "2.log").read_text()
    assert output_bytes(out) == want


# -- the journal itself ------------------------------------------------------------------------
def test_outcomes_round_trip_with_their_types_and_bytes() -> None:
    vec = np.array([0.1, -3.4e38, np.nan, 1e-45], dtype=np.float32)
    outcome = {
        "embedding": vec,
        "score": np.float32(0.3),
        "label": "POS",
        "scores": {"$weird": 1.0, "plain": 2},
        "entities": [{"label": "PER", "score": 0.9, "start": 0, "end": 3, "text": "Ann"}],
        "pair": (1, "a", None, True),
    }
    back = decode_outcome(json.loads(json.dumps(encode_outcome(outcome))))
    assert back["embedding"].dtype == np.float32 and back["embedding"].tobytes() == vec.tobytes()
    assert type(back["score"]) is np.float32 and back["score"] == np.float32(0.3)
    assert back["scores"] == {"$weird": 1.0, "plain": 2} and back["pair"] == (1, "a", None, True)
    assert back["entities"] == outcome["entities"]
    failure = RowFailure("too_long", "it is long", 400, "input")
    assert decode_outcome(json.loads(json.dumps(encode_outcome(failure)))) == failure
    with pytest.raises(TypeError, match="set"):
        encode_outcome({"x": {1, 2}})


def _journal(path: Path, digest: str = "d") -> WindowJournal:
    return WindowJournal(path, {"shard": 0, "start": 0, "rows": 4, "digest": digest, "batching": {}}, 0.0)


def test_a_torn_tail_is_dropped_and_appending_goes_on_after_the_last_whole_record(tmp_path: Path) -> None:
    path = tmp_path / "_journal" / "000000.log"
    j = _journal(path)
    assert j.open() == {}
    j.append([0, 1], [{"v": np.arange(3, dtype=np.float32)}, RowFailure("rejected", "no")])
    j.append([2], [{"v": np.ones(3, dtype=np.float32)}])
    j.close()
    whole = path.read_bytes()
    path.write_bytes(whole[:-5])  # the last record cut short, as a kill mid-write leaves it
    j = _journal(path)
    restored = j.open()
    assert sorted(restored) == [0, 1] and restored[1] == RowFailure("rejected", "no")
    assert restored[0]["v"].tolist() == [0.0, 1.0, 2.0]
    j.append([3], [{"v": np.zeros(3, dtype=np.float32)}])
    j.close()
    assert sorted(_journal(path).open()) == [0, 1, 3]

    flipped = bytearray(path.read_bytes())
    flipped[-3] ^= 0xFF  # a corrupt last record fails its CRC
    path.write_bytes(bytes(flipped))
    assert sorted(_journal(path).open()) == [0, 1]


def test_a_journal_for_other_rows_is_started_over(tmp_path: Path) -> None:
    path = tmp_path / "000000.log"
    j = _journal(path)
    j.open()
    j.append([0], [{"v": 1}])
    j.close()
    assert _journal(path, digest="other").open() == {}
    assert _journal(path, digest="other").open() == {}  # and it now names the other rows
    assert _journal(path).open() == {}


def test_the_rows_digest_sees_every_field() -> None:
    from ortbatch.bulk.checkpoint import rows_digest

    a = [Row(0, text="a"), Row(1, text="b", pair="c")]
    assert rows_digest(a) == rows_digest([Row(0, text="a"), Row(1, text="b", pair="c")])
    assert rows_digest(a) != rows_digest([Row(0, text="a"), Row(1, text="b", pair="d")])
    assert rows_digest(a) != rows_digest([Row(0, text="a"), Row(1, text="b", pair="c", id=7)])


def test_a_resumed_window_runs_exactly_the_batches_not_restored(encoder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny model's vectors do not change with their batch, so the bytes alone would not see a
    resumed window cut into other batches: the batches are compared here."""
    from ortbatch.bulk.dispatch import task_for
    from ortbatch.bulk.tasks import Encoder, TaskOptions

    submitted: list[list[int]] = []
    real = Encoder._submit

    def spy(self: Encoder, chunk: list[int], prepared: dict[int, object], names: list[str]) -> object:
        submitted.append(list(chunk))
        return real(self, chunk, prepared, names)

    monkeypatch.setattr(Encoder, "_submit", spy)
    rows = [Row(i, text=t) for i, t in enumerate(mixed_texts(90, seed=3))]
    rows[7] = Row(7, error=("invalid_utf8", "not UTF-8"))  # a row no batch holds
    task = task_for(encoder, TaskOptions(max_batch_size=4))
    try:
        finished: list[tuple[list[int], list[object]]] = []
        task.on_outcomes = lambda pos, outs: finished.append((list(pos), list(outs)))
        whole = task.run(rows)
        batches = list(submitted)
        assert [p for p, _ in finished] == batches and len(batches) > 10
        # a kill after 5 batches: those are restored, the rest run as they ran
        restored = {i: o for pos, outs in finished[:5] for i, o in zip(pos, outs, strict=True)}
        submitted.clear()
        task.on_outcomes = None
        task.restored = restored
        again = task.run(rows)
        assert submitted == batches[5:]
        for a, b in zip(whole, again, strict=True):
            assert a == b if isinstance(a, RowFailure) else a["embedding"].tobytes() == b["embedding"].tobytes()
    finally:
        task.close()
