"""The output directory of ``ortbatch run``: shards committed atomically, and what a
resumed run reads back.

Layout (files starting with ``_`` or ``.`` are skipped by pyarrow, pandas, Spark, DuckDB
and Polars when they read the folder as one dataset)::

    OUTPUT/part-000000.parquet     shard 0's results, in input order (or .jsonl)
    OUTPUT/_shards/000000.json     shard 0's manifest: the input range [start, end) it covers,
                                   its counts and its files; written last, so its presence
                                   is the shard's commit
    OUTPUT/_errors/000000.jsonl    shard 0's failed rows (only when it has some)
    OUTPUT/_journal/000001.log     the checkpoint of shard 1 while it is computed: its finished
                                   batches, restored by a resumed run; deleted once the shard
                                   is committed (:mod:`ortbatch.bulk.checkpoint`)
    OUTPUT/_job.json               what the job is (export, input, settings): a resume must match
    OUTPUT/_errors.jsonl           every failed row, in input order (written when the job ends)
    OUTPUT/_manifest.json          every shard's range and counts, and the summary (at the end)

Every file is written to a temporary name in the same folder, flushed and fsynced, then
renamed over its final name, and the folder is fsynced: after a crash a file is either
complete or absent. Shard ``k`` covers input rows ``[k * window, (k + 1) * window)`` (the
last one fewer). It counts when its ``_shards`` file exists and its files are all there;
the files of a shard that does not count are leftovers of an interrupted run and are
deleted before the run goes on. A local run commits shards in order; a ``--ray`` run
commits them as they finish, so a resume may find gaps, and computes just those.

A shard is made in two steps, which may happen in different processes:
:func:`encode_shard` turns a window's results into the bytes of its files
(:class:`ShardFiles`, pure), and :meth:`OutputDir.write_shard` writes and commits them.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from .._extras import require
from ..errors import OrtBatchError
from .tasks import Field

__all__ = [
    "OUTPUT_FORMATS",
    "OutputDir",
    "OutputError",
    "ShardFiles",
    "ShardInfo",
    "encode_shard",
    "fsync_dir",
    "write_atomic",
]

OUTPUT_FORMATS = ("parquet", "jsonl")
_PART = re.compile(r"^part-(\d{6})\.(parquet|jsonl)$")
_SHARD = re.compile(r"^(\d{6})\.json$")
_OURS = ("_job.json", "_manifest.json", "_errors.jsonl", "_shards", "_errors", "_journal", "_lock")
_JOURNAL = re.compile(r"^(\d{6})\.log$")
#: the file a running job holds locked (flock): a second run on the same output is refused
_LOCK = "_lock"


class OutputError(OrtBatchError):
    """The output folder cannot be used as asked (another job's output, not ours, or a
    resume with different settings): a bad argument (exit 2)."""

    exit_code = 2


ShardInfo = dict[str, Any]


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in ``path`` durable (where directories can be fsynced)."""
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
    rename it into place (and fsync the folder). The temporary name is unique, so two
    processes writing the same file (a retried ``--ray`` task) never share one."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    if before_rename is not None:
        before_rename()
    os.replace(tmp, path)
    fsync_dir(path.parent)


def _dumps(doc: Any) -> bytes:
    return json.dumps(doc, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode("utf-8")


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value


@dataclass(frozen=True)
class ShardFiles:
    """One shard, encoded: its manifest (``info``) and the bytes of its part file and of
    its errors file (``None`` when it has no results, no failures)."""

    info: ShardInfo
    part: bytes | None
    errors: bytes | None


def encode_shard(
    index: int,
    start: int,
    end: int,
    records: Sequence[dict[str, Any]],
    fields: Sequence[Field],
    errors: Sequence[dict[str, Any]],
    extra: dict[str, Any],
    fmt: str,
) -> ShardFiles:
    """Shard ``index`` (input rows ``[start, end)``) as bytes: its results (``records``, in
    ``fmt``), its failures (JSONL) and its manifest."""
    info: ShardInfo = {"shard": index, "start": start, "end": end, "rows": len(records), "errors": len(errors)}
    info.update(extra)
    info["file"] = f"part-{index:06d}.{fmt}" if records else None
    info["errors_file"] = f"_errors/{index:06d}.jsonl" if errors else None
    part = None
    if records:
        buf = io.BytesIO()
        (_parquet if fmt == "parquet" else _jsonl)(buf, records, fields)
        part = buf.getvalue()
    errs = b"".join(_dumps(e) + b"\n" for e in errors) if errors else None
    return ShardFiles(info, part, errs)


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

    def _lock(self) -> None:
        """Hold the folder's lock until :meth:`release` (or this process ends): two runs on one
        output would compute the same shards twice, and one could clear what the other wrote."""
        if getattr(self, "_lock_file", None) is not None:
            return
        try:
            import fcntl
        except ImportError:  # no flock here (Windows): unlocked, as before
            return
        self.path.mkdir(parents=True, exist_ok=True)
        f = open(self.path / _LOCK, "a+")  # noqa: SIM115 - held open until release()
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip()
            f.close()
            raise OutputError(
                f"output {self.path} is in use by another `ortbatch run`{f' ({holder})' if holder else ''}; "
                "wait for it to finish, or choose another folder"
            ) from None
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()}\n")
        f.flush()
        self._lock_file: IO[str] | None = f

    def release(self) -> None:
        """Let go of the folder's lock (calling it again is harmless)."""
        f, self._lock_file = getattr(self, "_lock_file", None), None
        if f is not None:
            f.close()

    def _strays(self) -> list[str]:
        """What this folder holds that a run of ours writes only after ``_job.json``: without
        that file, such files are someone else's (or a job's whose record was removed)."""
        names = []
        for p in self.path.iterdir():
            if p.name == _LOCK or (p.name.startswith(".") and p.name.endswith(".tmp")):
                continue
            if p.name in ("_shards", "_errors", "_journal") and p.is_dir() and not any(p.iterdir()):
                continue  # made before _job.json: a run killed in between left them empty
            names.append(p.name)
        return sorted(names)

    def open(self, job: dict[str, Any], restart: bool) -> list[ShardInfo]:
        """Make the folder ready for ``job`` and lock it for this run (see :meth:`release`);
        returns the shards already committed (none after ``restart`` or for a new folder).
        Refuses a folder another run holds, a folder holding other files (shard-named files
        without the ``_job.json`` a run writes before them included: never deleted), or
        another job's output unless ``restart``."""
        if self.path.exists():
            foreign = self._foreign()
            if foreign:
                raise OutputError(
                    f"output {self.path} holds files `ortbatch run` did not write ({', '.join(foreign[:3])}"
                    f"{', ...' if len(foreign) > 3 else ''}); choose an empty or new folder"
                )
        self._lock()
        old = self._read_json(self.path / "_job.json")
        if old is None and (strays := self._strays()):
            self.release()
            raise OutputError(
                f"output {self.path} holds {', '.join(strays[:3])}{', ...' if len(strays) > 3 else ''} but no "
                "_job.json, which `ortbatch run` writes before any of them: they are not this job's, and it "
                "deletes nothing it did not write; move them away or choose an empty or new folder"
            )
        if restart:
            self.clear()
        elif old is not None and old != job:
            self.release()
            diff = sorted(k for k in set(old) | set(job) if old.get(k) != job.get(k))
            raise OutputError(
                f"output {self.path} holds a run with different {', '.join(diff)}; rerun the same command "
                "to resume it, or pass --restart to start over"
            )
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / "_shards").mkdir(exist_ok=True)
        (self.path / "_errors").mkdir(exist_ok=True)
        if self._read_json(self.path / "_job.json") != job:
            write_atomic(self.path / "_job.json", lambda f: f.write(_dumps(job) + b"\n"))
        return self.committed(int(job["window"]))

    def clear(self) -> None:
        """Delete what ``ortbatch run`` wrote here (and nothing else)."""
        for p in list(self.path.iterdir()):
            if p.name == _LOCK:
                continue  # held by this run
            if p.name in ("_shards", "_errors", "_journal"):
                shutil.rmtree(p)
            elif p.name in _OURS or _PART.match(p.name) or (p.name.startswith(".") and p.name.endswith(".tmp")):
                p.unlink()

    @staticmethod
    def _read_json(path: Path) -> Any:
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None

    def committed(self, window: int) -> list[ShardInfo]:
        """The shards that count, in order (gaps allowed), after deleting the files of those
        that do not: shard ``k`` covers rows from ``k * window``, at most ``window`` of
        them, and has all its files."""
        shards: list[ShardInfo] = []
        for p in sorted((self.path / "_shards").iterdir()):
            m = _SHARD.match(p.name)
            info = self._read_json(p) if m else None
            if not (m and isinstance(info, dict) and _covers(info, int(m.group(1)), window)):
                continue
            files = [info.get("file"), info.get("errors_file")]
            if any(f and not (self.path / f).is_file() for f in files):
                continue
            shards.append(info)
        self._drop_except({int(s["shard"]) for s in shards})
        return shards

    def _drop_except(self, keep: set[int]) -> None:
        """Delete the shard files not numbered in ``keep``, and temporary files."""
        for folder, pattern in ((self.path, _PART), (self.path / "_shards", _SHARD)):
            for p in folder.iterdir():
                m = pattern.match(p.name)
                if (m and int(m.group(1)) not in keep) or (p.name.startswith(".") and p.name.endswith(".tmp")):
                    p.unlink()
        for p in (self.path / "_errors").iterdir():
            if p.name.startswith(".") or (p.stem.isdigit() and int(p.stem) not in keep):
                p.unlink()
        journals = self.path / "_journal"
        if journals.is_dir():  # a committed shard's checkpoint (killed before its removal)
            for p in journals.iterdir():
                m = _JOURNAL.match(p.name)
                if m and int(m.group(1)) in keep:
                    p.unlink()
        for name in ("_manifest.json", "_errors.jsonl"):
            (self.path / name).unlink(missing_ok=True)  # the job is no longer complete

    # -- writing a shard ----------------------------------------------------------------------
    def write_shard(self, files: ShardFiles, hook: Callable[[str], None] | None = None) -> ShardInfo:
        """Write a shard's part file (when it has results), its errors file (when it has
        failures), then its manifest, which commits it. ``hook(point)`` is called at
        ``written`` (the part file written, not yet renamed), ``renamed`` and ``committed``."""
        step = hook or (lambda point: None)
        info, part, errors = files.info, files.part, files.errors
        if part is not None:
            write_atomic(self.path / info["file"], lambda f: f.write(part), lambda: step("written"))
            step("renamed")
        if errors is not None:
            write_atomic(self.path / info["errors_file"], lambda f: f.write(errors))
        name = f"{int(info['shard']):06d}.json"
        write_atomic(self.path / "_shards" / name, lambda f: f.write(_dumps(info) + b"\n"))
        step("committed")
        return info

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
        journals = self.path / "_journal"
        if journals.is_dir():  # every shard is committed: a checkpoint left (by a --ray resume) is stale
            for p in journals.iterdir():
                p.unlink()
        doc = {"format": 1, "job": job, "shards": shards, "summary": summary}
        write_atomic(self.path / "_manifest.json", lambda f: f.write(_dumps(doc) + b"\n"))
        return errors_path


def _jsonl(f: IO[bytes], records: Sequence[dict[str, Any]], fields: Sequence[Field]) -> None:
    f.write(b"".join(_dumps({k: _jsonable(v) for k, v in r.items()}) + b"\n" for r in records))


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
            columns[key] = pa.array(values, {"int64": pa.int64(), "float64": pa.float64()}.get(fl.kind, pa.string()))
    pq.write_table(pa.table(columns), f)


def _covers(info: dict[str, Any], k: int, window: int) -> bool:
    """Whether a shard manifest is shard ``k``'s: rows from ``k * window``, at most ``window``."""
    start, end = info.get("start"), info.get("end")
    return info.get("shard") == k and start == k * window and isinstance(end, int) and 0 < end - start <= window


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
