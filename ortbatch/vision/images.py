"""Images in: bytes, files, ``data:`` URIs and PIL images decoded safely, as transformers loads them.

What transformers does, read from the installed library (``transformers.image_utils.load_image``
and the image processors' ``preprocess``), and what ortbatch does the same way:

* a **path, bytes or base64/data URI** goes through ``load_image``: ``PIL.Image.open``, then
  ``ImageOps.exif_transpose`` (the EXIF orientation is applied: a phone photo stored sideways
  comes out upright), then ``convert("RGB")``. ortbatch does exactly that.
* a **PIL image** handed to an image processor is *not* transposed (the processors call only
  ``convert_to_rgb``); transformers' pipelines call ``load_image`` on it first and so do
  transpose it. ortbatch follows the processor: a PIL image is taken as it is, unless
  ``exif_transpose=True`` is asked for (what a pipeline does).
* every image becomes RGB with Pillow's ``convert("RGB")`` (RGBA/LA drop alpha, P/PA through
  the palette, CMYK, L, I;16 as Pillow converts them). Processors without ``do_convert_rgb``
  (DeiT, ConvNeXt, BEiT) fail on a non-RGB PIL image in transformers; ortbatch converts it, as
  their pipelines' ``load_image`` does.

Hostile inputs are refused before they cost memory, each with an
:class:`~ortbatch.errors.InvalidInputError` naming the limit (:class:`ImageLimits`):
more encoded bytes than ``max_bytes``; a header announcing more pixels than ``max_pixels``
(checked before any pixel is decoded: decompression bombs) or a side longer than
``max_side`` or a ratio of sides beyond ``max_aspect_ratio`` (a 1x100000 strip would be resized
to 224 x 22,400,000); a format outside ``formats`` (SVG and other non-images, and formats whose
Pillow plugins run outside programs, such as EPS); truncated or corrupt files; bad base64.
Remote URLs are never fetched here.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import InvalidInputError, RequestTooLargeError

__all__ = ["DEFAULT_FORMATS", "ImageLimits", "ImageSource", "load_image", "load_images", "pil"]

#: what ``load_image`` decodes by default: the formats photos and screenshots come in. EPS (a
#: Ghostscript subprocess), PDF, SVG (not raster: Pillow cannot read it) and the rest are refused.
DEFAULT_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")  # JPEG covers MPO (phone photos)

ImageSource = Any  # bytes | bytearray | memoryview | str | os.PathLike | PIL.Image.Image


def pil() -> Any:
    """``PIL.Image``, or an ImportError naming the ``vision`` extra."""
    from .._extras import require

    return require("PIL.Image", "vision")


@dataclass(frozen=True)
class ImageLimits:
    """What one image may be. ``max_pixels`` defaults to Pillow's own ``MAX_IMAGE_PIXELS``
    (89,478,485, about 268 MB decoded as RGB) when left at ``None``."""

    max_bytes: int = 20 * 1024 * 1024
    max_pixels: int | None = None
    max_side: int = 20_000
    max_aspect_ratio: float = 100.0
    formats: tuple[str, ...] = DEFAULT_FORMATS

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_side"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ImageLimits.{name} must be a positive integer, got {value!r}")
        if self.max_pixels is not None and (not isinstance(self.max_pixels, int) or self.max_pixels < 1):
            raise ValueError(f"ImageLimits.max_pixels must be a positive integer or None, got {self.max_pixels!r}")
        if not (self.max_aspect_ratio >= 1.0):  # also refuses NaN
            raise ValueError(f"ImageLimits.max_aspect_ratio must be at least 1, got {self.max_aspect_ratio!r}")

    def pixel_limit(self) -> tuple[int, str]:
        if self.max_pixels is not None:
            return self.max_pixels, "max_pixels"
        return int(pil().MAX_IMAGE_PIXELS or 89_478_485), "max_pixels, Pillow's MAX_IMAGE_PIXELS"

    def check_size(self, width: int, height: int, where: str) -> None:
        """Refuse dimensions over the limits (read from the header, before decoding)."""
        limit, named = self.pixel_limit()
        if width < 1 or height < 1:
            raise InvalidInputError(f"{where}: the image is {width}x{height}: it has no pixels")
        if width * height > limit:
            raise InvalidInputError(
                f"{where}: the image is {width}x{height} = {width * height:,} pixels, over the limit of "
                f"{limit:,} ({named}): a decompression bomb or an image too large to serve"
            )
        if max(width, height) > self.max_side:
            raise InvalidInputError(
                f"{where}: the image is {width}x{height}; its longest side is over the limit of "
                f"{self.max_side:,} pixels (max_side)"
            )
        ratio = max(width, height) / min(width, height)
        if ratio > self.max_aspect_ratio:
            raise InvalidInputError(
                f"{where}: the image is {width}x{height}, a {ratio:,.0f}:1 strip, over the limit of "
                f"{self.max_aspect_ratio:g}:1 (max_aspect_ratio): resized to the model's input it would not fit "
                "in memory"
            )


_DATA_URI = re.compile(r"^data:(?P<type>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[\w.+-]+)*)(?P<b64>;base64)?,", re.I)


def _data_uri(text: str, limits: ImageLimits) -> bytes:
    m = _DATA_URI.match(text)
    if m is None:
        raise InvalidInputError("the image is not a valid data URI (expected data:image/<type>;base64,<data>)")
    kind = (m.group("type") or "").lower()
    if kind and not kind.startswith("image/"):
        raise InvalidInputError(f"the data URI's media type is {kind!r}, not an image/* type")
    if not m.group("b64"):
        raise InvalidInputError("the image data URI is not base64 (expected data:image/<type>;base64,<data>)")
    payload = text[m.end() :]
    # base64 is 4 characters for 3 bytes: refuse before decoding what would be too large
    if len(payload) // 4 * 3 > limits.max_bytes:
        raise RequestTooLargeError(
            f"the image data URI holds about {len(payload) // 4 * 3:,} bytes, over the limit of "
            f"{limits.max_bytes:,} bytes (max_bytes)"
        )
    try:
        return base64.b64decode(payload.strip(), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidInputError(f"the image data URI's base64 does not decode: {exc}") from None


def _read_file(path: Path, limits: ImageLimits) -> bytes:
    try:
        size = path.stat().st_size
        if size > limits.max_bytes:
            raise RequestTooLargeError(
                f"{path}: {size:,} bytes, over the limit of {limits.max_bytes:,} bytes (max_bytes)"
            )
        return path.read_bytes()
    except OSError as exc:
        raise InvalidInputError(f"cannot read the image file {path}: {exc.strerror or exc}") from None


def _decode(data: bytes, limits: ImageLimits, where: str, exif_transpose: bool) -> Any:
    Image = pil()
    from PIL import ImageOps, UnidentifiedImageError

    if len(data) > limits.max_bytes:
        raise RequestTooLargeError(f"{where}: {len(data):,} bytes, over the limit of {limits.max_bytes:,} (max_bytes)")
    if not data:
        raise InvalidInputError(f"{where}: the image is empty (0 bytes)")
    try:
        with warnings.catch_warnings():
            # Pillow warns above MAX_IMAGE_PIXELS and raises above twice that: both are refused
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=list(limits.formats))
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise InvalidInputError(f"{where}: refused as a decompression bomb ({exc})") from None
    except UnidentifiedImageError:
        head = data[:64].lstrip().lower()
        hint = " (an SVG: a vector drawing, not a raster image)" if head.startswith((b"<svg", b"<?xml")) else ""
        raise InvalidInputError(
            f"{where}: not an image ortbatch decodes{hint}; accepted formats: {', '.join(limits.formats)}"
        ) from None
    except (OSError, SyntaxError, ValueError) as exc:
        raise InvalidInputError(f"{where}: the image cannot be read: {exc}") from None
    limits.check_size(image.width, image.height, where)
    try:
        image.load()  # decodes every pixel: a truncated or corrupt file fails here
        if exif_transpose:
            image = ImageOps.exif_transpose(image)
        return _to_rgb(image, where)
    except InvalidInputError:
        raise
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        raise InvalidInputError(f"{where}: the image is truncated or corrupt: {exc}") from None


def _to_rgb(image: Any, where: str) -> Any:
    if image.mode == "RGB":
        return image
    try:
        return image.convert("RGB")
    except (ValueError, OSError) as exc:
        raise InvalidInputError(f"{where}: an image of mode {image.mode} cannot be converted to RGB: {exc}") from None


def load_image(
    source: ImageSource,
    limits: ImageLimits | None = None,
    *,
    exif_transpose: bool | None = None,
    where: str = "image",
) -> Any:
    """One image as an RGB ``PIL.Image``, decoded as transformers' ``load_image`` decodes it.

    ``source``: ``bytes`` (the file's contents), a path (``str`` or ``os.PathLike``), a
    ``data:image/...;base64,`` URI, or a ``PIL.Image.Image``. ``exif_transpose``: ``None``
    applies the EXIF orientation to decoded bytes and files (``load_image``) and not to a
    PIL image (an image processor's call); ``True``/``False`` force it either way.
    http(s) URLs are refused: nothing is fetched from here.
    """
    limits = limits or ImageLimits()
    Image = pil()
    if isinstance(source, Image.Image):
        limits.check_size(source.width, source.height, where)
        image = source
        if exif_transpose:
            from PIL import ImageOps

            image = ImageOps.exif_transpose(image)
        return _to_rgb(image, where)
    transpose = True if exif_transpose is None else exif_transpose
    if isinstance(source, (bytes, bytearray, memoryview)):
        return _decode(bytes(source), limits, where, transpose)
    if isinstance(source, str):
        text = source.strip()
        if text[:5].lower() == "data:":
            return _decode(_data_uri(text, limits), limits, where, transpose)
        if text[:7].lower() == "http://" or text[:8].lower() == "https://":
            raise InvalidInputError(
                f"{where}: remote URLs are not fetched (send the image's bytes or a data: URI instead)"
            )
        path = Path(source)
    elif isinstance(source, os.PathLike):
        path = Path(source)
    else:
        raise InvalidInputError(
            f"{where}: expected bytes, a file path, a data: URI or a PIL image, got {type(source).__name__}"
        )
    if not path.is_file():
        shown = str(source) if len(str(source)) <= 80 else str(source)[:77] + "..."
        raise InvalidInputError(f"{where}: {shown!r} is not a file, a data: URI or an image")
    return _decode(_read_file(path, limits), limits, f"{where} {path.name}", transpose)


def load_images(
    sources: Sequence[ImageSource], limits: ImageLimits | None = None, *, exif_transpose: bool | None = None
) -> list[Any]:
    """:func:`load_image` for each; the error names the image's index."""
    return [load_image(s, limits, exif_transpose=exif_transpose, where=f"image {i}") for i, s in enumerate(sources)]
