"""The job: read the input a window at a time, compute each window, commit it as a shard.

One window is one shard: ``window`` consecutive input rows (the last may be shorter). The
task sorts a window's rows by length to batch them and returns its outcomes in input
order; successes go to the shard's part file, failures to its errors file, then the shard
is committed (:mod:`ortbatch.bulk.output`). Memory holds one window (and one Parquet
record batch of the input), whatever the input's size. A resumed run computes the windows
not yet committed; they are the same windows as an uninterrupted run's, and batch
composition depends on the rows alone, so its shards hold the same bytes.

:func:`run` runs the job here, or with ``ray=`` on Ray Data (:mod:`ortbatch.bulk.ray_data`,
imported only then): both compute each window with :func:`~ortbatch.bulk.plan.compute_shard`.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from .checkpoint import JOURNAL_DIR, WindowJournal, rows_digest
from .output import ShardInfo
from .plan import (
    EXIT_ROW_ERRORS,
    Prepared,
    RayOptions,
    RunConfig,
    RunSummary,
    build_task,
    compute_shard,
    finish,
    prepare,
)
from .progress import make_progress
from .sources import Row
from .tasks import Task

__all__ = ["EXIT_ROW_ERRORS", "KILL_ENV", "RunConfig", "RunSummary", "run"]

#: test seam: ``SHARD:POINT`` makes the process SIGKILL itself at that point of that shard
#: (POINT: ``computed`` before anything is written, ``written`` with the part file written
#: but not yet renamed, ``renamed`` before the shard's manifest, ``committed`` after it;
#: ``rows:N`` as soon as the shard's checkpoint holds N rows or more, while its other
#: batches are still computing); ``SHARD:POINT:INT`` sends SIGINT instead (Ctrl-C), and
#: ``SHARD:POINT:STOP`` SIGSTOP (the process waits there to be killed from outside)
KILL_ENV = "ORTBATCH_RUN_KILL_AT"


def _kill_hook() -> Callable[[int, str], None]:
    target = os.environ.get(KILL_ENV, "")
    if not target:
        return lambda shard, point: None
    shard_s, where, *how = target.split(":")
    if where == "rows":  # ``SHARD:rows:N``: once the shard's checkpoint holds N rows or more
        at_least = int(how.pop(0))
    # INT: Ctrl-C; STOP: the process stops there, for a test to SIGKILL it from outside
    sig = {"INT": signal.SIGINT, "STOP": signal.SIGSTOP}.get(how[0] if how else "", signal.SIGKILL)

    def hook(shard: int, point: str) -> None:
        if str(shard) != shard_s:
            return
        if point == where or (where == "rows" and point.startswith("rows:") and int(point[5:]) >= at_least):
            os.kill(os.getpid(), sig)

    return hook


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
    rows are computed; see :class:`RunConfig`. With ``ray=True`` (or a
    :class:`~ortbatch.bulk.RayOptions`) the job runs on Ray Data, with the same output.
    Failed rows do not stop the job: they are listed in ``output/_errors.jsonl``. Returns
    the :class:`RunSummary` (``summary.exit_code`` is 0 only when every row succeeded).
    Raises :class:`~ortbatch.errors.OrtBatchError` subclasses for a bad argument (the
    export, the input, an output folder holding another job), never for a bad row.
    """
    if config is None:
        config = RunConfig(**options)
    elif options:
        raise TypeError("pass either config or keyword options, not both")
    out_stream = stream if stream is not None else sys.stderr
    prepared = prepare(export, input, output, config)
    if isinstance(config.ray, RayOptions):
        from .ray_data import run_on_ray

        return run_on_ray(prepared, config.ray, out_stream)
    task = build_task(prepared.export, prepared.task_options(), prepared.batch_api)
    try:
        job = prepared.job(task.describe())
        shards = prepared.outdir.open(job, config.restart)
        return _run(task, prepared, job, shards, out_stream)
    finally:
        prepared.outdir.release()  # the folder's lock, taken by open()
        task.close()


def _run(task: Task, prepared: Prepared, job: dict[str, Any], shards: list[ShardInfo], stream: TextIO) -> RunSummary:
    config = prepared.config
    kill = _kill_hook()
    done = {int(s["shard"]): s for s in shards}
    resumed = sum(int(s["end"]) - int(s["start"]) for s in shards)
    restored = 0  # rows of an open window restored from its checkpoint
    progress = make_progress(prepared, resumed, stream)
    task.on_progress = progress.advance  # shown from the first batch, not the first window
    t0 = time.monotonic()
    tokens = 0
    with_id = config.id_column is not None
    index = next(k for k in range(len(done) + 1) if k not in done)  # the first window not committed
    rows = prepared.source.rows(index * config.window)
    window: list[Row] = []
    while True:
        window.clear()
        for row in rows:
            window.append(row)
            if len(window) >= config.window:
                break
        if not window:
            break
        if index not in done:  # windows after a gap (a --ray run commits out of order)
            journal = _journal(task, prepared, job, window, index, kill)
            try:
                if journal is not None:
                    task.restored = journal.open()
                    task.on_outcomes = journal.append
                    restored += len(task.restored)
                    progress.restore(len(task.restored))
                files = compute_shard(task, window, index, with_id, prepared.format)
            finally:
                task.restored = task.on_outcomes = None
                if journal is not None:
                    journal.close()  # durable, also when interrupted (Ctrl-C)
            kill(index, "computed")
            done[index] = prepared.outdir.write_shard(files, hook=functools.partial(kill, index))
            if journal is not None:
                journal.remove()  # the shard holds its rows now
            tokens += task.last_tokens
            progress.update(len(window), task.last_tokens, int(files.info["errors"]))
        index += 1
    progress.close()
    ordered = [done[k] for k in sorted(done)]
    return finish(prepared, job, ordered, resumed, time.monotonic() - t0, tokens, restored)


def _journal(
    task: Task, prepared: Prepared, job: dict[str, Any], window: list[Row], index: int, kill: Callable[[int, str], None]
) -> WindowJournal | None:
    """The checkpoint journal of window ``index`` (None for a task without checkpoints)."""
    if not task.checkpoints:
        return None
    header = {
        "shard": index,
        "start": window[0].index,
        "rows": len(window),
        "digest": rows_digest(window),
        "task": job["task"],
        "batching": task.batching(),
    }
    path = prepared.outdir.path / JOURNAL_DIR / f"{index:06d}.log"
    journal = WindowJournal(path, header, prepared.config.checkpoint_every_s)
    journal.on_record = lambda held: kill(index, f"rows:{held}")
    return journal
