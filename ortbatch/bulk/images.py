"""``ortbatch run`` over an image export (the ``image`` model kind's bulk task).

* :func:`image_folder_source`: a folder of image files read as rows (one per file, in name
  order; the row's ``id`` is the file name, its text the file's path), resumable as any source
  (its fingerprint is each file's name, size and modification time). A JSONL/CSV/Parquet file
  (or a folder of them) is read as usual, its text column holding image paths or ``data:``
  URIs.
* :class:`ImageTask`: per row, the image's vector (``embedding``) for an embedding export, or
  its ``label`` and ``scores`` for a classifier. A row whose image cannot be read (not an
  image, truncated, a decompression bomb) fails into the errors file with the reason; the
  other rows of its window are computed.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import OrtBatchError
from .sources import FILE_SUFFIXES, InputError, Position, Row
from .tasks import Field, Outcome, RowFailure, Task, TaskOptions

__all__ = ["IMAGE_SUFFIXES", "ImageFolderSource", "ImageTask", "image_folder_source"]

#: the files a folder of images is made of (what ``ortbatch.vision`` decodes)
IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".webp", ".gif", ".bmp", ".tif", ".tiff"})


def image_folder_source(path: Path, options: Any) -> ImageFolderSource | None:
    """An :class:`ImageFolderSource` when ``path`` is a folder holding image files and no
    JSONL/CSV/Parquet file; None otherwise (the ordinary source reads it)."""
    if not path.is_dir():
        return None
    files = sorted(p for p in path.iterdir() if p.is_file())
    if any(p.suffix.lower() in FILE_SUFFIXES for p in files):
        return None
    images = [p for p in files if p.suffix.lower() in IMAGE_SUFFIXES]
    if not images:
        raise InputError(
            f"input folder {path} holds no image files ({', '.join(sorted(IMAGE_SUFFIXES))}) and no "
            "JSONL/CSV/Parquet file"
        )
    return ImageFolderSource(path, images, options)


class ImageFolderSource:
    """The image files of one folder as rows (what :class:`~.sources.Source` offers ``run``)."""

    batch_api = False

    def __init__(self, path: Path, files: list[Path], options: Any) -> None:
        self.path = path
        self.files = files
        self.options = options

    def fingerprint(self) -> dict[str, Any]:
        listed = []
        for p in self.files:
            st = p.stat()
            listed.append({"name": p.name, "bytes": st.st_size, "mtime_ns": st.st_mtime_ns})
        digest = hashlib.sha256(json.dumps(listed, sort_keys=True).encode()).hexdigest()[:16]
        return {"path": str(self.path.resolve()), "files": listed, "digest": digest}

    def count(self) -> int:
        return len(self.files)

    def _row(self, index: int) -> Row:
        p = self.files[index]
        return Row(index, p.name, str(p))

    def rows(self, start: int = 0) -> Iterator[Row]:
        for i in range(start, len(self.files)):
            yield self._row(i)

    def positions(self, every: int) -> tuple[list[Position], int]:
        return [Position(r, 0, r) for r in range(0, len(self.files), every)], len(self.files)

    def rows_at(self, position: Position, limit: int) -> Iterator[Row]:
        for i in range(position.offset, min(position.offset + limit, len(self.files))):
            yield self._row(i)


class ImageTask(Task):
    """Each row's image (a path or a ``data:`` URI in its text) embedded or classified."""

    def __init__(self, export_dir: Path, options: TaskOptions) -> None:
        from ..vision import ImageClassifier, ImageEmbedder
        from ..vision.embedder import normalize

        self._normalize = normalize
        from ..manifest import Manifest

        vision = Manifest.load(export_dir).extra.get("vision") or {}
        kwargs: dict[str, Any] = {"max_queue": options.max_queue}
        if options.max_batch_size:
            kwargs["max_batch_size"] = options.max_batch_size
        if options.providers is not None:
            kwargs["providers"] = options.providers
        self.model_name = Path(export_dir).resolve().name
        self.classifier = vision.get("labels") is not None
        self.options = options
        face_type: Any = ImageClassifier if self.classifier else ImageEmbedder
        self.face: Any = face_type(export_dir, **kwargs)
        if self.classifier:
            self.labels = self.face.labels
            self.kind = "image-classification"
            self.width = len(self.labels)
        else:
            self.kind = "image-embedding"
            self.width = int(self.face.dimension or 0)

    @property
    def fields(self) -> list[Field]:
        if self.classifier:
            return [Field("label", "string"), Field("scores", "vector", self.width, "float64")]
        return [Field("embedding", "vector", self.width, "float32")]

    def _one(self, source: str) -> np.ndarray:
        if self.classifier:
            return np.asarray(self.face.logits([source]), dtype=np.float64)[0]
        return np.asarray(self.face.embed_images([source]), dtype=np.float32)[0]

    def run(self, rows: Sequence[Row]) -> list[Outcome]:
        good = [r for r in rows if r.error is None]
        results: dict[int, Any] = {}
        sources = [r.text or "" for r in good]
        try:
            computed = self._batch(sources)
            results = {r.index: v for r, v in zip(good, computed, strict=True)}
        except OrtBatchError:
            # one bad image fails the call: compute the window's rows one by one, each failing alone
            for r, src in zip(good, sources, strict=True):
                try:
                    results[r.index] = self._one(src)
                except OrtBatchError as exc:
                    results[r.index] = RowFailure("invalid_image", _reason(exc, r))
        out: list[Outcome] = []
        for r in rows:
            if r.error is not None:
                out.append(RowFailure(*r.error))
                continue
            value = results[r.index]
            out.append(value if isinstance(value, RowFailure) else self._record(value))
        return out

    def _batch(self, sources: list[str]) -> list[np.ndarray]:
        if not sources:
            return []
        if self.classifier:
            return list(np.asarray(self.face.logits(sources), dtype=np.float64))
        return list(np.asarray(self.face.embed_images(sources), dtype=np.float32))

    def _record(self, value: np.ndarray) -> dict[str, Any]:
        if not self.classifier:
            vec = self._normalize(value[None])[0] if self.options.normalize else value
            return {"embedding": vec.astype(np.float32).tolist()}
        e = np.exp(value - value.max())
        probs = e / e.sum()
        return {"label": self.labels.get(int(np.argmax(probs)), str(int(np.argmax(probs)))), "scores": probs.tolist()}

    def close(self) -> None:
        self.face.close()


def _reason(exc: Exception, row: Row) -> str:
    text = str(exc)
    name = os.path.basename(row.text or "") if (row.text or "")[:5].lower() != "data:" else f"row {row.index}"
    return text.replace("image 0", name, 1) if text.startswith("image 0") else text
