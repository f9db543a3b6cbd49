"""Issue 46: ``ortbatch run`` shows progress from the first batch computed, not from the first
window committed (4,096 rows by default: 21 s of silence on 2,000 rows), and the counts it
shows end equal to the rows and tokens committed."""

from __future__ import annotations

import io
import re
from pathlib import Path

import ortbatch
from ortbatch.bulk.progress import Progress

from .conftest import mixed_texts, write_jsonl


def _counts(line: str) -> tuple[int, int]:
    m = re.match(r"ortbatch run: (\d+)/(\d+) rows", line)
    assert m, line
    return int(m.group(1)), int(m.group(2))


def test_progress_lines_come_batch_by_batch_within_one_window(encoder: Path, tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in mixed_texts(20, seed=7)])
    stream = io.StringIO()
    # one window holds every row: before, nothing was shown until it was committed
    summary = ortbatch.run(encoder, src, tmp_path / "out", window=4096, progress_every_s=0.0, stream=stream)
    seen = [_counts(line) for line in stream.getvalue().splitlines()]
    assert seen[0] == (4, 20), seen  # the first batch (the export's max_batch_size is 4)
    assert [n for n, _ in seen] == sorted(n for n, _ in seen), seen  # never backwards
    assert seen[-1] == (20, 20) and len(seen) >= 5, seen
    assert summary.rows == 20


def test_committed_counts_replace_what_the_batches_counted() -> None:
    stream = io.StringIO()
    p = Progress(total=10, done=0, stream=stream, tty=False, every_s=0.0, enabled=True)
    p.advance(4, 40)
    p.advance(4, 30)
    p.update(6, 65, 2)  # the window committed: its own totals replace the batches' counts
    assert (p.rows, p.tokens, p.errors) == (6, 65, 2)
    p.advance(4, 10)
    p.update(4, 10, 0)
    before = stream.getvalue()
    p.close()
    assert stream.getvalue() == before  # the last line shown already says it: not said twice
    assert (p.rows, p.tokens) == (10, 75)
    lines = before.splitlines()
    assert lines[-1].startswith("ortbatch run: 10/10 rows") and "2 errors" in lines[-1], lines


def test_not_a_terminal_prints_the_first_batch_at_once_then_every_few_seconds() -> None:
    stream = io.StringIO()
    p = Progress(total=100, done=0, stream=stream, tty=False, every_s=3600.0, enabled=True)
    for _ in range(10):
        p.advance(1, 1)
    assert len(stream.getvalue().splitlines()) == 1  # the first at once, the next an hour later
    p.update(10, 10, 0)
    p.close()  # the last state is said once more at the end
    assert stream.getvalue().splitlines()[-1].startswith("ortbatch run: 10/100 rows")
