"""``ortbatch run``: bulk inference over files — sorted, resumable, never a row lost.

    from ortbatch.bulk import run
    summary = run("exports/minilm", "passages.parquet", "embeddings/", text_column="passage")
    summary.exit_code   # 0 only when every row succeeded

The rooms: :mod:`~ortbatch.bulk.sources` (input files as numbered rows),
:mod:`~ortbatch.bulk.tasks` (rows in, one result or failure per row out, per kind of
export), :mod:`~ortbatch.bulk.batchapi` (OpenAI Batch API lines; their completion and chat
lines in :mod:`~ortbatch.bulk.batch_completions`, through serve's transport-free core),
:mod:`~ortbatch.bulk.output` (atomic shards and the manifest a resume reads),
:mod:`~ortbatch.bulk.checkpoint` (the open window's finished batches, restored by a resume),
:mod:`~ortbatch.bulk.plan` (what a job is, whichever engine runs it: settings, identity,
one window → one shard, the summary), :mod:`~ortbatch.bulk.job` (the job in this process:
windows, progress) and :mod:`~ortbatch.bulk.ray_data` (the same job on Ray Data, with
``ray=``). Needs the ``bulk`` extra for Parquet (pyarrow) and text (tokenizers), and the
``ray`` extra for ``ray=``.
"""

from __future__ import annotations

from .job import run
from .output import OutputError
from .plan import EXIT_ROW_ERRORS, RayOptions, RunConfig, RunSummary
from .tasks import Field, RowFailure, Task

__all__ = [
    "EXIT_ROW_ERRORS",
    "Field",
    "OutputError",
    "RayOptions",
    "RowFailure",
    "RunConfig",
    "RunSummary",
    "Task",
    "run",
]
