"""Hostile and malformed images: each refused with an InvalidInputError that names the limit or
the fault, before it costs memory; nothing here needs torch."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import pytest

pytest.importorskip("PIL")

from ortbatch.errors import InvalidInputError, RequestTooLargeError
from ortbatch.vision import ImageLimits, load_image, load_images
from tests.vision.pictures import drawing, encode


def _png(width: int = 64, height: int = 48) -> bytes:
    return encode(drawing(width, height, 1).convert("RGBA"))


def _jpeg(width: int = 64, height: int = 48) -> bytes:
    return encode(drawing(width, height, 2))


def _claiming(width: int, height: int) -> bytes:
    """A small PNG whose header (IHDR, CRC fixed) announces ``width`` x ``height``."""
    data = bytearray(_png(8, 8))
    start = 8 + 8  # signature, then the IHDR chunk's length and type
    data[start : start + 8] = struct.pack(">II", width, height)
    crc = zlib.crc32(bytes(data[12 : start + 13]))
    data[start + 13 : start + 17] = struct.pack(">I", crc)
    return bytes(data)


def _refused(source, match: str, limits: ImageLimits | None = None, error=InvalidInputError) -> str:
    with pytest.raises(error, match=match) as info:
        load_image(source, limits)
    return str(info.value)


def test_decompression_bomb_is_refused_from_the_header():
    message = _refused(_claiming(20_000, 20_000), "decompression bomb|over the limit of 89,478,485")
    assert "MAX_IMAGE_PIXELS" in message or "decompression bomb" in message
    # a stated cap below Pillow's applies too, and names itself
    message = _refused(
        _claiming(4000, 3000), r"over the limit of 1,000,000 \(max_pixels\)", ImageLimits(max_pixels=10**6)
    )


def test_truncated_png_and_jpeg():
    png, jpeg = _png(200, 150), _jpeg(200, 150)
    _refused(png[: len(png) // 2], "truncated or corrupt|cannot be read")
    _refused(jpeg[: len(jpeg) // 2], "truncated or corrupt|cannot be read")


def test_svg_and_other_non_images():
    svg = b'<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"><rect width="10" height="10"/></svg>'
    assert "SVG" in _refused(svg, "not an image ortbatch decodes")
    _refused(b"%PDF-1.4 not an image", "not an image ortbatch decodes")
    _refused(b"", "empty")


def test_eps_is_not_decoded():
    """EPS would run Ghostscript: outside the accepted formats, refused whatever it holds."""
    _refused(b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n", "not an image ortbatch decodes")


def test_thin_strips_and_long_sides():
    strip = _claiming(100_000, 1)
    message = _refused(strip, "max_side|max_aspect_ratio")
    assert "100000x1" in message
    # a real 1x1000 strip: under max_side, over the 100:1 ratio
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (1000, 1)).save(buf, "PNG")
    _refused(buf.getvalue(), r"1,000:1 strip, over the limit of 100:1 \(max_aspect_ratio\)")
    assert load_image(buf.getvalue(), ImageLimits(max_aspect_ratio=1000)).size == (1000, 1)


def test_size_cap_in_bytes():
    data = _jpeg(300, 300)
    _refused(data, r"over the limit of 1,000 \(max_bytes\)", ImageLimits(max_bytes=1000), RequestTooLargeError)
    uri = "data:image/jpeg;base64," + base64.b64encode(data).decode()
    _refused(uri, r"max_bytes", ImageLimits(max_bytes=1000), RequestTooLargeError)


def test_data_uris():
    data = _png()
    good = "data:image/png;base64," + base64.b64encode(data).decode()
    assert load_image(good).size == (64, 48)
    assert load_image("data:;base64," + base64.b64encode(data).decode()).size == (64, 48)
    _refused("data:image/png;base64,@@@not base64@@@", "base64 does not decode")
    _refused("data:image/png;base64," + base64.b64encode(data).decode()[:-3], "base64 does not decode")
    _refused("data:image/png," + "x" * 10, "not base64")
    _refused("data:text/plain;base64,aGVsbG8=", "not an image/")
    _refused("data:image/png;base64,aGVsbG8=", "not an image ortbatch decodes")


def test_urls_are_never_fetched():
    _refused("https://example.com/cat.jpg", "remote URLs are not fetched")
    _refused("http://169.254.169.254/latest/meta-data", "remote URLs are not fetched")


def test_wrong_types_and_missing_files(tmp_path):
    _refused(12, "expected bytes, a file path, a data: URI or a PIL image")
    _refused("no such file.png", "is not a file")
    _refused(tmp_path, "is not a file")
    with pytest.raises(InvalidInputError, match="image 1"):
        load_images([_png(), b"junk"])


def test_modes_become_rgb():
    from PIL import Image

    for mode in ("RGBA", "LA", "L", "P", "CMYK", "I;16", "1", "I", "F"):
        image = Image.new(mode, (8, 6))
        assert load_image(image).mode == "RGB"
    with pytest.raises(InvalidInputError, match="mode La cannot be converted"):
        load_image(Image.new("La", (4, 4)))


def test_limits_are_checked():
    with pytest.raises(ValueError, match="max_bytes"):
        ImageLimits(max_bytes=0)
    with pytest.raises(ValueError, match="max_aspect_ratio"):
        ImageLimits(max_aspect_ratio=float("nan"))
