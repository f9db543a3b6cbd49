"""The job: read the input a window at a time, compute each window, commit it as a shard.

One window is one shard: ``window`` consecutive input rows (the last may be shorter). The
task sorts a window's rows by length to batch them and returns its outcomes in input
order; successes go to the shard's part file, failures to its errors file, then the shard
is committed (:mod:`ortbatch.bulk.output`). Memory holds one window (and one Parquet
record batch of the input), whatever the input's size. A resumed run starts at the end of
the last committed shard; the windows it reads are the same as an uninterrupted run's, and
batch composition depends on the rows alone, so its shards hold the same bytes.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

from ..errors import InvalidInputError, UnsupportedModelError
from ..manifest import MANIFEST_NAME
from .output import OutputDir, OutputError, ShardInfo
from .sources import Row, Source, SourceOptions
from .tasks import GENERATION_TASKS, EncoderTask, RowFailure, Task, TaskOptions, export_task, task_for

__all__ = ["EXIT_ROW_ERRORS", "RunConfig", "RunSummary", "run"]

#: exit status of ``ortbatch run`` when the job finished but some rows failed
EXIT_ROW_ERRORS = 3
#: test seam: ``SHARD:POINT`` makes the process SIGKILL itself at that point of that shard
#: (POINT: ``computed`` before anything is written, ``written`` with the part file written
#: but not yet renamed, ``renamed`` before the shard's manifest, ``committed`` after it);
#: ``SHARD:POINT:INT`` sends SIGINT instead (Ctrl-C)
KILL_ENV = "ORTBATCH_RUN_KILL_AT"


@dataclass(frozen=True)
class RunConfig:
    """Options of :func:`run` (and ``ortbatch run``)."""

    text_column: str | None = None  # default "text" ("prompt" for generation exports)
    pair_column: str | None = None
    id_column: str | None = None
    input_format: str = "auto"
    output_format: str | None = None  # default parquet (jsonl for Batch API input)
    window: int = 4096
    truncate: bool = False
    normalize: bool = True
    max_batch_size: int | None = None
    providers: Any = None
    max_new_tokens: int = 64
    restart: bool = False
    progress: bool | None = None  # None: a bar on a terminal, lines every progress_every_s otherwise
    progress_every_s: float = 10.0

    def __post_init__(self) -> None:
        if self.window < 1:
            raise InvalidInputError(f"window must be at least 1 row, got {self.window}")
        if self.max_new_tokens < 1:
            raise InvalidInputError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")


@dataclass
class RunSummary:
    """How the job went: rows in all (this run and the earlier runs it resumed), those that
    succeeded and failed (by kind), where the output and errors are, and this run's pace."""

    output: str
    errors_file: str
    rows: int = 0
    succeeded: int = 0
    failed: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    resumed_rows: int = 0
    shards: int = 0
    seconds: float = 0.0
    rows_per_s: float = 0.0
    tokens_per_s: float = 0.0

    @property
    def ok(self) -> bool:
        """True when every row succeeded."""
        return self.failed == 0

    @property
    def exit_code(self) -> int:
        """0 when every row succeeded, else :data:`EXIT_ROW_ERRORS` (3)."""
        return 0 if self.ok else EXIT_ROW_ERRORS

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(self.failures.items()))
        lines = [
            f"{self.rows} rows: {self.succeeded} succeeded, {self.failed} failed" + (f" ({kinds})" if kinds else ""),
            f"output: {self.output}" + (f" (resumed after {self.resumed_rows} rows)" if self.resumed_rows else ""),
        ]
        if self.failed:
            lines.append(f"errors: {self.errors_file}")
        lines.append(f"this run: {self.seconds:.1f} s, {self.rows_per_s:.0f} rows/s, {self.tokens_per_s:.0f} tokens/s")
        return "\n".join(lines)


class Progress:
    """Rows/s, tokens/s, ETA and errors: a bar redrawn in place on a terminal, otherwise a
    plain line every ``every_s`` seconds."""

    def __init__(self, total: int | None, done: int, stream: TextIO, tty: bool, every_s: float, enabled: bool) -> None:
        self.total, self.start_rows = total, done
        self.stream, self.tty, self.every_s, self.enabled = stream, tty, every_s, enabled
        self.t0 = self.last = time.monotonic()
        self.rows = done
        self.tokens = 0
        self.errors = 0

    def update(self, rows: int, tokens: int, errors: int) -> None:
        self.rows += rows
        self.tokens += tokens
        self.errors += errors
        now = time.monotonic()
        if self.enabled and (self.tty or now - self.last >= self.every_s):
            self.last = now
            self._show(now)

    def _show(self, now: float, final: bool = False) -> None:
        dt = max(now - self.t0, 1e-9)
        rate = (self.rows - self.start_rows) / dt
        parts = [f"{self.rows}" + (f"/{self.total}" if self.total else "") + " rows"]
        parts += [f"{rate:.0f} rows/s", f"{self.tokens / dt:.0f} tokens/s"]
        if self.total and rate > 0 and not final:
            parts.append(f"ETA {_duration(max(self.total - self.rows, 0) / rate)}")
        parts.append(f"{self.errors} errors")
        text = ", ".join(parts)
        if self.tty:
            bar = ""
            if self.total:
                filled = int(30 * min(self.rows / self.total, 1.0))
                bar = "[" + "#" * filled + "." * (30 - filled) + "] "
            self.stream.write("\r" + bar + text + ("\n" if final else ""))
        else:
            self.stream.write("ortbatch run: " + text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            self._show(time.monotonic(), final=True)


def _duration(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}h{s // 60 % 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _kill_hook() -> Callable[[int, str], None]:
    target = os.environ.get(KILL_ENV, "")
    if not target:
        return lambda shard, point: None
    shard_s, where, *how = target.split(":")
    sig = signal.SIGINT if how == ["INT"] else signal.SIGKILL

    def hook(shard: int, point: str) -> None:
        if str(shard) == shard_s and point == where:
            os.kill(os.getpid(), sig)

    return hook


def _build_task(export: Path, config: RunConfig, batch_api: bool) -> Task:
    options = TaskOptions(
        truncate=config.truncate,
        normalize=config.normalize,
        max_batch_size=config.max_batch_size,
        providers=config.providers,
        max_new_tokens=config.max_new_tokens,
        # a window's batches are queued at once: room for all of them, whatever their size
        max_queue=max(config.window, 1024),
    )
    if not batch_api:
        return task_for(export, options)
    from .batchapi import BatchApiTask

    if export_task(export) in GENERATION_TASKS:
        return BatchApiTask(None, export.resolve().name, "it is a text-generation export")
    inner = task_for(export, options)
    if not isinstance(inner, EncoderTask) or inner.kind != "embedding":
        name, kind = inner.model_name, inner.kind
        inner.close()
        return BatchApiTask(None, name, f"it is a {kind} export")
    return BatchApiTask(inner, inner.model_name)


def run(
    export: str | os.PathLike[str],
    input: str | os.PathLike[str],
    output: str | os.PathLike[str],
    config: RunConfig | None = None,
    *,
    stream: TextIO | None = None,
    **options: Any,
) -> RunSummary:
    """Compute the export's task for every row of ``input`` (a JSONL, CSV or Parquet file,
    a folder of them, or an OpenAI Batch API file) into the folder ``output``, resuming
    where an earlier run of the same job stopped.

    ``config`` (or its fields as keyword arguments) says which columns hold what and how
    rows are computed; see :class:`RunConfig`. Failed rows do not stop the job: they are
    listed in ``output/_errors.jsonl``. Returns the :class:`RunSummary`
    (``summary.exit_code`` is 0 only when every row succeeded). Raises
    :class:`~ortbatch.errors.OrtBatchError` subclasses for a bad argument (the export,
    the input, an output folder holding another job), never for a bad row.
    """
    if config is None:
        config = RunConfig(**options)
    elif options:
        raise TypeError("pass either config or keyword options, not both")
    out_stream = stream if stream is not None else sys.stderr
    export_dir = Path(export)
    if not export_dir.is_dir() or not ((export_dir / MANIFEST_NAME).is_file() or (export_dir / "model.onnx").is_file()):
        raise UnsupportedModelError(f"{export_dir} is not an export directory (no {MANIFEST_NAME} or model.onnx)")
    generation = export_task(export_dir) in GENERATION_TASKS
    text_column = config.text_column or ("prompt" if generation else "text")
    source = Source(
        input,
        SourceOptions(text_column, config.pair_column, config.id_column, config.input_format),
        batch_rows=config.window,
    )
    fmt = config.output_format or ("jsonl" if source.batch_api else "parquet")
    if source.batch_api and fmt != "jsonl":
        raise OutputError(
            "OpenAI Batch API input is answered in the Batch API's JSONL output format: use --format jsonl"
        )
    outdir = OutputDir(output, fmt)
    task = _build_task(export_dir, config, source.batch_api)
    try:
        job = {
            "export": str(export_dir.resolve()),
            "input": source.fingerprint(),
            "task": task.describe(),
            "columns": {"text": text_column, "pair": config.pair_column, "id": config.id_column},
            "window": config.window,
            "format": fmt,
        }
        shards = outdir.open(job, config.restart)
        return _run(task, source, outdir, job, shards, config, out_stream)
    finally:
        task.close()


def _run(
    task: Task,
    source: Source,
    outdir: OutputDir,
    job: dict[str, Any],
    shards: list[ShardInfo],
    config: RunConfig,
    stream: TextIO,
) -> RunSummary:
    kill = _kill_hook()
    start = int(shards[-1]["end"]) if shards else 0
    resumed = start
    tty = bool(getattr(stream, "isatty", lambda: False)())
    enabled = config.progress is not False
    progress = Progress(source.count(), start, stream, tty, config.progress_every_s, enabled)
    t0 = time.monotonic()
    tokens = 0
    with_id = config.id_column is not None
    window: list[Row] = []
    rows = source.rows(start)
    index = len(shards)
    while True:
        window.clear()
        for row in rows:
            window.append(row)
            if len(window) >= config.window:
                break
        if not window:
            break
        outcomes = task.run(window)
        kill(index, "computed")
        records, errors = [], []
        for row, outcome in zip(window, outcomes, strict=True):
            if isinstance(outcome, RowFailure):
                errors.append(task.error_record(row, outcome))
            else:
                records.append(task.record(row, outcome, with_id))
        info = outdir.commit(
            index,
            window[0].index,
            window[-1].index + 1,
            records,
            task.fields,
            errors,
            {"tokens": task.last_tokens, "failures": dict(Counter(e_kind(e) for e in errors))},
            hook=functools.partial(kill, index),
        )
        shards.append(info)
        tokens += task.last_tokens
        progress.update(len(window), task.last_tokens, len(errors))
        index += 1
    progress.close()
    seconds = time.monotonic() - t0
    failures: Counter[str] = Counter()
    for s in shards:
        failures.update(s.get("failures", {}))
    total = int(shards[-1]["end"]) if shards else 0
    failed = sum(int(s["errors"]) for s in shards)
    summary = RunSummary(
        output=str(outdir.path),
        errors_file=str(outdir.path / "_errors.jsonl"),
        rows=total,
        succeeded=sum(int(s["rows"]) for s in shards),
        failed=failed,
        failures=dict(sorted(failures.items())),
        resumed_rows=resumed,
        shards=len(shards),
        seconds=seconds,
        rows_per_s=(total - resumed) / seconds if seconds > 0 else 0.0,
        tokens_per_s=tokens / seconds if seconds > 0 else 0.0,
    )
    outdir.finish(job, shards, summary.to_dict())
    return summary


def e_kind(record: dict[str, Any]) -> str:
    """The failure kind of an errors-file record (plain or Batch API shaped)."""
    if "error" in record and isinstance(record["error"], str):
        return record["error"]
    err = record.get("error") or ((record.get("response") or {}).get("body") or {}).get("error") or {}
    return str(err.get("code", "error"))
