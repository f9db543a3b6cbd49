"""``ortbatch run``: bulk inference over files — sorted, resumable, never a row lost.

    from ortbatch.bulk import run
    summary = run("exports/minilm", "passages.parquet", "embeddings/", text_column="passage")
    summary.exit_code   # 0 only when every row succeeded

The rooms: :mod:`~ortbatch.bulk.sources` (input files as numbered rows),
:mod:`~ortbatch.bulk.tasks` (rows in, one result or failure per row out, per kind of
export), :mod:`~ortbatch.bulk.batchapi` (OpenAI Batch API lines),
:mod:`~ortbatch.bulk.output` (atomic shards and the manifest a resume reads) and
:mod:`~ortbatch.bulk.job` (windows, progress, summary). Needs the ``bulk`` extra for
Parquet (pyarrow) and text (tokenizers).
"""

from __future__ import annotations

from .job import EXIT_ROW_ERRORS, RunConfig, RunSummary, run
from .output import OutputError
from .tasks import Field, RowFailure, Task

__all__ = ["EXIT_ROW_ERRORS", "Field", "OutputError", "RowFailure", "RunConfig", "RunSummary", "Task", "run"]
