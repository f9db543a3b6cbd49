"""Checkpoints inside a window: a kill loses the batches in flight, not the window.

A window (thousands of rows) is one shard, committed when all its rows are computed
(:mod:`ortbatch.bulk.output`). Between commits, each finished batch's outcomes are appended
to the window's journal, ``OUTPUT/_journal/NNNNNN.log``; a resumed run restores them, the
task skips those batches, and the window's part file is written exactly as an
uninterrupted run writes it. Once the shard is committed its journal is deleted.

Why the bytes stay equal: a task's batches are a function of the window's rows and the
batching settings alone (``Task.batching()``: the encoder's rows per batch and padded
tokens per batch), never of timing, so the batches a resumed run computes are the same
batches, with the same padding, as the uninterrupted run's. The journal's first record
names the window (its rows' digest) and those settings; a journal that names anything
else is deleted and the window recomputed.

Format: records ``length (4 bytes, big-endian) · CRC-32 of the payload (4) · payload``;
the payload is JSON, numpy values tagged with their dtype and raw bytes, so a restored
outcome is the computed one bit for bit. A record cut short by a kill, or whose CRC
does not match, ends the journal: it and whatever follows are dropped (and truncated away
before new records are appended).

Durability: each record reaches the file with one ``write`` as its batch finishes, so a
killed process (SIGKILL, OOM) loses only the batches not yet finished; the file is
fsynced at most ``sync_every_s`` apart (and when the journal closes), so a machine that
loses power loses at most that many seconds of finished batches.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import struct
import threading
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .output import fsync_dir
from .sources import Row
from .tasks import Outcome, RowFailure

__all__ = ["JOURNAL_DIR", "WindowJournal", "decode_outcome", "encode_outcome", "journal_rows", "rows_digest"]

#: the folder of the output holding the open window's journal
JOURNAL_DIR = "_journal"
_HEAD = struct.Struct(">II")
_FORMAT = 1


def rows_digest(rows: Sequence[Row]) -> str:
    """A digest of a window's rows (what a task reads of them), so a journal is restored
    only into the window it was written for."""
    h = hashlib.sha256()
    for r in rows:
        doc = [r.index, r.id, r.text, r.pair, r.body, r.error]
        h.update(json.dumps(doc, ensure_ascii=False, sort_keys=True, default=repr).encode("utf-8", "surrogatepass"))
        h.update(b"\n")
    return h.hexdigest()


# -- outcomes as JSON, exactly --------------------------------------------------------------
def encode_outcome(value: Any) -> Any:
    """``value`` (an :data:`~ortbatch.bulk.tasks.Outcome` or a part of one) as JSON-able data
    that :func:`decode_outcome` turns back into an equal value of the same types: numpy
    arrays and scalars keep their dtype and bytes, tuples stay tuples."""
    if isinstance(value, RowFailure):
        return {"$f": [value.kind, value.message, value.status, value.param]}
    if isinstance(value, np.ndarray):
        data = np.ascontiguousarray(value)
        return {"$a": [data.dtype.str, list(data.shape), base64.b64encode(data.tobytes()).decode("ascii")]}
    if isinstance(value, np.generic):
        return {"$s": [value.dtype.str, base64.b64encode(value.tobytes()).decode("ascii")]}
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in value):
            return {k: encode_outcome(v) for k, v in value.items()}
        return {"$d": [[encode_outcome(k), encode_outcome(v)] for k, v in value.items()]}
    if isinstance(value, list):
        return [encode_outcome(v) for v in value]
    if isinstance(value, tuple):
        return {"$t": [encode_outcome(v) for v in value]}
    if value is None or isinstance(value, (str, int, float)):  # bool is an int
        return value
    raise TypeError(f"a bulk outcome holds a {type(value).__name__}, which a checkpoint cannot keep exactly")


def decode_outcome(data: Any) -> Any:
    """The value :func:`encode_outcome` encoded."""
    if isinstance(data, list):
        return [decode_outcome(v) for v in data]
    if not isinstance(data, dict):
        return data
    if len(data) == 1:
        ((tag, body),) = data.items()
        if tag == "$f":
            return RowFailure(*body)
        if tag == "$a":
            dtype, shape, raw = body
            return np.frombuffer(base64.b64decode(raw), dtype=np.dtype(dtype)).reshape(shape).copy()
        if tag == "$s":
            dtype, raw = body
            return np.frombuffer(base64.b64decode(raw), dtype=np.dtype(dtype))[0]
        if tag == "$d":
            return {decode_outcome(k): decode_outcome(v) for k, v in body}
        if tag == "$t":
            return tuple(decode_outcome(v) for v in body)
    return {k: decode_outcome(v) for k, v in data.items()}


def _record(doc: Any) -> bytes:
    payload = json.dumps(doc, ensure_ascii=False, separators=(",", ":"), allow_nan=True).encode("utf-8")
    return _HEAD.pack(len(payload), zlib.crc32(payload)) + payload


def _read_records(data: bytes) -> tuple[list[Any], int]:
    """The records of a journal's bytes up to the first torn or corrupt one, and the length
    of that valid prefix."""
    docs: list[Any] = []
    pos = 0
    while pos + _HEAD.size <= len(data):
        length, crc = _HEAD.unpack_from(data, pos)
        payload = data[pos + _HEAD.size : pos + _HEAD.size + length]
        if len(payload) < length or zlib.crc32(payload) != crc:
            break
        try:
            docs.append(json.loads(payload))
        except ValueError:
            break
        pos += _HEAD.size + length
    return docs, pos


def journal_rows(path: Path) -> int:
    """How many rows' outcomes the journal at ``path`` holds (up to a torn tail), whatever
    window it was written for."""
    docs, _ = _read_records(path.read_bytes())
    return sum(len(d["rows"]) for d in docs[1:])


class WindowJournal:
    """The journal of one window: opened (restoring what an earlier run wrote, when it was
    written for this window and these batching settings), appended to as batches finish,
    then removed once the window's shard is committed."""

    def __init__(self, path: Path, header: Mapping[str, Any], sync_every_s: float = 5.0) -> None:
        self.path = path
        self.header = {"format": _FORMAT, **header}
        self.sync_every_s = sync_every_s
        self.restored: dict[int, Outcome] = {}
        self.appended_rows = 0
        self._lock = threading.Lock()  # records may come from the task's threads
        self._fd: int | None = None
        self._last_sync = time.monotonic()
        #: test seam: called with the rows the journal holds after each record
        self.on_record: Callable[[int], None] | None = None

    def open(self) -> dict[int, Outcome]:
        """Open the journal for appending; returns the outcomes it already holds (positions in
        the window → outcome), none when it was absent or written for something else."""
        path = self.path
        path.parent.mkdir(parents=True, exist_ok=True)
        valid = 0
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            data = b""
        if data:
            docs, valid = _read_records(data)
            if docs and docs[0] == self.header:
                for doc in docs[1:]:
                    for pos, outcome in zip(doc["rows"], doc["outcomes"], strict=True):
                        self.restored[int(pos)] = decode_outcome(outcome)
            else:  # another window's, other settings', or torn in its header: start over
                valid = 0
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.ftruncate(fd, valid)  # drop a torn tail before appending after it
            os.lseek(fd, valid, os.SEEK_SET)
            if valid == 0:
                os.write(fd, _record(self.header))
                os.fsync(fd)
                fsync_dir(path.parent)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self._last_sync = time.monotonic()
        return dict(self.restored)

    def append(self, positions: Sequence[int], outcomes: Sequence[Outcome]) -> None:
        """Record finished outcomes (``positions``: their rows' places in the window)."""
        rec = _record({"rows": list(positions), "outcomes": [encode_outcome(o) for o in outcomes]})
        with self._lock:
            if self._fd is None:
                return
            os.write(self._fd, rec)
            self.appended_rows += len(positions)
            now = time.monotonic()
            if now - self._last_sync >= self.sync_every_s:
                os.fsync(self._fd)
                self._last_sync = now
            held = len(self.restored) + self.appended_rows
        if self.on_record is not None:
            self.on_record(held)

    def close(self) -> None:
        """Make what was appended durable and close the file (calling it again is harmless)."""
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def remove(self) -> None:
        """Close and delete the journal: its window is committed."""
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
        self.path.unlink(missing_ok=True)
