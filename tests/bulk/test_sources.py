"""Where each window starts (``Source.positions``) and reading a window from there
(``Source.rows_at``), as ``ortbatch run --ray`` reads windows in other processes: the rows
are exactly those of one pass from the start, for every kind of input and window size."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ortbatch.bulk.sources import Source, SourceOptions


def _input(tmp_path: Path, kind: str) -> Path:
    texts = [f"row {i} " + "é" * (i % 4) + " words" * (i % 3) for i in range(23)]
    csv_path, pq_path, jsonl_path = tmp_path / "a.csv", tmp_path / "b.parquet", tmp_path / "c.jsonl"
    with open(csv_path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["text", "id"])
        for i, t in enumerate(texts[:7]):
            w.writerow([t.replace(" ", "\n", 1), f"c{i}"])  # quoted newlines
            if i == 3:
                f.write("\r\n")  # a blank line is no row
    pq.write_table(pa.table({"text": texts[7:15], "id": [f"p{i}" for i in range(8)]}), pq_path, row_group_size=3)
    with open(jsonl_path, "wb") as f:
        for i, t in enumerate(texts[15:]):
            f.write(json.dumps({"text": t, "id": i}).encode() + b"\n\n")
            if i == 2:
                f.write(b'{"text": "caf\xe9"}\n')  # not UTF-8: still a row, that fails
    if kind == "folder":
        return tmp_path
    return {"csv": csv_path, "parquet": pq_path, "jsonl": jsonl_path}[kind]


@pytest.mark.parametrize("kind", ["jsonl", "csv", "parquet", "folder"])
def test_every_window_read_from_its_position_is_that_window_of_one_pass(tmp_path: Path, kind: str) -> None:
    source = Source(_input(tmp_path, kind), SourceOptions(id_column="id"))
    everything = list(source.rows())
    assert [r.index for r in everything] == list(range(len(everything)))
    assert any(r.error for r in everything) == (kind in ("jsonl", "folder"))
    for window in (1, 2, 3, 5, 8, 100):
        positions, total = source.positions(window)
        assert total == len(everything)
        assert [p.row for p in positions] == list(range(0, total, window))
        for p in positions:
            assert list(source.rows_at(p, window)) == everything[p.row : p.row + window], (window, p)
