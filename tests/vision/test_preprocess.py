"""The image processors reproduced in numpy + Pillow equal transformers' (the user's library) on
50 generated pictures of varied size, mode and EXIF orientation, per processor class.

Stated tolerance: max abs diff of the pixel values 1e-6 (the steps are the same Pillow calls
and the same float32 arithmetic, so the diff measured here is 0.0)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("PIL")
transformers = pytest.importorskip("transformers")

from ortbatch.vision import ImageProcessor, load_image  # noqa: E402
from tests.vision.pictures import pictures  # noqa: E402

MAX_ABS_DIFF = 1e-6

BICUBIC, BILINEAR, LANCZOS, NEAREST = 3, 2, 1, 0
#: one checkpoint-like configuration per class, explicit arguments (small sizes keep it quick);
#: DINOv2 checkpoints use BitImageProcessor, and ConvNeXt takes two paths (crop_pct below 384)
PROCESSORS = {
    "clip": ("CLIPImageProcessor", {"size": {"shortest_edge": 40}, "crop_size": {"height": 40, "width": 40}}),
    "siglip": ("SiglipImageProcessor", {"size": {"height": 32, "width": 48}, "do_convert_rgb": True}),
    "vit": ("ViTImageProcessor", {"size": {"height": 30, "width": 30}}),
    "vit-nearest": ("ViTImageProcessor", {"size": {"height": 26, "width": 34}, "resample": NEAREST}),
    "deit": ("DeiTImageProcessor", {"size": {"height": 36, "width": 36}, "crop_size": {"height": 32, "width": 32}}),
    "convnext-crop": ("ConvNextImageProcessor", {"size": {"shortest_edge": 32}, "crop_pct": 0.875}),
    "convnext-warp": ("ConvNextImageProcessor", {"size": {"shortest_edge": 384}}),
    "dinov2-bit": (
        "BitImageProcessor",
        {
            "size": {"shortest_edge": 36},
            "crop_size": {"height": 32, "width": 32},
            "image_mean": [0.485, 0.456, 0.406],
            "image_std": [0.229, 0.224, 0.225],
        },
    ),
    "beit": (
        "BeitImageProcessor",
        {"size": {"height": 40, "width": 40}, "crop_size": {"height": 32, "width": 32}, "resample": LANCZOS},
    ),
}
#: the classes that convert to RGB themselves; the others fail on a non-RGB PIL image in
#: transformers, and their pipelines hand them load_image's RGB image
CONVERTS_RGB = {"CLIPImageProcessor", "SiglipImageProcessor", "BitImageProcessor"}


@pytest.fixture(scope="module")
def pics():
    return pictures(50)


@pytest.fixture(scope="module", params=sorted(PROCESSORS))
def saved(request, tmp_path_factory) -> tuple[str, Path]:
    """A processor saved as a checkpoint saves it (preprocessor_config.json)."""
    cls_name, kwargs = PROCESSORS[request.param]
    directory = tmp_path_factory.mktemp(request.param)
    getattr(transformers, cls_name)(**kwargs).save_pretrained(directory)
    return cls_name, directory


def _reference(directory: Path):
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(directory, use_fast=False)


def _worst(ours: np.ndarray, theirs: np.ndarray) -> float:
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    assert ours.dtype == np.float32
    return float(np.abs(ours.astype(np.float64) - theirs.astype(np.float64)).max())


def test_files_equal_load_image_then_processor(saved, pics, tmp_path):
    """Bytes and paths: transformers' load_image (EXIF transposed, RGB), then its processor."""
    from transformers.image_utils import load_image as hf_load_image

    cls_name, directory = saved
    ref = _reference(directory)
    ours = ImageProcessor.from_pretrained(directory)
    assert ours.kind == cls_name
    worst = 0.0
    for pic in pics:
        path = tmp_path / f"{pic.name}.img"
        path.write_bytes(pic.data)
        want = ref(hf_load_image(str(path)), return_tensors="np")["pixel_values"][0]
        from_bytes = ours.preprocess(load_image(pic.data))
        from_path = ours.preprocess(load_image(path))
        worst = max(worst, _worst(from_bytes, want), _worst(from_path, want))
    assert worst <= MAX_ABS_DIFF, f"{cls_name}: max abs diff {worst}"


def test_pil_images_equal_processor(saved, pics):
    """A PIL image straight into the processor: no EXIF transpose there, nor here."""
    cls_name, directory = saved
    ref = _reference(directory)
    ours = ImageProcessor.from_pretrained(directory)
    worst = 0.0
    for pic in pics:
        image = pic.pil()
        given = image if cls_name in CONVERTS_RGB else image.convert("RGB")
        want = ref(given, return_tensors="np")["pixel_values"][0]
        worst = max(worst, _worst(ours.preprocess(load_image(image)), want))
    assert worst <= MAX_ABS_DIFF, f"{cls_name}: max abs diff {worst}"


def test_clip_processor_given_paths_loads_them_itself(pics, tmp_path):
    """CLIPImageProcessor called with file paths loads them with load_image (EXIF applied):
    the same pixels as ortbatch's bytes."""
    from transformers import CLIPImageProcessor

    ref = CLIPImageProcessor(size={"shortest_edge": 24}, crop_size={"height": 24, "width": 24})
    ref.save_pretrained(tmp_path)
    ours = ImageProcessor.from_pretrained(tmp_path)
    paths = []
    for pic in pics[:16]:
        p = tmp_path / f"{pic.name}.img"
        p.write_bytes(pic.data)
        paths.append(str(p))
    want = ref(paths, return_tensors="np")["pixel_values"]
    got = ours([load_image(p.data) for p in pics[:16]])
    assert _worst(got, want) <= MAX_ABS_DIFF


def test_orientation_is_applied_to_files(pics):
    """Every EXIF orientation 2-8 changes a file's pixels as load_image does; 5-8 swap the sides."""
    for pic in pics:
        image = load_image(pic.data)
        w, h = pic.size
        assert image.size == ((h, w) if pic.orientation >= 5 else (w, h)), pic.name
        assert image.mode == "RGB"
        assert load_image(pic.pil()).size == (w, h)  # a PIL image is taken as it is
        assert load_image(pic.pil(), exif_transpose=True).size == image.size


@pytest.mark.parametrize("cls_name", sorted({c for c, _ in PROCESSORS.values()}))
def test_class_defaults_match_transformers(cls_name, pics, tmp_path):
    """A config that names only the class gets that class's defaults, as in transformers."""
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"image_processor_type": cls_name}))
    ref = _reference(tmp_path)
    ours = ImageProcessor.from_pretrained(tmp_path)
    for pic in pics[:6]:
        image = load_image(pic.data)
        want = ref(image, return_tensors="np")["pixel_values"][0]
        assert _worst(ours.preprocess(image), want) <= MAX_ABS_DIFF


@pytest.mark.parametrize(
    ("cls_name", "config"),
    [
        ("CLIPImageProcessor", {"size": 32, "crop_size": 28}),  # the legacy int forms
        ("ViTImageProcessor", {"size": 28}),
        ("CLIPFeatureExtractor", {"size": 30, "crop_size": 40}),  # a crop larger than the image: zero padding
    ],
)
def test_legacy_configs(cls_name, config, pics, tmp_path):
    key = "feature_extractor_type" if cls_name.endswith("FeatureExtractor") else "image_processor_type"
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({key: cls_name, **config}))
    ref = _reference(tmp_path)
    ours = ImageProcessor.from_pretrained(tmp_path)
    for pic in pics[:6]:
        image = load_image(pic.data)
        want = ref(image, return_tensors="np")["pixel_values"][0]
        assert _worst(ours.preprocess(image), want) <= MAX_ABS_DIFF


def test_manifest_round_trip(saved):
    _, directory = saved
    ours = ImageProcessor.from_pretrained(directory)
    assert ImageProcessor.from_dict(json.loads(json.dumps(ours.to_dict()))) == ours
    assert ours.fixed_size is not None
    assert ours.describe().startswith(ours.kind)
