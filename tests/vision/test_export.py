"""Image exports against the user's library: CLIP and SigLIP towers and a sentence-transformers
CLIP layout (cosine >= 0.9999, fp32, batched and alone), ViT/DeiT/BEiT/ConvNeXt/Swin/DINOv2
classifiers (top-1 equal, logits within 1e-4) and a DINOv2 backbone, through the in-process faces
(ortbatch.vision: its own decoding and preprocessing, no torch) on pictures made here."""

from __future__ import annotations

import io
import subprocess
import sys
import threading

import numpy as np
import pytest

from ortbatch.errors import ExportError, InvalidInputError, UnsupportedModelError
from tests.vision.models import TEXTS
from tests.vision.pictures import pictures

pytestmark = [pytest.mark.export, pytest.mark.slow]
pytest.importorskip("torch")
pytest.importorskip("PIL")

COSINE = 0.9999
LOGITS_ATOL = 1e-4


@pytest.fixture(scope="module")
def pics() -> list:
    """12 pictures: several sizes, aspect ratios, modes and EXIF orientations, as files."""
    return [p.data for p in pictures(12, seed=11)]


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def _hf_images(data: list[bytes]) -> list:
    """The user's own decoding of the files: transformers' load_image (EXIF, RGB)."""
    import base64

    from transformers.image_utils import load_image

    return [load_image(base64.b64encode(d).decode()) for d in data]


def _hf_image_features(checkpoint, data: list[bytes]) -> np.ndarray:
    import torch
    from transformers import AutoImageProcessor, AutoModel

    model = AutoModel.from_pretrained(checkpoint).eval()
    proc = AutoImageProcessor.from_pretrained(checkpoint, use_fast=False)
    with torch.inference_mode():
        return model.get_image_features(**proc(_hf_images(data), return_tensors="pt")).numpy()


def _hf_text_features(checkpoint, texts, siglip: bool) -> np.ndarray:
    import torch
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(checkpoint).eval()
    tok = AutoTokenizer.from_pretrained(checkpoint)
    if siglip:  # as SigLIP's model card says: padding="max_length", how it was trained
        enc = tok(
            list(texts),
            padding="max_length",
            max_length=model.config.text_config.max_position_embeddings,
            truncation=True,
            return_tensors="pt",
        )
        enc = {"input_ids": enc["input_ids"]}
    else:
        enc = tok(list(texts), padding=True, truncation=True, return_tensors="pt")
    with torch.inference_mode():
        return model.get_text_features(**enc).numpy()


@pytest.mark.parametrize("kind", ["clip", "clip-legacy", "siglip"])
def test_two_towers_equal_transformers(kind, exported, checkpoint, pics):
    from ortbatch.vision import ImageEmbedder

    result = exported(kind)
    assert result.report.passed, result.report.summary()
    assert result.manifest.extra["components"].keys() == {"image", "text"}
    want_img = _hf_image_features(checkpoint(kind), pics)
    want_txt = _hf_text_features(checkpoint(kind), TEXTS, siglip=kind == "siglip")
    with ImageEmbedder(result.directory) as emb:
        batched = emb.embed_images(pics)
        alone = np.concatenate([emb.embed_images([p]) for p in pics])
        texts = emb.embed_texts(list(TEXTS))
        texts_alone = np.concatenate([emb.embed_texts([t]) for t in TEXTS])
    assert batched.shape == want_img.shape
    assert _cosines(batched, want_img).min() >= COSINE
    assert _cosines(alone, want_img).min() >= COSINE
    assert _cosines(texts, want_txt).min() >= COSINE
    assert _cosines(texts_alone, want_txt).min() >= COSINE


def test_sentence_transformers_clip_layout_equals_encode(exported, checkpoint, pics):
    from PIL import Image
    from sentence_transformers import SentenceTransformer

    from ortbatch.vision import ImageEmbedder

    result = exported("st-clip")
    assert result.report.passed, result.report.summary()
    assert result.manifest.source["library"] == "sentence_transformers"
    st = SentenceTransformer(str(checkpoint("st-clip")), device="cpu")
    # encode is handed the images as PIL images opened from the files (no EXIF transpose: the
    # processor does not), so ortbatch is handed the same PIL images
    images = [Image.open(io.BytesIO(d)) for d in pics]
    want_img = st.encode(images)
    want_txt = st.encode(list(TEXTS))
    with ImageEmbedder(result.directory) as emb:
        got = emb.embed_images(images)
        alone = np.concatenate([emb.embed_images([im]) for im in images])
        txt = emb.embed_texts(list(TEXTS))
    assert _cosines(got, want_img).min() >= COSINE
    assert _cosines(alone, want_img).min() >= COSINE
    assert _cosines(txt, want_txt).min() >= COSINE


@pytest.mark.parametrize("kind", ["vit", "deit", "beit", "convnext", "swin", "dinov2"])
def test_classifiers_equal_transformers(kind, exported, checkpoint, pics):
    import torch
    from transformers import AutoImageProcessor, AutoModelForImageClassification

    from ortbatch.vision import ImageClassifier

    result = exported(kind)
    assert result.report.passed, result.report.summary()
    model = AutoModelForImageClassification.from_pretrained(checkpoint(kind)).eval()
    proc = AutoImageProcessor.from_pretrained(checkpoint(kind), use_fast=False)
    with torch.inference_mode():
        want = model(**proc(_hf_images(pics), return_tensors="pt")).logits.numpy()
    with ImageClassifier(result.directory) as clf:
        got = clf.logits(pics)
        alone = np.concatenate([clf.logits([p]) for p in pics])
        labels = clf.classify(pics[:2], top_k=2)
    for logits in (got, alone):
        assert (logits.argmax(1) == want.argmax(1)).all()
        np.testing.assert_allclose(logits, want, atol=LOGITS_ATOL, rtol=1e-3)
    assert [row[0]["label"] for row in labels] == [model.config.id2label[int(i)] for i in want[:2].argmax(1)]
    for row in labels:
        assert row[0]["score"] >= row[1]["score"] and sum(x["score"] for x in row) <= 1.0 + 1e-6


def test_dinov2_backbone_features(exported, checkpoint, pics):
    import torch
    from transformers import AutoImageProcessor, AutoModel

    from ortbatch.vision import ImageEmbedder

    result = exported("dinov2-backbone")
    assert result.report.passed, result.report.summary()
    assert result.manifest.source["task"] == "image-feature-extraction"
    model = AutoModel.from_pretrained(checkpoint("dinov2-backbone")).eval()
    proc = AutoImageProcessor.from_pretrained(checkpoint("dinov2-backbone"), use_fast=False)
    with torch.inference_mode():
        want = model(**proc(_hf_images(pics), return_tensors="pt")).pooler_output.numpy()
    with ImageEmbedder(result.directory) as emb:
        got = emb.embed_images(pics)
    assert _cosines(got, want).min() >= COSINE


@pytest.mark.parametrize(
    ("kind", "kwargs"),
    [
        ("clip", {"dtype": "fp16"}),
        ("vit", {"dtype": "fp16"}),
        ("clip", {"quantize": "int8"}),
        ("vit", {"quantize": "int8"}),
    ],
)
def test_fp16_and_int8_pass_their_checks(kind, kwargs, exported):
    result = exported(kind, **kwargs)
    assert result.report.passed, result.report.summary()
    ran = [c for c in result.report.checks if c.name == "reference_parity"]
    assert ran and ran[0].status == "passed"


def test_zero_shot_equals_clip_logits_per_image(exported, checkpoint, pics):
    import torch
    from transformers import AutoImageProcessor, AutoModel, AutoTokenizer

    from ortbatch.vision import ImageEmbedder

    labels = ["square", "circle", "noise"]
    texts = [f"a photo of {x}." for x in labels]
    model = AutoModel.from_pretrained(checkpoint("clip")).eval()
    proc = AutoImageProcessor.from_pretrained(checkpoint("clip"), use_fast=False)
    tok = AutoTokenizer.from_pretrained(checkpoint("clip"))
    with torch.inference_mode():
        out = model(**proc(_hf_images(pics[:4]), return_tensors="pt"), **tok(texts, padding=True, return_tensors="pt"))
    want = out.logits_per_image.softmax(-1).numpy()
    with ImageEmbedder(exported("clip").directory) as emb:
        got = emb.zero_shot(pics[:4], labels)
    np.testing.assert_allclose(got, want, atol=1e-4)


def test_concurrent_callers_get_their_own_rows(exported, pics):
    """Threads embed different pictures at once through one embedder: each answer must be its
    own picture's vector (a misrouted row would match another picture's)."""
    from ortbatch.vision import ImageEmbedder

    with ImageEmbedder(exported("clip").directory, max_delay_ms=5.0) as emb:
        alone = np.concatenate([emb.embed_images([p]) for p in pics])
        start = threading.Barrier(6)
        answers: dict[tuple[int, int], np.ndarray] = {}
        errors: list[BaseException] = []

        def caller(t: int) -> None:
            try:
                start.wait()
                for r in range(4):
                    order = [(t + r + k) % len(pics) for k in range(3)]
                    got = emb.embed_images([pics[i] for i in order])
                    for j, i in enumerate(order):
                        answers[(t * 100 + r * 10 + j, i)] = got[j]
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=caller, args=(t,)) for t in range(6)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        stats = emb.session.stats()
    assert not errors, errors
    assert len(answers) == 6 * 4 * 3
    for (_, i), row in answers.items():
        distances = np.abs(alone - row).max(axis=1)
        assert distances.argmin() == i
        assert distances[i] <= 1e-5
    assert stats is not None


def test_long_calls_go_a_window_at_a_time(exported, pics):
    """A call with more images than the session's queue holds is answered whole, in order."""
    from ortbatch.vision import ImageEmbedder

    many = (pics * 4)[:40]
    with ImageEmbedder(exported("clip").directory) as ref:
        want = ref.embed_images(many)
    with ImageEmbedder(exported("clip").directory, max_queue=4, max_batch_size=2) as emb:
        got = emb.embed_images(many)
        texts = emb.embed_texts(list(TEXTS) * 3)
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert texts.shape == (len(TEXTS) * 3, 16)


def test_exif_transpose_of_pil_images_on_request(exported, pics):
    """A PIL image is taken as given (as the processor takes it) unless exif_transpose=True
    (what transformers' pipelines do): then it embeds as its file does."""
    from PIL import Image

    from ortbatch.vision import ImageEmbedder

    rotated = [d for d in pics if Image.open(io.BytesIO(d)).getexif().get(0x0112, 1) in (6, 8)][:2]
    assert rotated
    opened = [Image.open(io.BytesIO(d)) for d in rotated]
    with ImageEmbedder(exported("clip").directory) as as_given:
        files, plain = as_given.embed_images(rotated), as_given.embed_images(opened)
    with ImageEmbedder(exported("clip").directory, exif_transpose=True) as transposing:
        turned = transposing.embed_images(opened)
    np.testing.assert_allclose(turned, files, atol=1e-6)
    assert np.abs(plain - files).max() > 1e-3


def test_bad_image_fails_alone_and_the_embedder_keeps_serving(exported, pics):
    from ortbatch.vision import ImageEmbedder

    with ImageEmbedder(exported("clip").directory) as emb:
        with pytest.raises(InvalidInputError, match="image 1: not an image"):
            emb.embed_images([pics[0], b"<svg></svg>"])
        with pytest.raises(InvalidInputError, match="remote URLs are not fetched"):
            emb.embed_images(["https://example.com/x.png"])
        assert emb.embed_images([pics[0]]).shape == (1, 16)


def test_refusals(checkpoint, tmp_path):
    from ortbatch.export import export_model

    with pytest.raises(UnsupportedModelError, match="image-feature-extraction"):
        export_model(str(checkpoint("dinov2-backbone")), tmp_path / "a", task="image-classification")
    with pytest.raises(UnsupportedModelError, match="not one of its tasks"):
        export_model(str(checkpoint("vit")), tmp_path / "b", task="text-classification")
    with pytest.raises(ExportError, match="--optimize O2 is not available for image exports"):
        export_model(str(checkpoint("vit")), tmp_path / "c", optimize="O2")
    with pytest.raises(ExportError, match="image exports take dynamic int8 only"):
        export_model(str(checkpoint("vit")), tmp_path / "d", quantize="int8-static")


def test_text_checkpoints_are_left_to_the_text_exporter(tmp_path):
    from transformers import BertConfig

    from ortbatch.export.vision import detect

    config = BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=37)
    config.save_pretrained(tmp_path)
    assert detect(str(tmp_path)) is None
    assert detect(str(tmp_path), "feature-extraction") is None
    with pytest.raises(UnsupportedModelError, match="is for image checkpoints"):
        detect(str(tmp_path), "image-classification")


def test_cli_export_and_validate(checkpoint, tmp_path):
    out = tmp_path / "deit-onnx"
    cli = [sys.executable, "-m", "ortbatch.cli"]
    done = subprocess.run([*cli, "export", str(checkpoint("deit")), "-o", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (out / "model.onnx").is_file()
    done = subprocess.run([*cli, "validate", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Traceback" not in done.stderr


def test_checks_catch_a_wrong_preprocessing(exported, tmp_path):
    """The checks can fail: an export whose recorded image processor normalizes with other
    means is caught by reference parity (pixel values and embeddings), naming the output."""
    import json
    import shutil

    from ortbatch.export import validate

    bad = tmp_path / "clip-bad"
    shutil.copytree(exported("clip").directory, bad)
    doc = json.loads((bad / "ortbatch.json").read_text())
    doc["vision"]["processor"]["image_mean"] = [0.5, 0.5, 0.5]
    (bad / "ortbatch.json").write_text(json.dumps(doc))
    report = validate(bad, save=False)
    assert not report.passed
    parity = next(c for c in report.checks if c.name == "reference_parity")
    failed = [x.output for case in parity.cases for x in case.comparisons if not x.passed]
    assert "pixel_values" in failed and "image_embeds" in failed


def test_an_edited_vision_section_is_refused_by_the_faces(exported, tmp_path, monkeypatch):
    import json
    import shutil

    from ortbatch.errors import ModelIntegrityError
    from ortbatch.vision import ImageEmbedder

    bad = tmp_path / "clip-edited"
    shutil.copytree(exported("clip").directory, bad)
    doc = json.loads((bad / "ortbatch.json").read_text())
    doc["vision"]["processor"]["resample"] = 0
    (bad / "ortbatch.json").write_text(json.dumps(doc))
    with pytest.raises(ModelIntegrityError, match="'vision' section"):
        ImageEmbedder(bad)
    monkeypatch.setenv("ORTBATCH_SKIP_VERIFY", "1")
    ImageEmbedder(bad).close()
