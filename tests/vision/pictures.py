"""Pictures made here with Pillow and numpy: shapes, text and noise at many sizes, modes and
EXIF orientations, encoded as the files a caller would send."""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np

MODES = ("RGB", "RGBA", "L", "P", "CMYK", "LA", "I;16")


@dataclass(frozen=True)
class Picture:
    name: str
    data: bytes  # the encoded file
    mode: str
    size: tuple[int, int]  # (width, height) as stored
    orientation: int  # EXIF orientation tag (1: none)

    def pil(self):
        from PIL import Image

        return Image.open(io.BytesIO(self.data))


def drawing(width: int, height: int, seed: int):
    """An RGB picture: a noisy gradient, filled shapes and a line of text."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    base = np.stack(
        [xx * 255 // max(1, width - 1), yy * 255 // max(1, height - 1), (xx + yy) * 127 // max(1, width + height)],
        axis=-1,
    )
    noise = rng.integers(-40, 40, size=(height, width, 3))
    img = Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8), "RGB")
    draw = ImageDraw.Draw(img)
    for _ in range(4):
        x0, x1 = sorted(rng.integers(0, width, 2).tolist())
        y0, y1 = sorted(rng.integers(0, height, 2).tolist())
        fill = tuple(int(c) for c in rng.integers(0, 256, 3))
        if rng.random() < 0.5:
            draw.rectangle([x0, y0, x1, y1], fill=fill)
        else:
            draw.ellipse([x0, y0, x1, y1], fill=fill)
    draw.text((width // 8, height // 3), f"ortbatch {seed}", fill=(255, 255, 255))
    return img


def _as_mode(img, mode: str, seed: int):
    from PIL import Image

    if mode == "RGBA":
        alpha = Image.fromarray(np.random.default_rng(seed).integers(0, 256, img.size[::-1], dtype=np.uint8), "L")
        out = img.copy()
        out.putalpha(alpha)
        return out
    if mode == "LA":
        return img.convert("LA")
    if mode == "P":
        return img.convert("P", palette=Image.Palette.ADAPTIVE, colors=64)
    if mode == "I;16":
        gray = np.asarray(img.convert("L")).astype(np.uint16) * 257
        return Image.fromarray(gray)  # a uint16 array is mode I;16
    return img.convert(mode)


def encode(img, orientation: int = 1) -> bytes:
    """PNG for modes JPEG cannot hold, JPEG (quality 95) for RGB, L and CMYK; the EXIF
    orientation tag written when not 1."""
    from PIL import Image

    buf = io.BytesIO()
    kwargs = {}
    if orientation != 1:
        exif = Image.Exif()
        exif[0x0112] = orientation
        kwargs["exif"] = exif.tobytes()
    if img.mode in ("RGB", "L", "CMYK"):
        img.save(buf, "JPEG", quality=95, **kwargs)
    else:
        img.save(buf, "PNG", **kwargs)
    return buf.getvalue()


def pictures(n: int = 50, seed: int = 7) -> list[Picture]:
    """``n`` pictures, sizes from 5 to 640 pixels a side at ratios up to 1:6, every mode of
    :data:`MODES` and every EXIF orientation 1-8. No picture is 1 or 3 pixels high:
    transformers takes such an array as channels-first (its own limitation)."""
    rng = np.random.default_rng(seed)
    out = []
    fixed = [(17, 9), (9, 17), (224, 224), (640, 96), (96, 640), (300, 200), (5, 30), (33, 32)]
    for i in range(n):
        if i < len(fixed):
            w, h = fixed[i]
        else:
            w = int(rng.integers(5, 640))
            h = int(np.clip(w * rng.uniform(1 / 6, 6), 5, 640))
        if h in (1, 3):
            h += 1
        mode = MODES[i % len(MODES)]
        orientation = 1 + i % 8
        img = _as_mode(drawing(w, h, seed * 1000 + i), mode, i)
        out.append(
            Picture(
                f"pic{i:02d}-{mode}-{w}x{h}-o{orientation}", encode(img, orientation), img.mode, (w, h), orientation
            )
        )
    return out
