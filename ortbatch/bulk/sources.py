"""Input files, read as a stream of :class:`Row` in a fixed order.

A source is one file (JSONL, CSV, Parquet, or an OpenAI Batch API JSONL file) or a folder
of them (files taken in name order). Rows are numbered from 0 across the whole source;
that number is what the shard manifest records, so a resumed run skips exactly the rows
already committed (:meth:`Source.rows` ``start``). Nothing holds more than one row (JSONL,
CSV) or one Parquet record batch of at most ``window`` rows at a time.

A row that cannot be read as text (bytes that are not UTF-8, a missing or non-string text
column) is still a row: it carries the reason in :attr:`Row.error` and ends in the errors
file, so row numbers never shift.
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._extras import require
from ..errors import InvalidInputError

__all__ = ["FILE_SUFFIXES", "INPUT_FORMATS", "InputError", "Position", "Row", "Source", "SourceOptions", "open_source"]

#: ``--input-format`` values; ``auto`` goes by the file suffix (and a first JSONL line that
#: holds ``custom_id``, ``url`` and ``body`` is an OpenAI Batch API file)
INPUT_FORMATS = ("auto", "jsonl", "csv", "parquet", "openai-batch")
#: the input files a folder is read for, by suffix -> their format (image folders tell them apart)
FILE_SUFFIXES = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "jsonl",
    ".csv": "csv",
    ".parquet": "parquet",
    ".pq": "parquet",
}


class InputError(InvalidInputError):
    """The input path cannot be read as asked (missing, no input files, an unknown format):
    a bad argument (exit 2). A bad *row* is never raised: it fails into the errors file."""

    exit_code = 2


@dataclass(frozen=True)
class Row:
    """One input row: its number in the source, its id, its text (and pair text), or the
    reason it cannot be run. ``body`` is the request of an OpenAI Batch API line."""

    index: int
    id: Any = None
    text: str | None = None
    pair: str | None = None
    body: dict[str, Any] | None = None
    error: tuple[str, str] | None = None  # (kind, message)


@dataclass(frozen=True)
class Position:
    """Where row number ``row`` of a source starts: in its file number ``file``, at
    ``offset`` (a byte offset into a JSONL or CSV file, a row number in a Parquet file).
    :meth:`Source.positions` finds them in one pass; :meth:`Source.rows_at` reads from one
    without reading what comes before it (how ``--ray`` reads windows on other processes)."""

    row: int
    file: int
    offset: int


@dataclass(frozen=True)
class SourceOptions:
    """Which columns hold what (``pair_column``: the second text of a cross-encoder pair)."""

    text_column: str = "text"
    pair_column: str | None = None
    id_column: str | None = None
    input_format: str = "auto"


def _utf8_problem(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


_Record = tuple[dict[str, Any] | None, tuple[str, str] | None]


class _Reader:
    """One file's rows as ``(record or None, error or None)``, from its start or from an
    offset that :meth:`marks` returned."""

    def __init__(self, path: Path, options: SourceOptions) -> None:
        self.path = path
        self.options = options

    def records(self, skip: int, offset: int = 0) -> Iterator[_Record]:
        """The records from ``offset`` on, the first ``skip`` of them left out."""
        raise NotImplementedError

    def marks(self, first: int, every: int) -> tuple[int, list[int]]:
        """One pass over the file: its number of rows, and the offsets of its rows number
        ``first``, ``first + every``, ... (offsets :meth:`records` starts from)."""
        raise NotImplementedError

    def count(self) -> int | None:
        """The number of rows, when it is cheap to know (for the progress bar's ETA)."""
        return None


class _JsonlReader(_Reader):
    def records(self, skip: int, offset: int = 0) -> Iterator[_Record]:
        with open(self.path, "rb") as f:
            f.seek(offset)
            for line in f:
                if not line.strip():
                    continue  # blank lines are not rows (the count below skips them too)
                if skip:
                    skip -= 1  # skipped rows are not even parsed: a resume costs a read, not a parse
                    continue
                yield _json_record(line)

    def marks(self, first: int, every: int) -> tuple[int, list[int]]:
        n, offsets, at = 0, list[int](), 0
        with open(self.path, "rb") as f:
            for line in f:
                if line.strip():
                    if n >= first and (n - first) % every == 0:
                        offsets.append(at)
                    n += 1
                at += len(line)
        return n, offsets

    def count(self) -> int | None:
        n = 0
        with open(self.path, "rb") as f:
            for line in f:
                n += bool(line.strip())
        return n


def _json_record(line: bytes) -> _Record:
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, ("invalid_utf8", f"the line is not valid UTF-8 (byte {exc.start})")
    try:
        doc = json.loads(text)
    except ValueError as exc:
        return None, ("invalid_json", f"the line is not JSON: {exc}")
    if not isinstance(doc, dict):
        return None, ("invalid_json", f"the line is a JSON {type(doc).__name__}, not an object")
    return doc, None


#: the longest CSV field read (the csv module's default is 128 KiB; a long document in one
#: cell is a row like any other, cut by --truncate or failed as too long, never a crash)
_CSV_FIELD_LIMIT = 2**31 - 1


class _CsvReader(_Reader):
    """A CSV file with a header row. Lines are read with ``readline`` (not by iterating
    the file), so the file can say where a record starts (``tell``) and a read can start
    there (``seek``): the csv module reads no further than the record it returns."""

    @contextlib.contextmanager
    def _open(self) -> Iterator[tuple[Any, csv.DictReader[str]]]:
        if csv.field_size_limit() < _CSV_FIELD_LIMIT:
            csv.field_size_limit(_CSV_FIELD_LIMIT)
        # surrogateescape keeps undecodable bytes as lone surrogates, so one bad row is a
        # row error (found by _utf8_problem) instead of failing the whole file
        with open(self.path, encoding="utf-8", errors="surrogateescape", newline="") as f:
            reader = csv.DictReader(iter(f.readline, ""))
            try:
                reader.fieldnames  # noqa: B018 - reads the header row now, before any tell/seek
                yield f, reader
            except csv.Error as exc:  # what the csv module cannot parse at all: the file, not a row
                where = f"{self.path}: after line {reader.line_num}"
                raise InputError(f"{where}: not readable as CSV ({str(exc).strip()})") from None

    def records(self, skip: int, offset: int = 0) -> Iterator[_Record]:
        with self._open() as (f, reader):
            if offset:
                f.seek(offset)
            for doc in reader:
                if skip:
                    skip -= 1
                    continue
                yield dict(doc), None

    def marks(self, first: int, every: int) -> tuple[int, list[int]]:
        n, offsets = 0, list[int]()
        with self._open() as (f, reader):
            while True:
                wanted = n >= first and (n - first) % every == 0
                at = f.tell() if wanted else 0  # the next record starts here (or blank lines before it)
                if next(reader, None) is None:
                    return n, offsets
                if wanted:
                    offsets.append(at)
                n += 1


class _ParquetReader(_Reader):
    def __init__(self, path: Path, options: SourceOptions, batch_rows: int) -> None:
        super().__init__(path, options)
        self.batch_rows = batch_rows
        pq = require("pyarrow.parquet", "bulk")
        self._errors = (require("pyarrow", "bulk").ArrowException, OSError)
        try:
            self._file = pq.ParquetFile(str(path))
        except self._errors as exc:
            raise InputError(f"{path} is not a readable Parquet file ({str(exc).strip()})") from None

    def _columns(self) -> list[str]:
        names = set(self._file.schema_arrow.names)
        o = self.options
        wanted = [c for c in (o.text_column, o.pair_column, o.id_column) if c]
        return [c for c in dict.fromkeys(wanted) if c in names]

    def records(self, skip: int, offset: int = 0) -> Iterator[_Record]:
        # a Parquet file's offsets are row numbers: the row groups before one are not read
        skip += offset
        columns = self._columns()
        meta = self._file.metadata
        first = 0
        while first < meta.num_row_groups and skip >= meta.row_group(first).num_rows:
            skip -= meta.row_group(first).num_rows  # leading row groups skipped unread
            first += 1
        groups = list(range(first, meta.num_row_groups))
        if not groups:
            return
        for batch in self._batches(groups, columns):
            if skip >= batch.num_rows:
                skip -= batch.num_rows
                continue
            if skip:
                batch = batch.slice(skip)
                skip = 0
            data = batch.to_pydict()
            for i in range(batch.num_rows):
                yield {c: data[c][i] for c in columns}, None

    def _batches(self, groups: list[int], columns: list[str]) -> Iterator[Any]:
        batches = self._file.iter_batches(batch_size=self.batch_rows, row_groups=groups, columns=columns)
        while True:
            try:
                batch = next(batches, None)
            except self._errors as exc:  # a damaged page: the file cannot be read past it
                raise InputError(f"{self.path}: a Parquet record batch cannot be read ({str(exc).strip()})") from None
            if batch is None:
                return
            yield batch

    def marks(self, first: int, every: int) -> tuple[int, list[int]]:
        n = int(self._file.metadata.num_rows)
        return n, list(range(first, n, every))

    def count(self) -> int | None:
        return int(self._file.metadata.num_rows)


class Source:
    """The rows of one input file or folder, in order, numbered from 0."""

    def __init__(self, path: str | os.PathLike[str], options: SourceOptions, batch_rows: int = 4096) -> None:
        self.path = Path(path)
        self.options = options
        if options.input_format not in INPUT_FORMATS:
            raise InputError(f"input format must be one of {list(INPUT_FORMATS)}, got {options.input_format!r}")
        if not self.path.exists():
            raise InputError(f"input {self.path} does not exist")
        if self.path.is_dir():
            files = sorted(p for p in self.path.iterdir() if p.is_file() and p.suffix.lower() in FILE_SUFFIXES)
            if not files:
                raise InputError(f"input folder {self.path} holds no {'/'.join(sorted(FILE_SUFFIXES))} files")
        else:
            files = [self.path]
        self.files: list[Path] = files
        kinds = [self._kind(p) for p in files]
        self.batch_api = any(k == "openai-batch" for k in kinds)
        if self.batch_api and not all(k == "openai-batch" for k in kinds):
            raise InputError(f"{self.path} mixes OpenAI Batch API files with other input files")
        self._readers: list[_Reader] = [self._reader(p, k, batch_rows) for p, k in zip(files, kinds, strict=True)]

    def _kind(self, path: Path) -> str:
        fmt = self.options.input_format
        if fmt == "auto":
            fmt = FILE_SUFFIXES.get(path.suffix.lower(), "")
            if not fmt:
                raise InputError(
                    f"cannot tell the format of {path} from its suffix; pass --input-format "
                    f"({', '.join(INPUT_FORMATS[1:])})"
                )
            if fmt == "jsonl" and _looks_like_batch_api(path):
                fmt = "openai-batch"
        return fmt

    def _reader(self, path: Path, kind: str, batch_rows: int) -> _Reader:
        if kind in ("jsonl", "openai-batch"):
            return _JsonlReader(path, self.options)
        if kind == "csv":
            return _CsvReader(path, self.options)
        return _ParquetReader(path, self.options, batch_rows)

    def fingerprint(self) -> dict[str, Any]:
        """What identifies this input for a resume: each file's name, size and mtime."""
        files = []
        for p in self.files:
            st = p.stat()
            files.append({"name": p.name, "bytes": st.st_size, "mtime_ns": st.st_mtime_ns})
        digest = hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()[:16]
        return {"path": str(self.path.resolve()), "files": files, "digest": digest}

    def count(self) -> int | None:
        """Total rows, when every file can say it cheaply (None otherwise)."""
        total = 0
        for r in self._readers:
            n = r.count()
            if n is None:
                return None
            total += n
        return total

    def rows(self, start: int = 0) -> Iterator[Row]:
        """Rows from number ``start`` on."""
        index = 0
        for reader in self._readers:
            skip = max(start - index, 0)
            if skip:
                n = reader.count()
                if n is None:  # a CSV: counted by parsing it (quoted fields may hold newlines)
                    n = sum(1 for _ in reader.records(0))
                if n <= skip:
                    index += n
                    continue
                index += skip
            for record, error in reader.records(skip):
                yield self._row(index, record, error)
                index += 1

    def positions(self, every: int) -> tuple[list[Position], int]:
        """Where rows number 0, ``every``, ``2 * every``, ... start, and the number of rows:
        one pass over every JSONL and CSV file (Parquet files say it in their metadata)."""
        out: list[Position] = []
        total = 0
        for k, reader in enumerate(self._readers):
            first = -total % every  # the file's first row that starts a window
            n, offsets = reader.marks(first, every)
            out += [Position(total + first + j * every, k, off) for j, off in enumerate(offsets)]
            total += n
        return out, total

    def rows_at(self, position: Position, limit: int) -> Iterator[Row]:
        """At most ``limit`` rows from ``position`` on (from :meth:`positions`), across the
        files that follow its own."""
        index = position.row
        end = index + limit
        for k in range(position.file, len(self._readers)):
            offset = position.offset if k == position.file else 0
            for record, error in self._readers[k].records(0, offset):
                if index >= end:
                    return
                yield self._row(index, record, error)
                index += 1

    def _row(self, index: int, record: dict[str, Any] | None, error: tuple[str, str] | None) -> Row:
        if error is not None or record is None:
            return Row(index, error=error or ("invalid_input", "unreadable row"))
        o = self.options
        rid = record.get(o.id_column) if o.id_column else None
        if self.batch_api:
            return _batch_row(index, record)
        text = _text(record, o.text_column)
        if isinstance(text, tuple):
            return Row(index, rid, error=text)
        pair: str | None = None
        if o.pair_column:
            second = _text(record, o.pair_column)
            if isinstance(second, tuple):
                return Row(index, rid, error=second)
            pair = second
        return Row(index, rid, text, pair)


def _text(record: dict[str, Any], column: str) -> str | tuple[str, str]:
    """The text in ``column``, or the failure (kind, reason) of a row without one."""
    text = record.get(column)
    if text is None:
        return ("invalid_input", f"the row has no {column!r} column")
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError:
            return ("invalid_utf8", f"column {column!r} is not valid UTF-8")
    if not isinstance(text, str):
        return ("invalid_input", f"column {column!r} is not a string: {text!r:.60}")
    if _utf8_problem(text):
        return ("invalid_utf8", f"column {column!r} is not valid UTF-8")
    return text


def _batch_row(index: int, doc: dict[str, Any]) -> Row:
    cid = doc.get("custom_id")
    if not isinstance(cid, str):
        return Row(index, None, error=("invalid_request", "the line has no custom_id (a string)"))
    body = doc.get("body")
    if doc.get("method", "POST") != "POST":
        return Row(index, cid, error=("invalid_request", f"method must be POST, got {doc.get('method')!r:.40}"))
    if not isinstance(body, dict):
        return Row(index, cid, error=("invalid_request", "the line's body must be a JSON object"))
    url = doc.get("url")
    if not isinstance(url, str):
        return Row(index, cid, error=("invalid_request", "the line has no url"))
    return Row(index, cid, text=url, body=body)


def _looks_like_batch_api(path: Path) -> bool:
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                try:
                    doc = json.loads(line)
                except ValueError:
                    return False
                return isinstance(doc, dict) and {"custom_id", "url", "body"} <= doc.keys()
    return False


def open_source(path: str | os.PathLike[str], options: SourceOptions, batch_rows: int = 4096) -> Source:
    """The :class:`Source` for ``path`` (a file or a folder of files)."""
    return Source(path, options, batch_rows)
