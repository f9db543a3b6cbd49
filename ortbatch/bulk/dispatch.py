"""Which task ``ortbatch run`` computes for an export, and which source a kind reads beside the
ordinary one: read from the export's model kind (``ortbatch.serve.served.kinds``).

bulk computes the shipped kinds' tasks: serve's declarations name them (``ModelKind.bulk_task``)
and serve never imports bulk; a kind that is not ortbatch's brings its own task
(``ModelKind.make_bulk_task``) and source (``ModelKind.bulk_source``) by registration alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import UnsupportedModelError
from .sources import SourceOptions
from .tasks import GenerationTask, Task, TaskOptions, encoder_task, export_kind

__all__ = ["BULK_TASKS", "kind_source", "task_for"]


def _image_task(export_dir: Path, options: TaskOptions) -> Task:
    from .images import ImageTask  # Pillow and the image faces: only for an image export

    return ImageTask(export_dir, options)


#: a model kind's ``bulk_task`` -> the task computing it
BULK_TASKS: dict[str, Any] = {
    "encoder": encoder_task,
    "generation": lambda p, o: GenerationTask(p, o),
    "image": _image_task,
}


def task_for(export_dir: str | Path, options: TaskOptions) -> Task:
    """The :class:`~ortbatch.bulk.tasks.Task` the export's model kind asks for (its own, else
    the one its ``bulk_task`` names)."""
    path = Path(export_dir)
    kind = export_kind(path)
    own = kind.make_bulk_task(path, options)
    if own is not None:
        return own
    make = BULK_TASKS.get(kind.bulk_task)
    if make is None:
        raise UnsupportedModelError(f"`ortbatch run` does not compute {kind.description} ({path}) yet")
    return make(path, options)


def kind_source(kind: Any, path: Path, options: SourceOptions, batch_rows: int) -> Any:
    """The source a kind reads beside the ordinary one (an image task: a folder of image files);
    None: the ordinary :class:`~ortbatch.bulk.sources.Source`."""
    own = kind.bulk_source(path, options, batch_rows)
    if own is not None:
        return own
    if kind.bulk_task == "image":
        from .images import image_folder_source

        return image_folder_source(path, options)
    return None
