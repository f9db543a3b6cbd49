"""The image model kind (``image``): an export with a ``vision`` section in its manifest
(CLIP / SigLIP two towers, an image backbone, a ViT-family classifier), served by
:class:`ServedImages` over the in-process faces (:class:`~ortbatch.vision.ImageEmbedder`,
:class:`~ortbatch.vision.ImageClassifier`).

What it serves (docs/vision.md, "Serving"):

* ``POST /v1/embeddings``: images as Infinity takes them (``"modality": "image"`` with
  base64 ``data:`` URIs in ``input``); texts (``"modality": "text"``, the default) through
  a two-tower export's text tower, in the same space; a mixed batch as a list whose items
  are ``{"image": URI}`` or ``{"text": TEXT}``, answered in order. Remote URLs are refused
  (400): ortbatch fetches nothing for a caller.
* ``POST /v1/classify``: a classifier's label distribution per image (the vLLM shape of the
  text classifiers); a two-tower export classifies zero-shot over the request's
  ``labels`` (candidate labels, each wrapped in ``template``, ``"a photo of {}."`` by default).
* KServe v2 (HTTP and gRPC): input ``image`` (BYTES: each element an image file's bytes or a
  ``data:`` URI) or ``pixel_values`` (FP32, already preprocessed); output the image vectors
  (the export's image output) or ``logits``.

Decoding and preprocessing run on the face's thread pool and the wait on a worker thread,
never on the event loop. Declared and registered here (:mod:`ortbatch.serve` imports it); no
transport knows of images.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np

from ..errors import InvalidInputError, SessionClosedError
from . import kinds as _shipped  # noqa: F401 - the encoder and decoder first: their body routes' order stays
from .http.kserve import kserve_routes
from .http.openai_api import read_openai_body
from .http.plumbing import handled_route, json_response, run_or_abandon
from .metrics import ServerMetrics, SessionCollector
from .served.embeddings import embedding_json
from .served.kinds import ExportFacts, ModelKind, register
from .served.protocol import InferRequest

__all__ = ["IMAGE", "MAX_IMAGES_PER_REQUEST", "REQUEST_FIELDS", "ImageKind", "ServedImages", "is_image_export"]

#: images (and texts) one request may carry; more is a 400 naming the limit
MAX_IMAGES_PER_REQUEST = 256
#: the fields each route's JSON body may carry (besides ``model``)
REQUEST_FIELDS: Mapping[str, frozenset[str]] = MappingProxyType(
    {
        "/v1/embeddings": frozenset({"input", "modality", "encoding_format", "user"}),
        "/v1/classify": frozenset({"input", "labels", "template", "user"}),
    }
)
_ENCODINGS = ("float", "base64")
_URL_REFUSAL = (
    "remote image URLs are not fetched: this server fetches nothing for a caller (it has no "
    "--allow-image-urls); send the image as a data:image/...;base64, URI"
)


def is_image_export(export: ExportFacts) -> bool:
    """An export whose manifest has a ``vision`` section (``ortbatch export`` of an image checkpoint)."""
    manifest = export.manifest
    return manifest is not None and isinstance(manifest.extra.get("vision"), dict)


class ServedImages:
    """An image export, served: its face (an embedder or a classifier), its name and version,
    and the KServe v2 model (``metadata``, ``triton_config``, ``infer``) the transports reach."""

    version = "1"

    def __init__(self, face: Any, name: str) -> None:
        from ..vision import ImageEmbedder

        self.face = face
        self.name = name
        self.session = face.session
        self.embedder = isinstance(face, ImageEmbedder)
        self.two_towers = bool(getattr(face, "two_towers", False))
        self.output = face.output if self.embedder else "logits"
        self._closed = False
        self._lock = threading.Lock()
        #: what closes with it besides the face (a front end's stand-in for the engine's session)
        self.also_close: list[Any] = []

    @classmethod
    def load(cls, directory: Path, name: str, **session_kwargs: Any) -> ServedImages:
        from ..vision import ImageClassifier, ImageEmbedder

        vision = ExportFacts.of(directory).manifest.extra["vision"]  # type: ignore[union-attr]
        face_type = ImageClassifier if vision.get("labels") is not None else ImageEmbedder
        return cls(face_type(directory, **session_kwargs), name)

    # -- state ---------------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return not self._closed

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, drain: bool = True) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.face.close()
        for other in self.also_close:
            other.close(drain=drain)

    def _open(self) -> None:
        if self._closed:
            raise SessionClosedError(f"model {self.name!r} is closed")

    # -- what it computes (blocking: called on a worker thread) ------------------------------
    def embed_images(self, images: Sequence[Any]) -> np.ndarray:
        self._open()
        return np.asarray(self.face.embed_images(images), dtype=np.float32)

    def embed_texts(self, texts: Sequence[str]) -> np.ndarray:
        self._open()
        return np.asarray(self.face.embed_texts(texts), dtype=np.float32)

    def classify(self, images: Sequence[Any]) -> np.ndarray:
        """``(n, classes)`` softmax probabilities, in the label ids' order."""
        self._open()
        logits = np.asarray(self.face.logits(images), dtype=np.float64)
        e = np.exp(logits - logits.max(axis=1, keepdims=True))
        return e / e.sum(axis=1, keepdims=True)

    def zero_shot(self, images: Sequence[Any], labels: Sequence[str], template: str) -> np.ndarray:
        self._open()
        return np.asarray(self.face.zero_shot(images, labels, template), dtype=np.float64)

    @property
    def labels(self) -> dict[int, str]:
        return dict(getattr(self.face, "labels", {}) or {})

    @property
    def dimension(self) -> int:
        return int(getattr(self.face, "dimension", 0) or 0) if self.embedder else len(self.labels)

    def pixel_shape(self) -> list[int]:
        fixed = self.face.processor.fixed_size
        return [-1, 3, *(fixed if fixed is not None else (-1, -1))]

    # -- KServe v2 -----------------------------------------------------------------------------
    def metadata(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "versions": [self.version],
            "platform": "onnxruntime_onnx",
            "inputs": [
                {"name": "image", "datatype": "BYTES", "shape": [-1]},
                {"name": "pixel_values", "datatype": "FP32", "shape": self.pixel_shape()},
            ],
            "outputs": [{"name": self.output, "datatype": "FP32", "shape": [-1, self.dimension or -1]}],
        }

    def triton_config(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "platform": "onnxruntime_onnx",
            "backend": "onnxruntime",
            "max_batch_size": getattr(self.session, "max_batch_size", 0),
            "input": [
                {"name": "image", "data_type": "TYPE_STRING", "dims": [1]},
                {"name": "pixel_values", "data_type": "TYPE_FP32", "dims": self.pixel_shape()[1:]},
            ],
            "output": [{"name": self.output, "data_type": "TYPE_FP32", "dims": [self.dimension or -1]}],
            "dynamic_batching": {},
        }

    async def infer(self, req: InferRequest) -> list[tuple[str, np.ndarray]]:
        """Input ``image`` (BYTES) or ``pixel_values`` (FP32), alone; output the vectors or logits."""
        self._open()
        names = set(req.inputs)
        if names not in ({"image"}, {"pixel_values"}):
            raise InvalidInputError(
                f"an image model takes one input, 'image' (BYTES: image files or data: URIs) or 'pixel_values' "
                f"(FP32), got {sorted(names)}"
            )
        for out in req.outputs or ():
            if out.name != self.output:
                raise InvalidInputError(f"unknown output {out.name!r}; this model answers {self.output!r}")
        if "image" in names:
            if req.datatypes["image"] != "BYTES":
                raise InvalidInputError(f"input 'image': expected datatype BYTES, got {req.datatypes['image']}")
            items = [_image_item(v, i) for i, v in enumerate(req.inputs["image"].reshape(-1))]
            _check_count(len(items))
            fn = self.classify_logits if not self.embedder else self.embed_images
            return [(self.output, await asyncio.to_thread(fn, items))]
        pixels = req.inputs["pixel_values"]
        if req.datatypes["pixel_values"] != "FP32":
            raise InvalidInputError(
                f"input 'pixel_values': expected datatype FP32, got {req.datatypes['pixel_values']}"
            )
        want = self.pixel_shape()
        if pixels.ndim != 4 or any(w > 0 and w != s for w, s in zip(want[1:], pixels.shape[1:], strict=True)):
            raise InvalidInputError(f"input 'pixel_values': expected shape {want}, got {list(pixels.shape)}")
        _check_count(pixels.shape[0])
        return [(self.output, await self._run_pixels(np.ascontiguousarray(pixels, dtype=np.float32)))]

    def classify_logits(self, images: Sequence[Any]) -> np.ndarray:
        self._open()
        return np.asarray(self.face.logits(images), dtype=np.float32)

    async def _run_pixels(self, pixels: np.ndarray) -> np.ndarray:
        futures = [
            asyncio.wrap_future(self.session.submit({"pixel_values": pixels[i : i + 1]}, [self.output]))
            for i in range(pixels.shape[0])
        ]
        rows = [r[0] for r in await asyncio.gather(*futures)]
        out = np.concatenate(rows).astype(np.float32) if rows else np.zeros((0, self.dimension), np.float32)
        if self.embedder and self.face.normalized:
            from ..vision import normalize

            out = normalize(out)
        return out


class _Submitting:
    """A front end's stand-in for the engine's session with the one call the faces make,
    ``submit(feed, outputs)`` (one request of ``submit_many``)."""

    def __init__(self, proxy: Any) -> None:
        self._proxy = proxy
        self.max_batch_size = proxy.max_batch_size
        self.max_queue = proxy.max_queue

    def submit(self, feed: Mapping[str, Any], output_names: Sequence[str] | None = None, **kw: Any) -> Any:
        return self._proxy.submit_many([feed], output_names, **kw)[0]

    def stats(self) -> Any:
        return self._proxy.stats()

    def close(self, drain: bool = True) -> None:
        self._proxy.close(drain=drain)


def _check_count(n: int) -> None:
    if n > MAX_IMAGES_PER_REQUEST:
        raise InvalidInputError(
            f"the request carries {n} inputs, over the limit of {MAX_IMAGES_PER_REQUEST} per request "
            "(split it into several requests)",
            input_name="input",
        )
    if n == 0:
        raise InvalidInputError("'input' is empty", input_name="input")


def _image_item(value: Any, index: int) -> Any:
    """One image of a request: a data URI (str) or an image file's bytes; never a path or URL."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        if raw[:5].lower() == b"data:":
            value = raw.decode("ascii", "replace")
        elif raw[:8].lower().startswith((b"http://", b"https://")):
            raise InvalidInputError(f"image {index}: {_URL_REFUSAL}", input_name="input")
        else:
            return raw
    if not isinstance(value, str):
        raise InvalidInputError(f"image {index}: expected a data: URI string, got {type(value).__name__}")
    text = value.strip()
    if text[:7].lower() == "http://" or text[:8].lower() == "https://":
        raise InvalidInputError(f"image {index}: {_URL_REFUSAL}", input_name="input")
    if text[:5].lower() != "data:":
        shown = text if len(text) <= 40 else text[:37] + "..."
        raise InvalidInputError(
            f"image {index}: {shown!r} is not a data: URI (expected data:image/<type>;base64,<data>)",
            input_name="input",
        )
    return text


def _embedding_inputs(doc: Mapping[str, Any], served: ServedImages) -> list[tuple[str, Any]]:
    """``(modality, value)`` of each input, in order."""
    modality = doc.get("modality", "text")
    if modality not in ("text", "image"):
        raise InvalidInputError(f"'modality' must be 'text' or 'image', got {modality!r:.40}", input_name="modality")
    raw = doc.get("input")
    items = [raw] if isinstance(raw, (str, dict)) else raw
    if not isinstance(items, list):
        raise InvalidInputError(
            "'input' must be a string, a list of strings, or a list of {'image': URI} / {'text': TEXT} objects",
            input_name="input",
        )
    _check_count(len(items))
    out: list[tuple[str, Any]] = []
    for i, item in enumerate(items):
        if isinstance(item, dict):
            if len(item) != 1 or next(iter(item)) not in ("image", "text"):
                raise InvalidInputError(
                    f"input {i}: an object item is {{'image': URI}} or {{'text': TEXT}}, got keys {sorted(item)[:4]}",
                    input_name="input",
                )
            ((kind, value),) = item.items()
        elif isinstance(item, str):
            kind, value = modality, item
        else:
            raise InvalidInputError(f"input {i}: expected a string or an object, got {type(item).__name__}")
        if not isinstance(value, str):
            raise InvalidInputError(f"input {i}: the {kind} must be a string, got {type(value).__name__}")
        if kind == "image":
            out.append(("image", _image_item(value, i)))
        else:
            if not served.two_towers:
                raise InvalidInputError(
                    f"input {i} is a text, and model {served.name!r} has no text tower: send images with "
                    '"modality": "image" (data: URIs)',
                    input_name="input",
                )
            out.append(("text", value))
    return out


def _check_fields(doc: Mapping[str, Any], path: str) -> None:
    unknown = set(doc) - {"model", *REQUEST_FIELDS[path]}
    if unknown:
        raise InvalidInputError(f"Unrecognized request argument supplied: {sorted(unknown)[0]}")


def _image_list(doc: Mapping[str, Any]) -> list[Any]:
    raw = doc.get("input")
    items = [raw] if isinstance(raw, str) else raw
    if not isinstance(items, list):
        raise InvalidInputError("'input' must be a data: URI or a list of them", input_name="input")
    _check_count(len(items))
    return [_image_item(v, i) for i, v in enumerate(items)]


async def embeddings_answer(served: ServedImages, doc: Mapping[str, Any]) -> dict[str, Any]:
    """``/v1/embeddings``: each input's vector, in order (images and texts computed at once)."""
    _check_fields(doc, "/v1/embeddings")
    fmt = doc.get("encoding_format", "float")
    if fmt not in _ENCODINGS:
        raise InvalidInputError(f"'encoding_format' must be one of {list(_ENCODINGS)}, got {fmt!r:.40}")
    if not served.embedder:
        raise InvalidInputError(
            f"model {served.name!r} is an image classifier: it serves /v1/classify, not /v1/embeddings",
            input_name="model",
        )
    items = _embedding_inputs(doc, served)
    images = [v for k, v in items if k == "image"]
    texts = [v for k, v in items if k == "text"]
    jobs = []
    if images:
        jobs.append(asyncio.to_thread(served.embed_images, images))
    if texts:
        jobs.append(asyncio.to_thread(served.embed_texts, texts))
    results = list(await asyncio.gather(*jobs))
    image_rows = iter(results.pop(0)) if images else iter(())
    text_rows = iter(results.pop(0)) if texts else iter(())
    data = [
        {
            "object": "embedding",
            "index": i,
            "embedding": embedding_json(next(image_rows) if k == "image" else next(text_rows), fmt),
        }
        for i, (k, _) in enumerate(items)
    ]
    return {"object": "list", "data": data, "model": served.name, "usage": {"prompt_tokens": 0, "total_tokens": 0}}


async def classify_answer(served: ServedImages, doc: Mapping[str, Any]) -> dict[str, Any]:
    """``/v1/classify``: a label distribution per image (zero-shot over ``labels`` on two towers)."""
    import secrets
    import time

    _check_fields(doc, "/v1/classify")
    labels = doc.get("labels")
    template = doc.get("template", "a photo of {}.")
    if served.embedder:
        if not served.two_towers:
            raise InvalidInputError(
                f"model {served.name!r} is an image backbone: it has no labels and no text tower for zero-shot "
                "classification (it serves /v1/embeddings)",
                input_name="model",
            )
        if not isinstance(labels, list) or not labels or not all(isinstance(x, str) and x for x in labels):
            raise InvalidInputError(
                "zero-shot classification needs 'labels': a non-empty list of candidate labels (strings)",
                input_name="labels",
            )
        if len(labels) > MAX_IMAGES_PER_REQUEST:
            raise InvalidInputError(f"'labels' holds {len(labels)} labels, over {MAX_IMAGES_PER_REQUEST}")
        if not isinstance(template, str) or template.count("{}") != 1:
            raise InvalidInputError("'template' must be a string with one '{}' (where each label goes)")
        images = _image_list(doc)
        probs = await asyncio.to_thread(served.zero_shot, images, labels, template)
        names = list(labels)
    else:
        if labels is not None or "template" in doc:
            raise InvalidInputError(
                f"model {served.name!r} is an image classifier with its own labels: 'labels' and 'template' are "
                "for zero-shot classification on a CLIP or SigLIP export",
                input_name="labels",
            )
        images = _image_list(doc)
        probs = await asyncio.to_thread(served.classify, images)
        table = served.labels
        names = [table.get(i, str(i)) for i in range(probs.shape[1])]
    data = [
        {
            "index": i,
            "label": names[int(np.argmax(row))],
            "probs": [float(p) for p in row],
            "num_classes": len(names),
        }
        for i, row in enumerate(probs)
    ]
    return {
        "id": "classify-" + secrets.token_hex(12),
        "object": "list",
        "created": int(time.time()),
        "model": served.name,
        "data": data,
        "usage": {"prompt_tokens": 0, "total_tokens": 0},
    }


def image_routes(served: ServedImages, body: Any) -> list[Any]:
    """``/v1/embeddings`` and ``/v1/classify`` of an image export."""

    async def embeddings(request: Any) -> Any:
        doc = await read_openai_body(request, body, served.name)
        answer = await run_or_abandon(request.receive, embeddings_answer(served, doc))
        return json_response(answer)

    async def classify(request: Any) -> Any:
        doc = await read_openai_body(request, body, served.name)
        answer = await run_or_abandon(request.receive, classify_answer(served, doc))
        return json_response(answer)

    return [handled_route("/v1/embeddings", embeddings, "POST"), handled_route("/v1/classify", classify, "POST")]


class ImageKind(ModelKind):
    """An image export (CLIP/SigLIP two towers, backbone, classifier) over its face's BatchedSession."""

    name = "image"
    description = "an image export"
    served_type = ServedImages
    body_routes = MappingProxyType({"/v1/embeddings": "embeddings", "/v1/classify": "classify"})
    #: ``ortbatch run``: ``bulk.images.ImageTask``, over a folder of images or a column of paths
    bulk_task = "image"

    def recognises(self, export: ExportFacts) -> bool:
        return is_image_export(export)

    def load(
        self, directory: Path, name: str | None, config: Any, session_options: Callable[[bool], Any] | None = None
    ) -> ServedImages:
        kw = config.session_kwargs()
        # the face's sessions (image and text tower) are warmed by warm_up below: BatchedSession's
        # own warm-up sizes a text tower's input by its tokenizer, past CLIP's position table
        kw["warmup"] = False
        if session_options is not None:
            kw["session_options"] = session_options(False)
        return ServedImages.load(directory, name or getattr(config, "name", None) or directory.resolve().name, **kw)

    def warm_up(self, served: ServedImages) -> None:
        fixed = served.face.processor.fixed_size or served.face.processor.output_size()
        served.session.run(None, {"pixel_values": np.zeros((1, 3, *fixed), np.float32)})

    def endpoints(self, served: ServedImages) -> dict[str, str]:
        embeddings = "" if served.embedder else f"model {served.name!r} is an image classifier: use /v1/classify"
        classify = (
            ""
            if not served.embedder or served.two_towers
            else f"model {served.name!r} is an image backbone: no labels and no text tower"
        )
        return {"embeddings": embeddings, "classify": classify}

    def summary(self, served: ServedImages) -> str:
        if not served.embedder:
            return f"images: /v1/classify ({len(served.labels)} labels)"
        texts = ", texts through the text tower, zero-shot /v1/classify" if served.two_towers else ""
        return f"images: /v1/embeddings{texts}"

    def kserve_metadata(self, served: ServedImages, entries: Any) -> dict[str, Any]:
        return {served.name: served.metadata()}

    def request_fields(self, served: ServedImages) -> Mapping[str, frozenset[str]]:
        return dict(REQUEST_FIELDS)

    def http_routes(self, served: ServedImages, body: Any) -> list[Any]:
        model: Any = served  # the v2 routes read metadata(), triton_config(), ready and infer() of it
        return [*kserve_routes(model, body), *image_routes(served, body)]

    def operations(self) -> Mapping[tuple[str, str], Any]:
        """How an image export's own ``/openapi.json`` describes its two body routes (a
        repository's document keeps the shared ones)."""
        from .http.openapi_schemas import Operation

        uri = "data:image/png;base64,iVBORw0KGgo..."
        return {
            ("POST", "/v1/embeddings"): Operation(
                "Embeddings of images and texts (OpenAI, Infinity's modality)",
                "OpenAI",
                "ImageEmbeddingRequest",
                "EmbeddingResponse",
                {"input": [uri], "modality": "image", "model": "{model}"},
                description="Images as data: URIs with modality image; texts through a CLIP/SigLIP text tower; a "
                "mixed list of {image: URI} / {text: TEXT} objects, answered in order. Remote URLs are refused.",
            ),
            ("POST", "/v1/classify"): Operation(
                "Classify images (a classifier's labels, or zero-shot over candidate labels)",
                "Tasks (rerank, classify, tokenize)",
                "ImageClassifyRequest",
                "ClassifyResponse",
                {"input": [uri], "model": "{model}"},
            ),
        }

    def schemas(self) -> Mapping[str, Any]:
        text = {"type": "string"}
        item = {
            "oneOf": [
                text,
                {"type": "object", "properties": {"image": text}, "required": ["image"], "additionalProperties": False},
                {"type": "object", "properties": {"text": text}, "required": ["text"], "additionalProperties": False},
            ]
        }
        many = {"type": "array", "maxItems": MAX_IMAGES_PER_REQUEST, "minItems": 1}
        return {
            "ImageEmbeddingRequest": {
                "type": "object",
                "properties": {
                    "input": {"oneOf": [item, {**many, "items": item}]},
                    "model": text,
                    "modality": {"type": "string", "enum": ["text", "image"], "default": "text"},
                    "encoding_format": {"type": "string", "enum": list(_ENCODINGS), "default": "float"},
                    "user": text,
                },
                "required": ["input"],
                "additionalProperties": False,
            },
            "ImageClassifyRequest": {
                "type": "object",
                "properties": {
                    "input": {"oneOf": [text, {**many, "items": text}], "description": "data: URIs of images"},
                    "model": text,
                    "labels": {
                        "type": "array",
                        "items": text,
                        "minItems": 1,
                        "description": "candidate labels (zero-shot, CLIP/SigLIP exports only)",
                    },
                    "template": {"type": "string", "default": "a photo of {}."},
                    "user": text,
                },
                "required": ["input"],
                "additionalProperties": False,
            },
        }

    def metrics(self, served: ServedImages) -> ServerMetrics:
        return ServerMetrics(served.session.stats)

    def collector(self, served: ServedImages) -> Any:
        return SessionCollector(served.session.stats)

    def openapi_refusal(self, served: Any, method: str, path: str, endpoints: Mapping[str, str]) -> str:
        if path in self.body_routes:
            return endpoints.get(self.body_routes[path], "")
        return super().openapi_refusal(served, method, path, endpoints)

    def engine_side(self, served: ServedImages) -> tuple[Any, Any]:
        from .frontends.proxy import SessionInfo

        return served.session, SessionInfo.of(served.session)

    def front_end_view(self, link: Any, key: int, info: Any, directory: Path, name: str, config: Any) -> ServedImages:
        """The image graph's requests go to the engine's session; decoding and preprocessing
        run in the front end (its own thread pool); a two-tower export's text tower opens in
        the front end on its first text."""
        from ..vision import ImageClassifier, ImageEmbedder

        proxy = link.for_model(key, info)
        vision = ExportFacts.of(directory).manifest.extra["vision"]  # type: ignore[union-attr]
        face_type: Any = ImageClassifier if vision.get("labels") is not None else ImageEmbedder
        served = ServedImages(face_type(directory, session=_Submitting(proxy)), name)
        served.also_close.append(proxy)
        return served


#: registered after the encoder and decoder: its routes are theirs (no new path), so what
#: those kinds mount and document is unchanged
IMAGE = register(ImageKind())
