"""``ortbatch run --ray``: the same job on Ray Data, with the same output and the same resume.

The pipeline is Ray Data's ``read → map_batches → write``:

* **read** (:class:`WindowSource`, a Ray Data ``Datasource``): one read task per window not
  yet committed. The driver finds where each window starts in one pass over the input
  (:meth:`~ortbatch.bulk.sources.Source.positions`), and a read task reads its window from
  there with the local path's own reader, so rows are numbered, and bad rows (not UTF-8,
  not JSON) fail, exactly as they do locally. A window travels as one Ray Data row (its
  rows pickled), because the window is the unit of determinism: it is sorted by length and
  cut into batches as a whole, and Ray Data's batches would otherwise cut it at block
  boundaries.
* **map_batches** (:class:`ShardWorker`, ``concurrency`` actors): each actor owns one
  task, so one :class:`~ortbatch.BatchedSession` (or :class:`~ortbatch.BatchedGenerator`),
  and turns a window into its shard's bytes with :func:`~ortbatch.bulk.plan.compute_shard`,
  the function the local path uses: the part files are byte for byte the local run's.
* **write** (:class:`ShardSink`, a Ray Data ``Datasink``): writes each shard's files and
  commits it with its manifest (:meth:`~ortbatch.bulk.output.OutputDir.write_shard`).

Reads and writes run on the driver's node (``supports_distributed_reads/writes`` False), so
INPUT and OUTPUT are paths on the machine where ``ortbatch run --ray`` runs; only the
export must be at the same path on every node (as for ``ortbatch serve --ray``).

**Faults.** Ray Data restarts a dead actor and retries its window (``max_restarts`` and
``max_task_retries`` -1 for actor pools); a window's shard is written by one atomic commit,
and writing it again writes the same bytes, so a killed worker loses and duplicates no row.
If the driver dies, the committed shards stay, and the same command resumes: windows are
committed in any order here, and a resume (local or on Ray) computes just the missing ones.

**Why not Ray Data's checkpointing.** Ray 2.60's ``DataContext.checkpoint_config`` (alpha
in ray#59409, the configuration beta) resumes by *row id*: it needs a unique id column,
loads every committed id into memory and filters the whole input by it on the next run,
and writes output files named by a fresh write UUID and task index. A resumed run would
then write differently named files holding differently grouped rows (not the uninterrupted
run's bytes, not in input order), the errors file and the manifest would not be covered,
its local-path backend asks for a network file system, and the checkpoint is deleted on
success. The shard manifest gives all of that by construction, for both engines.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import threading
import time
from collections.abc import Iterable, Iterator
from functools import cache
from pathlib import Path
from typing import Any, TextIO

from .._extras import require
from ..errors import OrtBatchError
from .output import OutputDir, ShardFiles, ShardInfo
from .plan import Prepared, RayOptions, RunSummary, build_task, compute_shard, finish
from .progress import Progress, make_progress
from .sources import Position, Source, SourceOptions
from .tasks import TaskOptions

__all__ = ["PAUSE_ENV", "RayJobError", "ShardWorker", "run_on_ray"]

#: test seam: ``SHARD:FOLDER``: while ``FOLDER/armed`` exists, the actor that is given window
#: SHARD writes its pid to ``FOLDER/shard-SHARD.pid`` and waits (until ``FOLDER/release``
#: exists, at most 120 s) before computing it, so a test can kill it there; the retry of the
#: window finds the pid file and goes on. (An environment variable of the Ray nodes: their
#: workers inherit it.)
PAUSE_ENV = "ORTBATCH_RUN_RAY_PAUSE_AT"


class RayJobError(OrtBatchError):
    """The job failed on Ray (a worker could not load the export, Ray Data gave up). The
    committed shards are kept: the same command resumes."""


# -- read: one Ray Data row per window ---------------------------------------------------------
def read_window(path: str, options: SourceOptions, window: int, index: int, position: Position) -> Any:
    """Window ``index`` of the input at ``path``, from ``position``, as one Arrow row."""
    pa = require("pyarrow", "bulk")
    rows = list(Source(path, options, batch_rows=window).rows_at(position, window))
    return pa.table(
        {
            "shard": pa.array([index], pa.int64()),
            "rows": pa.array([pickle.dumps(rows, protocol=pickle.HIGHEST_PROTOCOL)], pa.binary()),
        }
    )


@cache
def _classes() -> tuple[type, type]:
    """The Datasource and Datasink classes (built on first use: importing this module
    needs no ray)."""
    data: Any = require("ray.data", "ray")
    datasource: Any = require("ray.data.datasource", "ray")
    block: Any = require("ray.data.block", "ray")

    class WindowSource(data.Datasource):
        """The windows of a source still to compute, one read task each."""

        def __init__(self, path: str, options: SourceOptions, window: int, todo: list[tuple[int, Position]]) -> None:
            super().__init__()
            self.path, self.options, self.window, self.todo = path, options, window, todo

        def estimate_inmemory_data_size(self) -> int | None:
            return None

        def get_read_tasks(self, parallelism: int, **kwargs: Any) -> list[Any]:
            tasks = []
            for index, position in self.todo:
                meta = block.BlockMetadata(num_rows=1, size_bytes=None, exec_stats=None, input_files=None)

                def read(index: int = index, position: Position = position) -> Iterable[Any]:
                    return [read_window(self.path, self.options, self.window, index, position)]

                tasks.append(datasource.ReadTask(read, meta))
            return tasks

        @property
        def supports_distributed_reads(self) -> bool:
            return False  # the input is on the driver's machine

        def get_name(self) -> str:
            return "ReadWindows"

    class ShardSink(data.Datasink):
        """Writes and commits each shard it is given."""

        def __init__(self, path: str, fmt: str) -> None:
            self.path, self.format = path, fmt

        def write(self, blocks: Iterable[Any], ctx: Any) -> list[int]:
            out = OutputDir(self.path, self.format)
            done = []
            for b in blocks:
                for row in block.BlockAccessor.for_block(b).to_arrow().to_pylist():
                    info = json.loads(row["info"])
                    out.write_shard(ShardFiles(info, row["part"], row["errors"]))
                    done.append(int(info["shard"]))
            return done

        @property
        def supports_distributed_writes(self) -> bool:
            return False  # the output is on the driver's machine

        def get_name(self) -> str:
            return "WriteShards"

    return WindowSource, ShardSink


# -- map: one actor, one session -------------------------------------------------------------
class ShardWorker:
    """A Ray Data map actor: owns one task (so one BatchedSession or BatchedGenerator) and
    turns each window it is given into its shard's bytes."""

    def __init__(self, export: str, options: TaskOptions, batch_api: bool, with_id: bool, fmt: str) -> None:
        self.task = build_task(Path(export), options, batch_api)
        self.with_id, self.format = with_id, fmt

    def __call__(self, batch: Any) -> Any:
        pa = require("pyarrow", "bulk")
        out: dict[str, list[Any]] = {"info": [], "part": [], "errors": []}
        for index, blob in zip(batch.column("shard").to_pylist(), batch.column("rows").to_pylist(), strict=True):
            _pause(index)
            files = compute_shard(self.task, pickle.loads(blob), index, self.with_id, self.format)
            out["info"].append(json.dumps(files.info))
            out["part"].append(files.part)
            out["errors"].append(files.errors)
        return pa.table(
            {
                "info": pa.array(out["info"], pa.string()),
                "part": pa.array(out["part"], pa.binary()),
                "errors": pa.array(out["errors"], pa.binary()),
            }
        )


def _pause(index: int) -> None:
    target = os.environ.get(PAUSE_ENV, "")
    if not target:
        return
    shard, folder = target.split(":", 1)
    if int(shard) != index or not (Path(folder) / "armed").exists():
        return
    marker = Path(folder) / f"shard-{index}.pid"
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return  # the retry of a killed attempt
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (Path(folder) / "release").exists():
        time.sleep(0.05)


# -- the driver ------------------------------------------------------------------------------
def run_on_ray(prepared: Prepared, options: RayOptions, stream: TextIO) -> RunSummary:
    """Run the job on Ray Data (see the module docs); returns the same summary as a local run."""
    ray = require("ray", "ray")
    require("ray.data", "ray")
    started = False
    if not ray.is_initialized():
        try:
            ray.init(address=options.address, log_to_driver=False)
        except (ConnectionError, ValueError, RuntimeError) as exc:
            raise RayJobError(f"could not connect to the Ray cluster at {options.address!r}: {exc}") from exc
        started = True
    try:
        return _run(ray, prepared, options, stream)
    finally:
        if started:
            ray.shutdown()


def _worker_options(prepared: Prepared, options: RayOptions) -> TaskOptions:
    # ONNX Runtime's threads follow the worker's CPUs, not the node's (several share a node)
    cpus = max(1, int(options.cpus)) if not options.gpus else None
    return prepared.task_options(cpus)


def _describe(export: str, options: TaskOptions, batch_api: bool) -> dict[str, Any]:
    """On a worker: the task's ``describe()``, or why it could not be built (as text: an
    exception's own class may not survive the trip back)."""
    try:
        task = build_task(Path(export), options, batch_api)
    except OrtBatchError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    try:
        return {"task": task.describe()}
    finally:
        task.close()


def _describe_on_a_worker(ray: Any, prepared: Prepared, options: RayOptions, task_options: TaskOptions) -> Any:
    """The task's ``describe()``, built where the workers run (with a worker's resources):
    this also proves, before any window, that a worker can load the export."""
    resources: dict[str, Any] = {"num_cpus": options.cpus, "max_retries": 0}
    if options.gpus:
        resources["num_gpus"] = options.gpus
    export = str(prepared.export.resolve())
    try:
        answer = ray.get(ray.remote(**resources)(_describe).remote(export, task_options, prepared.batch_api))
    except ray.exceptions.RayError as exc:
        raise RayJobError(f"a Ray worker could not load {export}: {_cause(exc)}") from exc
    if "error" in answer:
        raise RayJobError(f"a Ray worker could not load {export}: {answer['error']}")
    return answer["task"]


def _concurrency(ray: Any, options: RayOptions) -> int:
    if options.concurrency is not None:
        return options.concurrency
    have = ray.cluster_resources()
    if options.gpus:
        return max(1, int(have.get("GPU", 0) // options.gpus))
    return max(1, int(have.get("CPU", 1) // options.cpus))


def _run(ray: Any, prepared: Prepared, options: RayOptions, stream: TextIO) -> RunSummary:
    config = prepared.config
    task_options = _worker_options(prepared, options)
    job = prepared.job(_describe_on_a_worker(ray, prepared, options, task_options))
    shards = prepared.outdir.open(job, config.restart)
    done = {int(s["shard"]) for s in shards}
    resumed = sum(int(s["end"]) - int(s["start"]) for s in shards)
    positions, total = prepared.source.positions(config.window)
    todo = [(k, p) for k, p in enumerate(positions) if k not in done]
    progress = make_progress(prepared, resumed, stream, total)
    t0 = time.monotonic()
    if todo:
        watcher = _ShardWatcher(prepared.outdir, done, progress)
        watcher.start()
        try:
            with _quiet_ray_data(config.progress is False):
                _execute(prepared, options, task_options, todo)
        finally:
            watcher.stop()
    progress.close()
    shards = prepared.outdir.committed(config.window)
    if len(shards) != len(positions):
        raise RayJobError(
            f"Ray Data finished with {len(positions) - len(shards)} windows not committed; rerun to resume"
        )
    tokens = sum(int(s.get("tokens", 0)) for s in shards if int(s["shard"]) not in done)
    return finish(prepared, job, shards, resumed, time.monotonic() - t0, tokens)


def _execute(
    prepared: Prepared, options: RayOptions, task_options: TaskOptions, todo: list[tuple[int, Position]]
) -> None:
    """read → map_batches → write, until every window in ``todo`` is committed."""
    data = require("ray.data", "ray")
    window_source, shard_sink = _classes()
    config = prepared.config
    source = window_source(str(prepared.source.path), prepared.source.options, config.window, todo)
    map_args: dict[str, Any] = {"num_cpus": options.cpus}
    if options.gpus:
        map_args["num_gpus"] = options.gpus
    worker_args = {
        "export": str(prepared.export.resolve()),
        "options": task_options,
        "batch_api": prepared.batch_api,
        "with_id": config.id_column is not None,
        "fmt": prepared.format,
    }
    ds = data.read_datasource(source, num_cpus=0, concurrency=2).map_batches(
        ShardWorker,
        fn_constructor_kwargs=worker_args,
        batch_size=1,  # one window per call: a window is one row
        batch_format="pyarrow",
        compute=data.ActorPoolStrategy(size=_concurrency(require("ray", "ray"), options)),
        **map_args,
    )
    ctx = data.DataContext.get_current()
    before = (ctx.enable_progress_bars, ctx.print_on_execution_start)
    ctx.enable_progress_bars = ctx.print_on_execution_start = False  # ortbatch's own progress is shown
    try:
        ds.write_datasink(shard_sink(str(prepared.outdir.path), prepared.format), ray_remote_args={"num_cpus": 0})
    except OrtBatchError:
        raise
    except Exception as exc:  # Ray Data's errors wrap the worker's; the shards committed so far stay
        raise RayJobError(f"the job failed on Ray: {_cause(exc)}; committed shards are kept: rerun to resume") from exc
    finally:
        ctx.enable_progress_bars, ctx.print_on_execution_start = before


@contextlib.contextmanager
def _quiet_ray_data(quiet: bool) -> Iterator[None]:
    """Ray Data's log lines while the job runs: its notice that its progress bars are off
    (ortbatch shows its own) never, its INFO lines unless ``quiet``."""
    levels = {"ray.data._internal.progress": logging.ERROR}
    if quiet:
        levels["ray.data"] = logging.WARNING
    loggers = {name: logging.getLogger(name) for name in levels}
    before = {name: lg.level for name, lg in loggers.items()}
    for name, lg in loggers.items():
        lg.setLevel(levels[name])
    try:
        yield
    finally:
        for name, lg in loggers.items():
            lg.setLevel(before[name])


def _cause(exc: BaseException) -> str:
    while getattr(exc, "cause", None) is not None:
        exc = exc.cause  # type: ignore[attr-defined]
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:500]


class _ShardWatcher:
    """Feeds the progress display from the shard manifests the sink commits."""

    def __init__(self, outdir: OutputDir, done: set[int], progress: Progress) -> None:
        self.folder = outdir.path / "_shards"
        self.seen = {f"{k:06d}.json" for k in done}
        self.progress = progress
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ortbatch-run-progress", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._poll()

    def _loop(self) -> None:
        while not self._stop.wait(0.5):
            self._poll()

    def _poll(self) -> None:
        for name in sorted(set(os.listdir(self.folder)) - self.seen):
            if name.startswith("."):
                continue
            self.seen.add(name)
            info: ShardInfo = json.loads((self.folder / name).read_text(encoding="utf-8"))
            self.progress.update(int(info["end"]) - int(info["start"]), int(info.get("tokens", 0)), int(info["errors"]))
