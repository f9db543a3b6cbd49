"""A checkpoint's image processor reproduced with numpy and Pillow (no torch, no transformers).

:class:`ImageProcessor` does what the slow (PIL) image processors of transformers do to an RGB
image, step by step and in the same arithmetic, so the pixel values are the same bits:

1. resize with Pillow and the checkpoint's ``resample`` filter: to ``{"height", "width"}``, or
   the shortest edge to ``{"shortest_edge": n}`` with the long edge ``int(n * long / short)``
   (``get_resize_output_image_size``); ConvNeXt below 384 resizes the shortest edge to
   ``int(n / crop_pct)`` and crops ``n x n``, at 384 and above it warps to ``n x n``;
2. center crop (``top = (h - crop_h) // 2``; a crop larger than the image pads with zeros);
3. rescale: ``uint8 -> float64 * rescale_factor -> float32``;
4. normalize in float32: ``(x - mean) / std``;
5. channels first: ``(3, H, W)``.

Classes read from ``preprocessor_config.json`` (``image_processor_type``, or the older
``feature_extractor_type``): CLIP, SigLIP, ViT, DeiT, ConvNeXt, BiT (DINOv2 uses it) and BEiT,
with each class's defaults for keys the file leaves out. A ``...Fast`` type is read as its slow
class: transformers picks the fast one only when torchvision is installed, and it resizes with
torchvision, not Pillow (not what this reproduces).

transformers guesses the channel axis of a numpy image from its shape, so an image 1 or 3
pixels high is taken as channels-first there and processed wrongly; ortbatch never guesses
(its images are PIL RGB).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ManifestError, UnsupportedError

__all__ = ["PROCESSOR_CLASSES", "ImageProcessor", "RESAMPLE_NAMES"]

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
IMAGENET_STANDARD_MEAN = (0.5, 0.5, 0.5)
IMAGENET_STANDARD_STD = (0.5, 0.5, 0.5)

#: PIL's filter numbers (``PILImageResampling``)
RESAMPLE_NAMES = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}

_NEAREST, _BILINEAR, _BICUBIC = 0, 2, 3


@dataclass(frozen=True)
class _Defaults:
    """One transformers class's ``__init__`` defaults, and how it reads a bare int ``size``."""

    size: dict[str, int]
    resample: int
    do_center_crop: bool
    crop_size: dict[str, int] | None
    mean: tuple[float, ...]
    std: tuple[float, ...]
    size_square: bool  # get_size_dict(size, default_to_square=...)
    crop_pct: float | None = None


_CLIP = _Defaults(
    {"shortest_edge": 224}, _BICUBIC, True, {"height": 224, "width": 224}, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, False
)
_IMAGENET = (IMAGENET_STANDARD_MEAN, IMAGENET_STANDARD_STD)

#: transformers class -> its defaults (the slow classes, from their ``__init__``)
PROCESSOR_CLASSES: dict[str, _Defaults] = {
    "CLIPImageProcessor": _CLIP,
    "BitImageProcessor": _CLIP,
    "SiglipImageProcessor": _Defaults({"height": 224, "width": 224}, _BICUBIC, False, None, *_IMAGENET, False),
    "ViTImageProcessor": _Defaults({"height": 224, "width": 224}, _BILINEAR, False, None, *_IMAGENET, True),
    "DeiTImageProcessor": _Defaults(
        {"height": 256, "width": 256}, _BICUBIC, True, {"height": 224, "width": 224}, *_IMAGENET, True
    ),
    "BeitImageProcessor": _Defaults(
        {"height": 256, "width": 256}, _BICUBIC, True, {"height": 224, "width": 224}, *_IMAGENET, True
    ),
    "ConvNextImageProcessor": _Defaults(
        {"shortest_edge": 384}, _BILINEAR, False, None, *_IMAGENET, False, crop_pct=224 / 256
    ),
}
_ALIASES = {
    "CLIPFeatureExtractor": "CLIPImageProcessor",
    "ViTFeatureExtractor": "ViTImageProcessor",
    "DeiTFeatureExtractor": "DeiTImageProcessor",
    "BeitFeatureExtractor": "BeitImageProcessor",
    "ConvNextFeatureExtractor": "ConvNextImageProcessor",
}


def _size_dict(value: Any, square: bool, what: str) -> dict[str, int]:
    """transformers' ``get_size_dict`` for the forms a saved config holds."""
    if isinstance(value, Mapping):
        d = {str(k): v for k, v in value.items() if v is not None}
    elif isinstance(value, int) and not isinstance(value, bool):
        d = {"height": value, "width": value} if square else {"shortest_edge": value}
    elif isinstance(value, (list, tuple)) and len(value) == 2:
        d = {"height": value[0], "width": value[1]}
    else:
        raise ManifestError(f"image processor {what} must be an int, [h, w] or a dict, got {value!r}")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in d.values()):
        raise ManifestError(f"image processor {what} must hold positive integers, got {d}")
    if set(d) not in ({"height", "width"}, {"shortest_edge"}):
        raise UnsupportedError(
            f"image processor {what}={d}: ortbatch reproduces {{'height', 'width'}} and {{'shortest_edge'}} sizes"
        )
    return d


@dataclass(frozen=True)
class ImageProcessor:
    """The steps of one checkpoint's image processor, every value explicit.

    Build it with :meth:`from_config` (a ``preprocessor_config.json`` document) or
    :meth:`from_pretrained` (a directory holding that file); :meth:`to_dict` is what an export's
    manifest records and :meth:`from_dict` reads back."""

    kind: str
    do_resize: bool
    size: dict[str, int]
    resample: int
    do_center_crop: bool
    crop_size: dict[str, int] | None
    do_rescale: bool
    rescale_factor: float
    do_normalize: bool
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    crop_pct: float | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    # -- construction ------------------------------------------------------------------
    @classmethod
    def from_config(cls, doc: Mapping[str, Any], where: str = "preprocessor_config.json") -> ImageProcessor:
        raw = str(doc.get("image_processor_type") or doc.get("feature_extractor_type") or "")
        kind = _ALIASES.get(raw, raw).removesuffix("Fast")
        defaults = PROCESSOR_CLASSES.get(kind)
        if defaults is None:
            raise UnsupportedError(
                f"{where}: image processor {raw or '(no image_processor_type)'!r} is not one ortbatch reproduces; "
                f"supported: {', '.join(sorted(PROCESSOR_CLASSES))}"
            )

        def get(key: str, default: Any) -> Any:
            value = doc.get(key)
            return default if value is None else value

        size = _size_dict(get("size", defaults.size), defaults.size_square, f"{where}: size")
        crop = get("crop_size", defaults.crop_size)
        crop_size = _size_dict(crop, True, f"{where}: crop_size") if crop is not None else None
        do_center_crop = bool(get("do_center_crop", defaults.do_center_crop))
        if kind in ("SiglipImageProcessor", "ViTImageProcessor", "ConvNextImageProcessor"):
            do_center_crop, crop_size = False, None  # these classes have no center-crop step
        resample = int(get("resample", defaults.resample))
        if resample not in RESAMPLE_NAMES:
            raise ManifestError(f"{where}: resample={resample} is not a PIL filter ({RESAMPLE_NAMES})")
        if do_center_crop and crop_size is not None and "height" not in crop_size:
            raise ManifestError(f"{where}: crop_size must be {{'height', 'width'}}, got {crop_size}")
        crop_pct = float(get("crop_pct", defaults.crop_pct)) if kind == "ConvNextImageProcessor" else None
        if kind == "ConvNextImageProcessor" and "shortest_edge" not in size:
            raise ManifestError(f"{where}: ConvNextImageProcessor needs size {{'shortest_edge': n}}, got {size}")
        if kind == "SiglipImageProcessor" and "height" not in size:
            raise ManifestError(f"{where}: SiglipImageProcessor needs size {{'height', 'width'}}, got {size}")
        mean = get("image_mean", defaults.mean)
        std = get("image_std", defaults.std)
        mean = tuple(float(x) for x in (mean if isinstance(mean, (list, tuple)) else [mean] * 3))
        std = tuple(float(x) for x in (std if isinstance(std, (list, tuple)) else [std] * 3))
        if len(mean) != 3 or len(std) != 3 or not all(s != 0 for s in std):
            raise ManifestError(f"{where}: image_mean/image_std must be 3 numbers (std non-zero), got {mean}, {std}")
        return cls(
            kind=kind,
            do_resize=bool(get("do_resize", True)),
            size=size,
            resample=resample,
            do_center_crop=do_center_crop,
            crop_size=crop_size if do_center_crop else None,
            do_rescale=bool(get("do_rescale", True)),
            rescale_factor=float(get("rescale_factor", 1 / 255)),
            do_normalize=bool(get("do_normalize", True)),
            image_mean=mean,
            image_std=std,
            crop_pct=crop_pct,
        )

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike[str]) -> ImageProcessor:
        path = Path(directory) / "preprocessor_config.json"
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ManifestError(
                f"{directory} has no preprocessor_config.json (the checkpoint's image processor)"
            ) from None
        except (OSError, ValueError) as exc:
            raise ManifestError(f"{path} cannot be read as JSON: {exc}") from None
        if not isinstance(doc, dict):
            raise ManifestError(f"{path} is not a JSON object")
        return cls.from_config(doc, where=str(path))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("extra")
        d["image_mean"], d["image_std"] = list(self.image_mean), list(self.image_std)
        return d

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> ImageProcessor:
        try:
            return cls(
                kind=str(doc["kind"]),
                do_resize=bool(doc["do_resize"]),
                size={str(k): int(v) for k, v in doc["size"].items()},
                resample=int(doc["resample"]),
                do_center_crop=bool(doc["do_center_crop"]),
                crop_size={str(k): int(v) for k, v in doc["crop_size"].items()} if doc.get("crop_size") else None,
                do_rescale=bool(doc["do_rescale"]),
                rescale_factor=float(doc["rescale_factor"]),
                do_normalize=bool(doc["do_normalize"]),
                image_mean=tuple(float(x) for x in doc["image_mean"]),
                image_std=tuple(float(x) for x in doc["image_std"]),
                crop_pct=float(doc["crop_pct"]) if doc.get("crop_pct") is not None else None,
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ManifestError(f"the manifest's image processor is malformed ({type(exc).__name__}: {exc})") from None

    # -- geometry ------------------------------------------------------------------------
    def resize_to(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) after the resize step, for an image of that size."""
        if not self.do_resize:
            return height, width
        if self.crop_pct is not None:  # ConvNeXt
            edge = self.size["shortest_edge"]
            if edge >= 384:
                return edge, edge
            return _shortest_edge(height, width, int(edge / self.crop_pct))
        if "shortest_edge" in self.size:
            return _shortest_edge(height, width, self.size["shortest_edge"])
        return self.size["height"], self.size["width"]

    def crop_to(self) -> tuple[int, int] | None:
        if self.crop_pct is not None and self.do_resize and self.size["shortest_edge"] < 384:
            edge = self.size["shortest_edge"]
            return edge, edge
        if self.do_center_crop and self.crop_size is not None:
            return self.crop_size["height"], self.crop_size["width"]
        return None

    def output_size(self, height: int = 512, width: int = 512) -> tuple[int, int]:
        """(height, width) of the pixel values; the same for every image unless the processor
        neither crops nor resizes to a fixed size (then it depends on the image)."""
        crop = self.crop_to()
        return crop if crop is not None else self.resize_to(height, width)

    @property
    def fixed_size(self) -> tuple[int, int] | None:
        """The pixel values' (height, width) when every image gets the same, else ``None``."""
        if self.crop_to() is not None:
            return self.crop_to()
        if self.do_resize and ("height" in self.size or self.crop_pct is not None):
            return self.resize_to(1, 1)
        return None

    # -- the steps -------------------------------------------------------------------------
    def preprocess(self, image: Any) -> np.ndarray:
        """One RGB ``PIL.Image`` -> float32 ``(3, H, W)``."""
        if image.mode != "RGB":
            image = image.convert("RGB")
        if self.do_resize:
            h, w = self.resize_to(image.height, image.width)
            # always through Pillow, as transformers (a same-size resize is a copy there too)
            image = image.resize((w, h), resample=self.resample)
        arr: np.ndarray = np.asarray(image)
        crop = self.crop_to()
        if crop is not None:
            arr = _center_crop(arr, *crop)
        if self.do_rescale:
            # transformers' rescale: upcast to float64, multiply, then down to float32
            arr = (arr.astype(np.float64) * self.rescale_factor).astype(np.float32)
        if self.do_normalize:
            if not np.issubdtype(arr.dtype, np.floating):
                arr = arr.astype(np.float32)
            mean = np.array(self.image_mean, dtype=arr.dtype)
            std = np.array(self.image_std, dtype=arr.dtype)
            arr = (arr - mean) / std
        return np.ascontiguousarray(arr.transpose(2, 0, 1), dtype=np.float32)

    def __call__(self, images: Sequence[Any]) -> np.ndarray:
        """RGB ``PIL.Image`` s -> ``(n, 3, H, W)`` (they must come out the same size)."""
        return np.stack([self.preprocess(im) for im in images]) if len(images) else np.zeros((0, 3, 1, 1), np.float32)

    def describe(self) -> str:
        parts = []
        if self.do_resize:
            filt = RESAMPLE_NAMES[self.resample]
            if self.crop_pct is not None and self.size["shortest_edge"] < 384:
                edge = int(self.size["shortest_edge"] / self.crop_pct)
                parts.append(f"resize shortest edge to {edge} ({filt}, crop_pct {self.crop_pct:g})")
            elif "shortest_edge" in self.size and self.crop_pct is None:
                parts.append(f"resize shortest edge to {self.size['shortest_edge']} ({filt})")
            else:
                h, w = self.resize_to(1, 1)
                parts.append(f"resize to {h}x{w} ({filt})")
        crop = self.crop_to()
        if crop is not None:
            parts.append(f"center crop {crop[0]}x{crop[1]}")
        if self.do_rescale:
            parts.append(f"rescale x{self.rescale_factor:.6g}")
        if self.do_normalize:
            parts.append(
                f"normalize mean {[round(x, 4) for x in self.image_mean]} std {[round(x, 4) for x in self.image_std]}"
            )
        return f"{self.kind}: " + ", ".join(parts)


def _shortest_edge(height: int, width: int, edge: int) -> tuple[int, int]:
    """transformers' ``get_resize_output_image_size(..., default_to_square=False)``."""
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = edge, int(edge * long / short)
    return (new_long, new_short) if width <= height else (new_short, new_long)


def _center_crop(arr: np.ndarray, crop_h: int, crop_w: int) -> np.ndarray:
    """transformers' ``center_crop`` on an (H, W, C) array, zero padding included."""
    h, w = arr.shape[:2]
    top = (h - crop_h) // 2
    left = (w - crop_w) // 2
    if top >= 0 and left >= 0 and top + crop_h <= h and left + crop_w <= w:
        return arr[top : top + crop_h, left : left + crop_w]
    new_h, new_w = max(crop_h, h), max(crop_w, w)
    padded = np.zeros((new_h, new_w, *arr.shape[2:]), dtype=arr.dtype)
    top_pad = -(-(new_h - h) // 2)  # ceil
    left_pad = -(-(new_w - w) // 2)
    padded[top_pad : top_pad + h, left_pad : left_pad + w] = arr
    top += top_pad
    left += left_pad
    return padded[max(0, top) : min(new_h, top + crop_h), max(0, left) : min(new_w, left + crop_w)]
