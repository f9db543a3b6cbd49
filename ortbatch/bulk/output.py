"""The output directory of ``ortbatch run``: shards committed atomically, and what a
resumed run reads back.

Layout (files starting with ``_`` or ``.`` are skipped by pyarrow, pandas, Spark, DuckDB
and Polars when they read the folder as one dataset)::

    OUTPUT/part-000000.parquet     shard 0's results, in input order (or .jsonl)
    OUTPUT/_shards/000000.json     shard 0's manifest: the input range [start, end) it covers,
                                   its counts and its files; written last, so its presence
                                   is the shard's commit
    OUTPUT/_errors/000000.jsonl    shard 0's failed rows (only when it has some)
    OUTPUT/_job.json               what the job is (export, input, settings): a resume must match
    OUTPUT/_errors.jsonl           every failed row, in input order (written when the job ends)
    OUTPUT/_manifest.json          every shard's range and counts, and the summary (at the end)

Every file is written to a temporary name in the same folder, flushed and fsynced, then
renamed over its final name, and the folder is fsynced: after a crash a file is either
complete or absent. A shard counts only when its ``_shards`` file exists, with every shard
before it; files of shards after that point are leftovers of an interrupted run and are
deleted before the run goes on.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import IO, Any

import numpy as np

from .._extras import require
from ..errors import OrtBatchError
from .tasks import Field

__all__ = ["OUTPUT_FORMATS", "OutputDir", "OutputError", "ShardInfo", "write_atomic"]

OUTPUT_FORMATS = ("parquet", "jsonl")
_PART = re.compile(r"^part-(\d{6})\.(parquet|jsonl)$")
_SHARD = re.compile(r"^(\d{6})\.json$")
_OURS = ("_job.json", "_manifest.json", "_errors.jsonl", "_shards", "_errors")


class OutputError(OrtBatchError):
    """The output folder cannot be used as asked (another job's output, not ours, or a
    resume with different settings): a bad argument (exit 2)."""

    exit_code = 2


ShardInfo = dict[str, Any]


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def write_atomic(
    path: Path, write: Callable[[IO[bytes]], object], before_rename: Callable[[], None] | None = None
) -> None:
    """Write ``path`` through ``write(file)`` to a temporary file beside it, fsync, then
    rename it into place (and fsync the folder)."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    if before_rename is not None:
        before_rename()
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _dumps(doc: Any) -> bytes:
    return json.dumps(doc, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode("utf-8")


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value


class OutputDir:
    """One job's output folder: its identity, its committed shards, and their writing."""

    def __init__(self, path: str | os.PathLike[str], fmt: str) -> None:
        if fmt not in OUTPUT_FORMATS:
            raise OutputError(f"output format must be one of {list(OUTPUT_FORMATS)}, got {fmt!r}")
        self.path = Path(path)
        self.format = fmt
        if self.path.exists() and not self.path.is_dir():
            raise OutputError(f"output {self.path} is a file; `ortbatch run` writes a folder of shards")

    # -- identity and resume ----------------------------------------------------------------
    def _foreign(self) -> list[str]:
        names = []
        for p in self.path.iterdir():
            if p.name in _OURS or _PART.match(p.name) or (p.name.startswith(".") and p.name.endswith(".tmp")):
                continue
            names.append(p.name)
        return sorted(names)

    def open(self, job: dict[str, Any], restart: bool) -> list[ShardInfo]:
        """Make the folder ready for ``job``; returns the shards already committed (none
        after ``restart`` or for a new folder). Refuses a folder holding other files, or
        another job's output unless ``restart``."""
        if self.path.exists():
            foreign = self._foreign()
            if foreign:
                raise OutputError(
                    f"output {self.path} holds files `ortbatch run` did not write ({', '.join(foreign[:3])}"
                    f"{', ...' if len(foreign) > 3 else ''}); choose an empty or new folder"
                )
            old = self._read_json(self.path / "_job.json")
            if restart:
                self.clear()
            elif old is not None and old != job:
                diff = sorted(k for k in set(old) | set(job) if old.get(k) != job.get(k))
                raise OutputError(
                    f"output {self.path} holds a run with different {', '.join(diff)}; rerun the same command "
                    "to resume it, or pass --restart to start over"
                )
            elif old is None and any(self.path.iterdir()):
                self.clear()  # only our leftovers, from a run killed before it wrote _job.json
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / "_shards").mkdir(exist_ok=True)
        (self.path / "_errors").mkdir(exist_ok=True)
        if self._read_json(self.path / "_job.json") != job:
            write_atomic(self.path / "_job.json", lambda f: f.write(_dumps(job) + b"\n"))
        return self._committed()

    def clear(self) -> None:
        """Delete what ``ortbatch run`` wrote here (and nothing else)."""
        for p in list(self.path.iterdir()):
            if p.name in ("_shards", "_errors"):
                shutil.rmtree(p)
            elif p.name in _OURS or _PART.match(p.name) or (p.name.startswith(".") and p.name.endswith(".tmp")):
                p.unlink()

    @staticmethod
    def _read_json(path: Path) -> Any:
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None

    def _committed(self) -> list[ShardInfo]:
        shards: list[ShardInfo] = []
        by_index = {}
        for p in (self.path / "_shards").iterdir():
            m = _SHARD.match(p.name)
            if m:
                by_index[int(m.group(1))] = p
        expected_start = 0
        k = 0
        while k in by_index:
            info = self._read_json(by_index[k])
            # a shard counts when its range continues the last and its files are all there
            if not isinstance(info, dict) or info.get("start") != expected_start:
                break
            files = [info.get("file"), info.get("errors_file")]
            if any(f and not (self.path / f).is_file() for f in files):
                break
            shards.append(info)
            expected_start = int(info["end"])
            k += 1
        self._drop_from(len(shards))
        return shards

    def _drop_from(self, first: int) -> None:
        """Delete shard files numbered ``first`` and on, and temporary files."""
        for folder, pattern in ((self.path, _PART), (self.path / "_shards", _SHARD)):
            for p in folder.iterdir():
                m = pattern.match(p.name)
                if (m and int(m.group(1)) >= first) or (p.name.startswith(".") and p.name.endswith(".tmp")):
                    p.unlink()
        for p in (self.path / "_errors").iterdir():
            if p.name.startswith(".") or (p.stem.isdigit() and int(p.stem) >= first):
                p.unlink()
        for name in ("_manifest.json", "_errors.jsonl"):
            (self.path / name).unlink(missing_ok=True)  # the job is no longer complete

    # -- writing a shard ----------------------------------------------------------------------
    def commit(
        self,
        index: int,
        start: int,
        end: int,
        records: Sequence[dict[str, Any]],
        fields: Sequence[Field],
        errors: Sequence[dict[str, Any]],
        extra: dict[str, Any],
        hook: Callable[[str], None] | None = None,
    ) -> ShardInfo:
        """Write shard ``index`` (input rows ``[start, end)``): its part file (when it has
        results), its errors file (when it has failures), then its manifest, which commits it."""
        step = hook or (lambda point: None)
        info: ShardInfo = {"shard": index, "start": start, "end": end, "rows": len(records), "errors": len(errors)}
        info.update(extra)
        info["file"] = None
        info["errors_file"] = None
        if records:
            name = f"part-{index:06d}.{self.format}"
            writer = self._parquet if self.format == "parquet" else self._jsonl
            write_atomic(self.path / name, lambda f: writer(f, records, fields), lambda: step("written"))
            info["file"] = name
            step("renamed")
        if errors:
            rel = f"_errors/{index:06d}.jsonl"
            write_atomic(self.path / rel, lambda f: f.write(b"".join(_dumps(e) + b"\n" for e in errors)))
            info["errors_file"] = rel
        write_atomic(self.path / "_shards" / f"{index:06d}.json", lambda f: f.write(_dumps(info) + b"\n"))
        step("committed")
        return info

    @staticmethod
    def _jsonl(f: IO[bytes], records: Sequence[dict[str, Any]], fields: Sequence[Field]) -> None:
        f.write(b"".join(_dumps({k: _jsonable(v) for k, v in r.items()}) + b"\n" for r in records))

    @staticmethod
    def _parquet(f: IO[bytes], records: Sequence[dict[str, Any]], fields: Sequence[Field]) -> None:
        pa = require("pyarrow", "bulk")
        pq = require("pyarrow.parquet", "bulk")
        columns: dict[str, Any] = {}
        keys = list(records[0])
        by_name = {fl.name: fl for fl in fields}
        for key in keys:
            values = [r.get(key) for r in records]
            fl = by_name.get(key)
            if key == "row":
                columns[key] = pa.array(values, pa.int64())
            elif key == "id":
                columns[key] = pa.array([None if v is None else str(v) for v in values], pa.string())
            elif fl is None:
                columns[key] = pa.array(values)
            elif fl.kind == "vector":
                columns[key] = _vectors(pa, values, fl)
            elif fl.kind == "entities":
                columns[key] = pa.array(values, _ENTITY_TYPE(pa))
            else:
                columns[key] = pa.array(
                    values, {"int64": pa.int64(), "float64": pa.float64()}.get(fl.kind, pa.string())
                )
        pq.write_table(pa.table(columns), f)

    # -- the end ----------------------------------------------------------------------------
    def finish(self, job: dict[str, Any], shards: Iterable[ShardInfo], summary: dict[str, Any]) -> Path:
        """Write ``_errors.jsonl`` (every shard's failures, in order) and ``_manifest.json``."""
        shards = list(shards)

        def errors(f: IO[bytes]) -> None:
            for s in shards:
                if s.get("errors_file"):
                    with open(self.path / s["errors_file"], "rb") as src:
                        shutil.copyfileobj(src, f)

        errors_path = self.path / "_errors.jsonl"
        write_atomic(errors_path, errors)
        doc = {"format": 1, "job": job, "shards": shards, "summary": summary}
        write_atomic(self.path / "_manifest.json", lambda f: f.write(_dumps(doc) + b"\n"))
        return errors_path


def _ENTITY_TYPE(pa: Any) -> Any:
    return pa.list_(
        pa.struct(
            [
                ("label", pa.string()),
                ("score", pa.float64()),
                ("start", pa.int64()),
                ("end", pa.int64()),
                ("text", pa.string()),
            ]
        )
    )


def _vectors(pa: Any, values: list[Any], fl: Field) -> Any:
    dtype = np.dtype(fl.dtype)
    size = fl.size if fl.size is not None else len(values[0])
    flat = np.concatenate([np.asarray(v, dtype=dtype).reshape(-1) for v in values])
    if flat.size != size * len(values):
        raise OrtBatchError(f"the rows of {fl.name!r} do not all have {size} values")
    return pa.FixedSizeListArray.from_arrays(pa.array(flat), size)
