"""In-process faces of an image export: :class:`ImageEmbedder` and :class:`ImageClassifier`.

Images (bytes, files, ``data:`` URIs, PIL images) are decoded and preprocessed on a thread pool
(:func:`~ortbatch.vision.load_image` and :class:`~ortbatch.vision.ImageProcessor`: Pillow and
numpy release the GIL for the heavy parts), off the callers' threads and off the session's
workers; each image is then its own request to a :class:`~ortbatch.BatchedSession`, so images
from many threads share batches. A two-tower export (CLIP, SigLIP) embeds texts too, through its
text tower, into the same space; its zero-shot classification is the checkpoint's own
(``logit_scale * cosine (+ logit_bias)``, softmax for CLIP, sigmoid for SigLIP).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InvalidInputError, ManifestError, UnsupportedError
from ..manifest import Manifest
from .images import ImageLimits, load_image
from .processor import ImageProcessor
from .text import TextTower

__all__ = ["ImageClassifier", "ImageEmbedder", "normalize", "section_digest"]


def section_digest(vision: Any) -> str:
    """sha256 of a manifest's ``vision`` section (canonical JSON), recorded by the exporter."""
    import hashlib
    import json

    return hashlib.sha256(json.dumps(vision, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _verify_section(manifest: Manifest, vision: Any) -> None:
    """The preprocessing and towers the export was checked with: an edit of the ``vision``
    section would answer with other pixels, silently. Refused unless verification is skipped
    (``ORTBATCH_SKIP_VERIFY=1``), as the manifest's own contract."""
    from ..manifest import SKIP_VERIFY_ENV

    if os.environ.get(SKIP_VERIFY_ENV, "").strip().lower() not in ("", "0", "false", "no"):
        return
    comps = manifest.extra.get("components") or {}
    recorded = next((c.get("vision") for c in comps.values() if isinstance(c, dict) and c.get("vision")), None)
    if recorded is not None and recorded != section_digest(vision):
        from ..errors import ModelIntegrityError

        raise ModelIntegrityError(
            f"{manifest.directory}: the manifest's 'vision' section (preprocessing, towers) was edited after the "
            f"export and its checks; re-export it, or set {SKIP_VERIFY_ENV}=1 to load it anyway",
            path=manifest.directory,
        )


def normalize(vectors: np.ndarray) -> np.ndarray:
    """Rows scaled to unit length (sentence-transformers' Normalize; a zero row stays zero)."""
    v = np.asarray(vectors, dtype=np.float32)
    norms = np.linalg.norm(v, axis=-1, keepdims=True)
    return np.asarray(v / np.maximum(norms, 1e-12), dtype=np.float32)


class _ImageFace:
    """What both faces share: the manifest's image processor, the image graph's session and
    the preprocessing pool."""

    def __init__(
        self,
        export_dir: str | os.PathLike[str],
        *,
        limits: ImageLimits | None = None,
        exif_transpose: bool | None = None,
        preprocess_threads: int | None = None,
        session: Any = None,
        **session_kwargs: Any,
    ) -> None:
        self.directory = Path(export_dir)
        self.manifest = Manifest.load(self.directory).verify()
        vision = self.manifest.extra.get("vision")
        if not isinstance(vision, dict) or "processor" not in vision:
            raise ManifestError(
                f"{self.directory} is not an image export (ortbatch.json has no 'vision' section); export an image "
                "checkpoint with `ortbatch export`"
            )
        _verify_section(self.manifest, vision)
        self.vision = vision
        self.processor = ImageProcessor.from_dict(vision["processor"])
        self.limits = limits or ImageLimits()
        # None: bytes, files and data URIs transposed (transformers' load_image), PIL images as given
        self.exif_transpose = exif_transpose
        self._sessions: list[Any] = []
        self._session_kwargs = dict(session_kwargs)  # the text tower's session gets them too
        if session is None:
            from ..runtime.session import BatchedSession

            session = BatchedSession(self.directory, **session_kwargs)
            self._sessions.append(session)
        self.session = session
        threads = preprocess_threads or min(4, os.cpu_count() or 1)
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ortbatch-vision")

    def pixel_values(self, images: Sequence[Any]) -> np.ndarray:
        """``(n, 3, H, W)`` float32: the images decoded and preprocessed (on the pool)."""
        futures = [self._pool.submit(self._prepare, im, i) for i, im in enumerate(_listed(images))]
        rows = [f.result() for f in futures]
        return np.concatenate(rows) if rows else np.zeros((0, 3, *self.processor.output_size()), np.float32)

    def _prepare(self, image: Any, index: int) -> np.ndarray:
        decoded = load_image(image, self.limits, exif_transpose=self.exif_transpose, where=f"image {index}")
        return self.processor.preprocess(decoded)[None]

    def _run_images(self, images: Sequence[Any], output: str) -> np.ndarray:
        """Each image decoded on the pool, then its own request to the session: the order of
        the answer is the order of ``images``. A long list goes a window at a time, so one
        call never holds more than a window of decoded images nor fills the session's queue."""
        items = _listed(images)
        window = _window(self.session)
        parts = [self._run_window(items[s : s + window], s, output) for s in range(0, len(items), window)]
        return np.concatenate(parts) if parts else np.zeros((0, 0), np.float32)

    def _run_window(self, items: Sequence[Any], first: int, output: str) -> np.ndarray:
        done: list[Future[Any]] = []
        for i, image in enumerate(items, start=first):
            result: Future[Any] = Future()
            prepared = self._pool.submit(self._prepare, image, i)
            prepared.add_done_callback(functools.partial(self._submit, result=result, output=output))
            done.append(result)
        rows = []
        error: BaseException | None = None
        for fut in done:
            try:
                rows.append(fut.result())
            except BaseException as exc:  # every future is waited for before the first error is raised
                error = error or exc
        if error is not None:
            raise error
        return np.concatenate(rows) if rows else np.zeros((0, 0), np.float32)

    def _submit(self, prepared: Future[Any], *, result: Future[Any], output: str) -> None:
        try:
            pixels = prepared.result()
            inner = self.session.submit({"pixel_values": pixels}, [output])
        except BaseException as exc:
            result.set_exception(exc)
            return

        def settle(f: Future[Any]) -> None:
            try:
                result.set_result(f.result()[0])
            except BaseException as exc:
                result.set_exception(exc)

        inner.add_done_callback(settle)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for s in self._sessions:
            s.close()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _window(session: Any) -> int:
    """How many requests one call keeps queued at once: a few batches' worth, within the
    session's queue (other callers' requests may still fill it: then QueueFullError, the
    overload answer)."""
    batch = int(getattr(session, "max_batch_size", 16) or 16)
    return max(1, min(4 * batch, int(getattr(session, "max_queue", 1024) or 1024)))


def _listed(images: Any) -> list[Any]:
    if isinstance(images, (str, bytes, bytearray, os.PathLike)) or hasattr(images, "getpixel"):
        return [images]  # one image given alone
    try:
        return list(images)
    except TypeError:
        raise InvalidInputError(f"expected an image or a sequence of images, got {type(images).__name__}") from None


class ImageEmbedder(_ImageFace):
    """Image vectors of an image export; texts too for a two-tower (CLIP, SigLIP) export.

    ``ImageEmbedder(export_dir)`` opens its sessions (keyword arguments go to
    :class:`~ortbatch.BatchedSession`); ``limits`` bound what an image may be; thread-safe."""

    def __init__(self, export_dir: str | os.PathLike[str], **kwargs: Any) -> None:
        super().__init__(export_dir, **kwargs)
        towers = self.vision.get("towers")
        self.two_towers = isinstance(towers, dict)
        if isinstance(towers, dict):
            self.output = str(towers["image"]["output"])
        elif self.vision.get("embedding_output"):
            self.output = str(self.vision["embedding_output"])
        else:
            raise ManifestError(f"{self.directory} is an image classifier: use ImageClassifier")
        self.text_session: Any = None
        self._tower: Any = None

    @property
    def normalized(self) -> bool:
        return bool(self.vision.get("normalize"))

    def embed_images(self, images: Sequence[Any]) -> np.ndarray:
        """``(n, dim)`` float32, one row per image, in order (a backbone's ``pooler_output``)."""
        vectors = self._run_images(images, self.output)
        return normalize(vectors) if self.normalized else vectors.astype(np.float32, copy=False)

    # -- texts (two towers) --------------------------------------------------------------
    def _text(self) -> tuple[TextTower, Any]:
        if not self.two_towers:
            raise UnsupportedError(
                f"{self.directory} has no text tower (it is a {self.vision.get('model_type')} model)"
            )
        if self.text_session is None:
            from ..runtime.session import BatchedSession

            tower = TextTower(self.directory, self.vision["towers"]["text"])
            tower.tokenizer  # noqa: B018 - a missing tokenizer.json fails here, before a session opens
            kwargs = {"max_batch_size": self.manifest.max_batch_size or 64, **self._session_kwargs}
            session = BatchedSession(
                self.directory / tower.model,
                pad_values={"input_ids": tower.pad_id, **({"attention_mask": 0} if tower.mask else {})},
                padding_side="right",
                **kwargs,
            )
            self._sessions.append(session)
            self._tower, self.text_session = tower, session
        return self._tower, self.text_session

    def embed_texts(self, texts: Sequence[str]) -> np.ndarray:
        """``(n, dim)``: the text tower's vectors, in the images' space; each text its own request."""
        if isinstance(texts, str):
            texts = [texts]
        tower, session = self._text()
        ids = tower.ids(texts)
        rows: list[np.ndarray] = []
        step = _window(session)
        for s in range(0, len(ids), step):
            futures = [session.submit(tower.feed([row]), [tower.output]) for row in ids[s : s + step]]
            rows += [f.result()[0] for f in futures]
        vectors = np.concatenate(rows).astype(np.float32) if rows else np.zeros((0, self.dimension), np.float32)
        return normalize(vectors) if self.normalized else vectors

    @property
    def dimension(self) -> int:
        return int(self.vision.get("dimension") or 0)

    def zero_shot(self, images: Sequence[Any], labels: Sequence[str], template: str = "a photo of {}.") -> np.ndarray:
        """``(n_images, n_labels)`` probabilities of each label, as the checkpoint scores them:
        ``logit_scale * cosine (+ logit_bias)``, then softmax over the labels (CLIP) or a sigmoid
        each (SigLIP). ``template`` wraps each label (``"{}"``: the labels as they are)."""
        if not labels:
            raise InvalidInputError("zero-shot classification needs at least one candidate label")
        img = normalize(self.embed_images(images))
        txt = normalize(self.embed_texts([template.format(label) for label in labels]))
        logits = float(self.vision["logit_scale"]) * (img @ txt.T)
        if self.vision.get("logit_bias") is not None:
            logits = logits + float(self.vision["logit_bias"])
        if self.vision.get("activation") == "sigmoid":
            return np.asarray(1.0 / (1.0 + np.exp(-logits)), dtype=np.float32)
        e = np.exp(logits - logits.max(axis=1, keepdims=True))
        return np.asarray(e / e.sum(axis=1, keepdims=True), dtype=np.float32)


class ImageClassifier(_ImageFace):
    """Labels of an ``image-classification`` export: ``logits`` and ``classify``."""

    def __init__(self, export_dir: str | os.PathLike[str], **kwargs: Any) -> None:
        super().__init__(export_dir, **kwargs)
        labels = self.vision.get("labels")
        if labels is None:
            raise ManifestError(f"{self.directory} is not an image-classification export")
        self.labels = {int(k): str(v) for k, v in labels.items()}

    def logits(self, images: Sequence[Any]) -> np.ndarray:
        return self._run_images(images, "logits")

    def classify(self, images: Sequence[Any], top_k: int = 5) -> list[list[dict[str, Any]]]:
        """Per image, the ``top_k`` labels with their softmax scores, best first (as
        transformers' image-classification pipeline answers)."""
        if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1:
            raise InvalidInputError(f"top_k must be a positive integer, got {top_k!r}")
        logits = self.logits(images).astype(np.float64)
        e = np.exp(logits - logits.max(axis=1, keepdims=True))
        probs = e / e.sum(axis=1, keepdims=True)
        out = []
        for row in probs:
            order = np.argsort(-row, kind="stable")[:top_k]
            out.append([{"label": self.labels.get(int(i), str(int(i))), "score": float(row[i])} for i in order])
        return out
