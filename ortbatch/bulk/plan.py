"""What a bulk job is, whichever engine runs it (this process, or Ray Data with ``--ray``).

* its settings: :class:`RunConfig` (and :class:`RayOptions` for ``--ray``);
* what it computes: :func:`build_task`, the :class:`~ortbatch.bulk.tasks.Task` for the export;
* its identity: :func:`prepare` checks the arguments, and :meth:`Prepared.job` is the
  document a resume must match (the export, the input files, the task, the columns, the
  window, the format; never the engine, so a job begun on Ray may be finished here);
* one window of rows → one encoded shard: :func:`compute_shard`, the same function in both
  engines, so their shards hold the same bytes;
* the end: :func:`finish`, the summary and the files written last.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from ..errors import InvalidInputError, UnsupportedModelError
from ..manifest import MANIFEST_NAME
from .dispatch import kind_source, task_for
from .output import OutputDir, OutputError, ShardFiles, ShardInfo, encode_shard
from .sources import Row, Source, SourceOptions
from .tasks import EncoderTask, RowFailure, Task, TaskOptions, export_kind, job_sampling

__all__ = [
    "EXIT_ROW_ERRORS",
    "Prepared",
    "RayOptions",
    "RunConfig",
    "RunSummary",
    "build_task",
    "compute_shard",
    "failure_kind",
    "finish",
    "prepare",
]

#: exit status of ``ortbatch run`` when the job finished but some rows failed
EXIT_ROW_ERRORS = 3


@dataclass(frozen=True)
class RayOptions:
    """How ``ortbatch run --ray`` runs the job on Ray Data.

    ``address``: the cluster (``ray.init``'s; None: a Ray already initialised in this
    process, else a cluster started with ``ray start`` on this machine, else a new local
    one). ``concurrency``: workers, each an actor owning one session (or generator); None:
    the cluster's CPUs (GPUs with ``gpus``) divided by what one worker takes. ``cpus`` and
    ``gpus``: what one worker takes; ONNX Runtime's threads follow ``cpus``.
    """

    address: str | None = None
    concurrency: int | None = None
    cpus: float = 1.0
    gpus: float = 0.0

    def __post_init__(self) -> None:
        if self.concurrency is not None and self.concurrency < 1:
            raise InvalidInputError(f"ray concurrency must be at least 1 worker, got {self.concurrency}")
        if not (0 < self.cpus < math.inf and 0 <= self.gpus < math.inf):  # NaN fails both
            raise InvalidInputError(f"ray workers need CPUs > 0 and GPUs >= 0, got cpus={self.cpus}, gpus={self.gpus}")


@dataclass(frozen=True)
class RunConfig:
    """Options of :func:`~ortbatch.bulk.run` (and ``ortbatch run``). ``ray``: None (or
    False) runs the job in this process; True or a :class:`RayOptions` on Ray Data."""

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
    #: a generation job's sampling parameters, as ``/v1/completions`` takes them (``temperature``,
    #: ``top_p``, ``top_k``, ``seed``, ...; see ``tasks.SAMPLING_FIELDS``); None: greedy
    sampling: Mapping[str, Any] | None = None
    restart: bool = False
    progress: bool | None = None  # None: a bar on a terminal, lines every progress_every_s otherwise
    progress_every_s: float = 10.0
    #: each finished batch is appended to its window's checkpoint at once (a killed process
    #: loses only the batches in flight); the checkpoint is fsynced at most this far apart
    #: (what a power loss may cost)
    checkpoint_every_s: float = 5.0
    ray: RayOptions | bool | None = None

    def __post_init__(self) -> None:
        if self.window < 1:
            raise InvalidInputError(f"window must be at least 1 row, got {self.window}")
        if self.max_batch_size is not None and self.max_batch_size < 1:
            raise InvalidInputError(f"max_batch_size must be at least 1 row, got {self.max_batch_size}")
        if not 0 <= self.checkpoint_every_s < math.inf:  # NaN fails too
            raise InvalidInputError(f"checkpoint_every_s must be seconds >= 0, got {self.checkpoint_every_s}")
        if self.max_new_tokens < 1:
            raise InvalidInputError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if self.sampling is not None:
            job_sampling(self.sampling, self.max_new_tokens)  # refused here, before anything is opened
        if self.ray is True:
            object.__setattr__(self, "ray", RayOptions())
        elif self.ray is False:
            object.__setattr__(self, "ray", None)
        elif self.ray is not None and not isinstance(self.ray, RayOptions):
            raise InvalidInputError(f"ray must be True, False, None or a RayOptions, got {self.ray!r:.60}")

    def task_options(self, cpus: int | None = None) -> TaskOptions:
        """The parts of this config a task reads (``cpus``: the cores its sessions share)."""
        return TaskOptions(
            truncate=self.truncate,
            normalize=self.normalize,
            max_batch_size=self.max_batch_size,
            providers=self.providers,
            max_new_tokens=self.max_new_tokens,
            sampling=self.sampling,
            # a window's batches are queued at once: room for all of them, whatever their size
            max_queue=max(self.window, 1024),
            cpus=cpus,
        )


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
    #: rows of a window not yet committed that this run restored from its checkpoint
    restored_rows: int = 0
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

    def _resumed(self) -> str:
        if not (self.resumed_rows or self.restored_rows):
            return ""
        restored = f"; {self.restored_rows} more restored from a checkpoint" if self.restored_rows else ""
        return f" (resumed after {self.resumed_rows} rows{restored})"

    def describe(self) -> str:
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(self.failures.items()))
        lines = [
            f"{self.rows} rows: {self.succeeded} succeeded, {self.failed} failed" + (f" ({kinds})" if kinds else ""),
            f"output: {self.output}" + self._resumed(),
        ]
        if self.failed:
            lines.append(f"errors: {self.errors_file}")
        lines.append(f"this run: {self.seconds:.1f} s, {self.rows_per_s:.0f} rows/s, {self.tokens_per_s:.0f} tokens/s")
        return "\n".join(lines)


def build_task(export: Path, options: TaskOptions, batch_api: bool) -> Task:
    """The task that computes the export for rows of this input (Batch API lines, or rows)."""
    if not batch_api:
        return task_for(export, options)
    from .batch_completions import CompletionLines
    from .batchapi import BatchApiTask

    if export_kind(export).bulk_task == "generation":
        name = export.resolve().name or "model"
        return BatchApiTask(None, name, "it is a text-generation export", CompletionLines(export, options, name))
    inner = task_for(export, options)
    if not isinstance(inner, EncoderTask) or inner.kind != "embedding":
        name, kind = inner.model_name, inner.kind
        inner.close()
        return BatchApiTask(None, name, f"it is a {kind} export")
    return BatchApiTask(inner, inner.model_name, "it is an embedding export")


@dataclass(frozen=True)
class Prepared:
    """A job's arguments, checked: the export, the input, the output folder (not yet opened)."""

    export: Path
    source: Source
    outdir: OutputDir
    text_column: str
    config: RunConfig

    @property
    def batch_api(self) -> bool:
        return self.source.batch_api

    @property
    def format(self) -> str:
        return self.outdir.format

    def task_options(self, cpus: int | None = None) -> TaskOptions:
        """The config's :class:`TaskOptions`, with ``created``: the input's modification time
        (its newest file's, in whole seconds), which Batch API completion answers carry."""
        files = self.source.fingerprint()["files"]
        created = max((int(f["mtime_ns"]) for f in files), default=0) // 1_000_000_000
        return replace(self.config.task_options(cpus), created=created)

    def job(self, task: dict[str, Any]) -> dict[str, Any]:
        """What a resume must match, given the task's ``describe()``."""
        c = self.config
        return {
            "export": str(self.export.resolve()),
            "input": self.source.fingerprint(),
            "task": task,
            "columns": {"text": self.text_column, "pair": c.pair_column, "id": c.id_column},
            "window": c.window,
            "format": self.format,
        }


def prepare(
    export: str | os.PathLike[str], input: str | os.PathLike[str], output: str | os.PathLike[str], config: RunConfig
) -> Prepared:
    """Check the arguments (raising :class:`~ortbatch.errors.OrtBatchError` subclasses for a
    bad one) and open the input."""
    export_dir = Path(export)
    if not export_dir.is_dir() or not ((export_dir / MANIFEST_NAME).is_file() or (export_dir / "model.onnx").is_file()):
        raise UnsupportedModelError(f"{export_dir} is not an export directory (no {MANIFEST_NAME} or model.onnx)")
    kind = export_kind(export_dir)  # refuses an export no kind serves
    generation = kind.bulk_task == "generation"
    text_column = config.text_column or ("prompt" if generation else "text")
    options = SourceOptions(text_column, config.pair_column, config.id_column, config.input_format)
    source = kind_source(kind, Path(input), options, config.window) or Source(input, options, batch_rows=config.window)
    fmt = config.output_format or ("jsonl" if source.batch_api else "parquet")
    if source.batch_api and fmt != "jsonl":
        raise OutputError(
            "OpenAI Batch API input is answered in the Batch API's JSONL output format: use --format jsonl"
        )
    return Prepared(export_dir, source, OutputDir(output, fmt), text_column, config)


def compute_shard(task: Task, rows: Sequence[Row], index: int, with_id: bool, fmt: str) -> ShardFiles:
    """Window ``index`` (its ``rows``, in input order) computed and encoded as its shard."""
    outcomes = task.run(rows)
    records, errors = [], []
    for row, outcome in zip(rows, outcomes, strict=True):
        if isinstance(outcome, RowFailure):
            errors.append(task.error_record(row, outcome))
        else:
            records.append(task.record(row, outcome, with_id))
    extra = {"tokens": task.last_tokens, "failures": dict(Counter(failure_kind(e) for e in errors))}
    return encode_shard(index, rows[0].index, rows[-1].index + 1, records, task.fields, errors, extra, fmt)


def failure_kind(record: dict[str, Any]) -> str:
    """The failure kind of an errors-file record (plain or Batch API shaped)."""
    if "error" in record and isinstance(record["error"], str):
        return record["error"]
    err = record.get("error") or ((record.get("response") or {}).get("body") or {}).get("error") or {}
    return str(err.get("code", "error"))


def finish(
    prepared: Prepared,
    job: dict[str, Any],
    shards: list[ShardInfo],
    resumed: int,
    seconds: float,
    tokens: int,
    restored: int = 0,
) -> RunSummary:
    """The summary of a job whose every window is committed (``shards``, in order), written
    with the job's errors file and manifest. ``resumed``: rows committed before this run;
    ``restored``: rows this run restored from a checkpoint instead of computing them."""
    outdir = prepared.outdir
    for k, s in enumerate(shards):
        if s["shard"] != k:  # pragma: no cover - the engines commit every window first
            raise OutputError(f"shard {k} of {outdir.path} is missing; rerun the same command to compute it")
    failures: Counter[str] = Counter()
    for s in shards:
        failures.update(s.get("failures", {}))
    total = int(shards[-1]["end"]) if shards else 0
    summary = RunSummary(
        output=str(outdir.path),
        errors_file=str(outdir.path / "_errors.jsonl"),
        rows=total,
        succeeded=sum(int(s["rows"]) for s in shards),
        failed=sum(int(s["errors"]) for s in shards),
        failures=dict(sorted(failures.items())),
        resumed_rows=resumed,
        restored_rows=restored,
        shards=len(shards),
        seconds=seconds,
        rows_per_s=(total - resumed - restored) / seconds if seconds > 0 else 0.0,
        tokens_per_s=tokens / seconds if seconds > 0 else 0.0,
    )
    outdir.finish(job, shards, summary.to_dict())
    return summary
