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


def test_a_csv_field_past_the_csv_modules_default_limit_is_a_row(tmp_path: Path) -> None:
    # the csv module refuses fields over 128 KiB by default: a long document in one cell
    # must be a row (cut by --truncate or failed as too long), not a crash of the whole job
    long = "word " * 60_000  # 300,000 characters
    path = tmp_path / "long.csv"
    with open(path, "w", newline="", encoding="utf-8") as f:
        csv.writer(f).writerows([["text"], ["short"], [long], ["after"]])
    rows = list(Source(path, SourceOptions()).rows())
    assert [r.text for r in rows] == ["short", long, "after"] and all(r.error is None for r in rows)


def test_a_file_that_is_not_parquet_is_an_input_error_naming_it(tmp_path: Path) -> None:
    from ortbatch.bulk.sources import InputError

    good = tmp_path / "good.parquet"
    pq.write_table(pa.table({"text": ["a", "b"]}), good)
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(good.read_bytes()[:-20])  # the footer is gone
    with pytest.raises(InputError, match=r"cut\.parquet is not a readable Parquet file \(.*magic"):
        Source(cut, SourceOptions())


def test_a_damaged_parquet_page_is_an_input_error_naming_the_file(tmp_path: Path) -> None:
    from ortbatch.bulk.sources import InputError

    path = tmp_path / "damaged.parquet"
    pq.write_table(pa.table({"text": [f"row {i} " + "w " * 40 for i in range(300)]}), path, row_group_size=100)
    column = pq.ParquetFile(path).metadata.row_group(1).column(0)
    start = column.dictionary_page_offset or column.data_page_offset
    data = bytearray(path.read_bytes())
    end = start + column.total_compressed_size
    data[start + 8 : end - 8] = b"\xab" * (end - start - 16)  # the second row group's pages, not the footer
    path.write_bytes(bytes(data))
    source = Source(path, SourceOptions(), batch_rows=100)  # the footer is intact: opening works
    rows = source.rows()
    assert [next(rows).text for _ in range(100)][-1].startswith("row 99 ")
    with pytest.raises(InputError, match=r"damaged\.parquet: a Parquet record batch cannot be read"):
        next(rows)


def test_what_the_csv_module_cannot_parse_is_an_input_error_with_its_line(tmp_path: Path, monkeypatch) -> None:
    from ortbatch.bulk import sources

    path = tmp_path / "wide.csv"
    path.write_text("text\nshort\n" + "x" * 50 + "\n", encoding="utf-8")
    before = csv.field_size_limit()
    monkeypatch.setattr(sources, "_CSV_FIELD_LIMIT", 20)  # a limit this file's third line is over
    try:
        csv.field_size_limit(20)
        rows = Source(path, SourceOptions()).rows()
        assert next(rows).text == "short"
        with pytest.raises(sources.InputError, match=r"wide\.csv: after line 2: not readable as CSV \(field larger"):
            next(rows)
    finally:
        csv.field_size_limit(before)
