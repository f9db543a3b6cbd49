"""The image model kind served for real (``ortbatch serve`` of an image export): the openai
client's embeddings by data URI (images, texts, mixed, in order) against transformers'
``get_image_features`` / ``get_text_features``; ``/v1/classify`` (a ViT classifier against
``AutoModelForImageClassification``, CLIP zero-shot against ``logits_per_image``); KServe v2
by tritonclient (BYTES images, FP32 pixel_values); the hostile corpus, each a 400 (413 for the
size cap) naming the reason with the server still answering; ``ortbatch run`` over a folder
of images with a resume."""

from __future__ import annotations

import base64
import json
import struct
import subprocess
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("PIL")

from ortbatch.serve import BackgroundServer, ServeConfig
from ortbatch.serve.served.kinds import kind_for_export, kind_of
from ortbatch.serve.vision_kind import IMAGE, MAX_IMAGES_PER_REQUEST, REQUEST_FIELDS, ServedImages
from tests.vision.models import TEXTS
from tests.vision.pictures import drawing, encode, pictures
from tests.vision.test_export import _cosines, _hf_image_features, _hf_images, _hf_text_features

pytestmark = [pytest.mark.slow]
COSINE = 0.9999


def _uri(data: bytes) -> str:
    kind = "jpeg" if data[:2] == b"\xff\xd8" else "png"
    return f"data:image/{kind};base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def pics() -> list[bytes]:
    return [p.data for p in pictures(6, seed=5)]


def _config() -> ServeConfig:
    return ServeConfig(port=0, access_log=False, log_level="warning", max_body_bytes=64 << 20)


@pytest.fixture(scope="module")
def clip_server(exported) -> Iterator[BackgroundServer]:
    served = IMAGE.load(exported("clip").directory, "clip", _config())
    with BackgroundServer(served, _config()) as srv:
        yield srv


@pytest.fixture(scope="module")
def vit_server(exported) -> Iterator[BackgroundServer]:
    served = IMAGE.load(exported("vit").directory, "vit", _config())
    with BackgroundServer(served, _config()) as srv:
        yield srv


def test_an_image_export_is_the_image_kind(exported):
    assert kind_for_export(exported("clip").directory) is IMAGE
    assert kind_for_export(exported("vit").directory) is IMAGE


def test_openai_client_images_texts_and_mixed_in_order(clip_server, exported, checkpoint, pics):
    import openai

    client = openai.OpenAI(base_url=clip_server.url + "/v1", api_key="none")
    want_img = _hf_image_features(checkpoint("clip"), pics)
    want_txt = _hf_text_features(checkpoint("clip"), TEXTS[:3], siglip=False)
    got = client.embeddings.create(model="clip", input=[_uri(d) for d in pics], extra_body={"modality": "image"})
    vectors = np.array([d.embedding for d in got.data])
    assert [d.index for d in got.data] == list(range(len(pics)))
    assert _cosines(vectors, want_img).min() >= COSINE
    texts = client.embeddings.create(model="clip", input=list(TEXTS[:3]))
    assert _cosines(np.array([d.embedding for d in texts.data]), want_txt).min() >= COSINE
    # mixed: text, image, text, image ... answered in the order asked
    mixed: list[Any] = []
    expected = []
    for i in range(3):
        mixed += [{"text": TEXTS[i]}, {"image": _uri(pics[i])}]
        expected += [want_txt[i], want_img[i]]
    out = client.embeddings.create(model="clip", input=mixed)  # type: ignore[arg-type]
    assert _cosines(np.array([d.embedding for d in out.data]), np.array(expected)).min() >= COSINE
    b64 = client.embeddings.create(
        model="clip", input=[_uri(pics[0])], encoding_format="base64", extra_body={"modality": "image"}
    )
    raw = np.frombuffer(base64.b64decode(b64.data[0].embedding), dtype="<f4")  # type: ignore[arg-type]
    assert _cosines(raw[None], want_img[:1]).min() >= COSINE


def test_zero_shot_classify_equals_logits_per_image(clip_server, checkpoint, pics):
    import httpx
    import torch
    from transformers import AutoImageProcessor, AutoModel, AutoTokenizer

    labels = ["square", "circle", "noise"]
    model = AutoModel.from_pretrained(checkpoint("clip")).eval()
    proc = AutoImageProcessor.from_pretrained(checkpoint("clip"), use_fast=False)
    tok = AutoTokenizer.from_pretrained(checkpoint("clip"))
    with torch.inference_mode():
        out = model(
            **proc(_hf_images(pics[:3]), return_tensors="pt"),
            **tok([f"a photo of {x}." for x in labels], padding=True, return_tensors="pt"),
        )
    want = out.logits_per_image.softmax(-1).numpy()
    r = httpx.post(
        clip_server.url + "/v1/classify", json={"input": [_uri(d) for d in pics[:3]], "labels": labels}, timeout=60
    )
    assert r.status_code == 200, r.text
    got = np.array([row["probs"] for row in r.json()["data"]])
    np.testing.assert_allclose(got, want, atol=1e-4)
    assert [row["label"] for row in r.json()["data"]] == [labels[int(i)] for i in want.argmax(1)]
    r = httpx.post(clip_server.url + "/v1/classify", json={"input": [_uri(pics[0])]}, timeout=60)
    assert r.status_code == 400 and "labels" in r.json()["error"]["message"]


def test_classifier_classify_equals_transformers(vit_server, checkpoint, pics):
    import httpx
    import torch
    from transformers import AutoImageProcessor, AutoModelForImageClassification

    model = AutoModelForImageClassification.from_pretrained(checkpoint("vit")).eval()
    proc = AutoImageProcessor.from_pretrained(checkpoint("vit"), use_fast=False)
    with torch.inference_mode():
        want = model(**proc(_hf_images(pics), return_tensors="pt")).logits.softmax(-1).numpy()
    r = httpx.post(vit_server.url + "/v1/classify", json={"input": [_uri(d) for d in pics]}, timeout=60)
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    np.testing.assert_allclose(np.array([row["probs"] for row in data]), want, atol=1e-4)
    assert [row["label"] for row in data] == [model.config.id2label[int(i)] for i in want.argmax(1)]
    r = httpx.post(vit_server.url + "/v1/embeddings", json={"input": [_uri(pics[0])], "modality": "image"})
    assert r.status_code == 400 and "/v1/classify" in r.text


def test_kserve_v2_by_tritonclient(vit_server, clip_server, checkpoint, pics):
    import tritonclient.http as triton

    want = _hf_image_features(checkpoint("clip"), pics[:3])
    with triton.InferenceServerClient(clip_server.url.removeprefix("http://")) as client:
        meta = client.get_model_metadata("clip")
        assert [m["name"] for m in meta["inputs"]] == ["image", "pixel_values"]
        arr = np.array(pics[:3], dtype=object)
        inp = triton.InferInput("image", [3], "BYTES")
        inp.set_data_from_numpy(arr)
        out = client.infer("clip", [inp]).as_numpy(meta["outputs"][0]["name"])
        assert _cosines(out, want).min() >= COSINE
        # FP32 pixel_values, preprocessed by the caller (transformers' processor)
        from transformers import AutoImageProcessor

        proc = AutoImageProcessor.from_pretrained(checkpoint("clip"), use_fast=False)
        pixels = proc(_hf_images(pics[:3]), return_tensors="np")["pixel_values"].astype(np.float32)
        pv = triton.InferInput("pixel_values", list(pixels.shape), "FP32")
        pv.set_data_from_numpy(pixels)
        out = client.infer("clip", [pv]).as_numpy(meta["outputs"][0]["name"])
        assert _cosines(out, want).min() >= COSINE
        bad = triton.InferInput("pixel_values", [1, 3, 5, 5], "FP32")
        bad.set_data_from_numpy(np.zeros((1, 3, 5, 5), np.float32))
        with pytest.raises(Exception, match="expected shape"):
            client.infer("clip", [bad])


def _claiming(width: int, height: int) -> bytes:
    data = bytearray(encode(drawing(8, 8, 1).convert("RGBA")))
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


def _hostile() -> dict[str, tuple[Any, str]]:
    png = encode(drawing(200, 150, 1).convert("RGBA"))
    jpeg = encode(drawing(200, 150, 2))
    svg = b'<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"><rect width="10" height="10"/></svg>'
    import io

    from PIL import Image

    strip, narrow = io.BytesIO(), io.BytesIO()
    Image.new("L", (1, 100_000)).save(strip, "PNG")
    Image.new("L", (1, 5000)).save(narrow, "PNG")
    return {
        "bomb": (_uri(_claiming(20_000, 20_000)), "decompression bomb|over the limit"),
        "truncated-png": (_uri(png[: len(png) // 2]), "truncated or corrupt|cannot be read"),
        "truncated-jpeg": (_uri(jpeg[: len(jpeg) // 2]), "truncated or corrupt|cannot be read"),
        "svg": ("data:image/svg+xml;base64," + base64.b64encode(svg).decode(), "SVG|not an image"),
        "1x100000": (_uri(strip.getvalue()), "max_side"),
        "1x5000": (_uri(narrow.getvalue()), "max_aspect_ratio"),
        "wrong-base64": ("data:image/png;base64,!!!not base64!!!", "base64"),
        "not-base64-uri": ("data:image/png,rawdata", "not base64"),
        "text-media-type": ("data:text/plain;base64,aGVsbG8=", "not an image"),
        "url": ("https://example.com/cat.jpg", "allow-image-urls"),
        "loopback-url": ("http://127.0.0.1:1/x.png", "allow-image-urls"),
        "path": ("/etc/passwd", "not a data: URI"),
        "empty": (_uri(b""), "empty|base64|no pixels|not an image"),
    }


@pytest.mark.parametrize("case", list(_hostile()))
def test_hostile_inputs_are_400s_naming_the_reason(clip_server, case, pics):
    import httpx

    value, reason = _hostile()[case]
    r = httpx.post(clip_server.url + "/v1/embeddings", json={"input": [value], "modality": "image"}, timeout=60)
    assert r.status_code == 400, (case, r.status_code, r.text)
    import re

    assert re.search(reason, r.json()["error"]["message"]), r.text
    ok = httpx.post(clip_server.url + "/v1/embeddings", json={"input": [_uri(pics[0])], "modality": "image"})
    assert ok.status_code == 200  # the server is unharmed


def test_too_many_images_and_bad_fields(clip_server, pics):
    import httpx

    many = [_uri(pics[0])] * (MAX_IMAGES_PER_REQUEST + 1)
    r = httpx.post(clip_server.url + "/v1/embeddings", json={"input": many, "modality": "image"}, timeout=60)
    assert r.status_code == 400 and "over the limit" in r.text
    r = httpx.post(clip_server.url + "/v1/embeddings", json={"input": ["x"], "modality": "audio"})
    assert r.status_code == 400 and "modality" in r.text
    r = httpx.post(clip_server.url + "/v1/embeddings", json={"input": ["x"], "dimensions": 4})
    assert r.status_code == 400 and "dimensions" in r.text
    r = httpx.post(clip_server.url + "/v1/rerank", json={"query": "x", "documents": ["y"]})
    assert r.status_code == 400 and "an image export" in r.text


def test_metrics_and_openapi(clip_server):
    import httpx

    metrics = httpx.get(clip_server.url + "/metrics").text
    assert "ortbatch_http_requests" in metrics and "ortbatch_batches" in metrics  # the image session's counters
    doc = httpx.get(clip_server.url + "/openapi.json").json()
    assert "/v1/embeddings" in doc["paths"] and "/v1/classify" in doc["paths"]
    assert "/v2/models/{name}/infer" in doc["paths"]
    assert not any(op.get("x-ortbatch-undocumented") for p in doc["paths"].values() for op in p.values())
    # the image export's own request schemas, referred to and present
    request = doc["paths"]["/v1/embeddings"]["post"]["requestBody"]["content"]["application/json"]
    assert request["schema"]["$ref"].endswith("/ImageEmbeddingRequest") and request["example"]["modality"] == "image"
    assert set(doc["components"]["schemas"]["ImageEmbeddingRequest"]["properties"]) == {"model"} | set(
        REQUEST_FIELDS["/v1/embeddings"]
    )
    assert set(doc["components"]["schemas"]["ImageClassifyRequest"]["properties"]) == {"model"} | set(
        REQUEST_FIELDS["/v1/classify"]
    )


def test_served_images_kind_of(exported):
    served = IMAGE.load(exported("vit").directory, "v", _config())
    try:
        assert isinstance(served, ServedImages) and kind_of(served) is IMAGE
    finally:
        served.close()


def _run(export: Path, inp: Path, out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "ortbatch.cli",
            "run",
            str(export),
            str(inp),
            "-o",
            str(out),
            "--format",
            "jsonl",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )


def _records(out: Path) -> list[dict[str, Any]]:
    rows = []
    for f in sorted(out.glob("**/*.jsonl")):
        if "error" not in f.name:
            rows += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return rows


def test_run_over_a_folder_of_images_and_resume(exported, checkpoint, pics, tmp_path):
    folder = tmp_path / "images"
    folder.mkdir()
    for i, d in enumerate(pics):
        suffix = "jpg" if d[:2] == b"\xff\xd8" else "png"
        (folder / f"{i:02d}.{suffix}").write_bytes(d)
    (folder / "zz-broken.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really")
    out = tmp_path / "out"
    done = _run(exported("vit").directory, folder, out)
    assert done.returncode == 3 and "6 succeeded, 1 failed" in done.stderr, done.stderr  # 3: some rows failed
    recs = _records(out)
    import torch
    from transformers import AutoImageProcessor, AutoModelForImageClassification

    model = AutoModelForImageClassification.from_pretrained(checkpoint("vit")).eval()
    proc = AutoImageProcessor.from_pretrained(checkpoint("vit"), use_fast=False)
    with torch.inference_mode():
        want = model(**proc(_hf_images(pics), return_tensors="pt")).logits.softmax(-1).numpy()
    good = sorted((r for r in recs if "label" in r), key=lambda r: r["row"])
    assert len(good) == len(pics)
    np.testing.assert_allclose(np.array([r["scores"] for r in good]), want, atol=1e-4)
    errors = [json.loads(line) for line in (out / "_errors.jsonl").read_text().splitlines() if line]
    assert [(e["row"], e["id"], e["error"]) for e in errors] == [(len(pics), "zz-broken.png", "invalid_image")]
    assert "truncated or corrupt" in errors[0]["message"] or "cannot be read" in errors[0]["message"]
    # resumed: nothing is computed again and the answers stay
    again = _run(exported("vit").directory, folder, out)
    assert again.returncode == 3, again.stderr
    assert f"(resumed after {len(pics) + 1} rows)" in again.stderr, again.stderr
    assert sorted(json.dumps(r, sort_keys=True) for r in _records(out)) == sorted(
        json.dumps(r, sort_keys=True) for r in recs
    )


def test_grpc_infer_by_tritonclient(exported, checkpoint, pics):
    grpcclient = pytest.importorskip("tritonclient.grpc")
    want = _hf_image_features(checkpoint("clip"), pics[:2])
    config = ServeConfig(port=0, grpc_port=0, access_log=False, log_level="warning")
    with BackgroundServer(IMAGE.load(exported("clip").directory, "clip", config), config) as srv:
        client = grpcclient.InferenceServerClient(srv.grpc.address)
        meta = client.get_model_metadata("clip", as_json=True)
        assert [m["name"] for m in meta["inputs"]] == ["image", "pixel_values"]
        inp = grpcclient.InferInput("image", [2], "BYTES")
        inp.set_data_from_numpy(np.array(pics[:2], dtype=object))
        out = client.infer("clip", [inp]).as_numpy(meta["outputs"][0]["name"])
        assert _cosines(out, want).min() >= COSINE
        bad = grpcclient.InferInput("image", [1], "BYTES")
        bad.set_data_from_numpy(np.array([b"<svg/>"], dtype=object))
        with pytest.raises(Exception, match="not an image"):
            client.infer("clip", [bad])
        client.close()


def test_cli_serve_an_image_export_and_a_repository(exported, pics, tmp_path):
    """``ortbatch serve DIR`` of a CLIP export, then a repository of a classifier beside it:
    each body route reaches the model its body names."""
    import httpx

    from tests.serve.conftest import ServeProcess

    srv = ServeProcess([str(exported("clip").directory)], tmp_path / "one.log")
    try:
        assert "images: /v1/embeddings" in srv.text()
        r = httpx.post(srv.url + "/v1/embeddings", json={"input": [_uri(pics[0])], "modality": "image"}, timeout=60)
        assert r.status_code == 200, r.text
    finally:
        srv.stop()
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "clip").symlink_to(exported("clip").directory)
    (repo / "vit").symlink_to(exported("vit").directory)
    srv = ServeProcess(["--repository", str(repo)], tmp_path / "repo.log")
    try:
        r = httpx.post(srv.url + "/v1/classify", json={"model": "vit", "input": [_uri(pics[0])]}, timeout=60)
        assert r.status_code == 200 and r.json()["model"] == "vit", r.text
        r = httpx.post(
            srv.url + "/v1/classify",
            json={"model": "clip", "input": [_uri(pics[0])], "labels": ["a", "b"]},
            timeout=60,
        )
        assert r.status_code == 200 and len(r.json()["data"][0]["probs"]) == 2, r.text
        r = httpx.post(srv.url + "/v1/embeddings", json={"model": "vit", "input": [_uri(pics[0])]}, timeout=60)
        assert r.status_code == 400 and "image classifier" in r.text
    finally:
        srv.stop()


def test_cli_serve_behind_frontends(exported, checkpoint, pics, tmp_path):
    """``--frontends 2``: the image graph runs in the engine, decoding and the text tower in
    the front ends; the answers equal transformers'."""
    import httpx

    from tests.serve.conftest import ServeProcess

    want_img = _hf_image_features(checkpoint("clip"), pics[:3])
    want_txt = _hf_text_features(checkpoint("clip"), TEXTS[:2], siglip=False)
    srv = ServeProcess([str(exported("clip").directory), "--frontends", "2"], tmp_path / "fe.log")
    try:
        mixed = [{"image": _uri(d)} for d in pics[:3]] + [{"text": t} for t in TEXTS[:2]]
        for _ in range(4):  # more requests than front ends: both answer
            r = httpx.post(srv.url + "/v1/embeddings", json={"input": mixed}, timeout=60)
            assert r.status_code == 200, r.text
            got = np.array([d["embedding"] for d in r.json()["data"]])
            assert _cosines(got, np.concatenate([want_img, want_txt])).min() >= COSINE
        r = httpx.post(srv.url + "/v1/embeddings", json={"input": ["data:image/png;base64,!!"], "modality": "image"})
        assert r.status_code == 400 and "base64" in r.text
    finally:
        srv.stop()


def test_run_over_a_parquet_column_of_paths_and_uris(exported, checkpoint, pics, tmp_path):
    """A Parquet file whose ``path`` column holds image paths and data: URIs: the CLIP export's
    image vectors (L2-normalized, as ``ortbatch run`` writes embeddings) equal transformers'."""
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    files = []
    for i, d in enumerate(pics[:3]):
        f = tmp_path / f"p{i}.img"
        f.write_bytes(d)
        files.append(str(f))
    column = [*files, *(_uri(d) for d in pics[3:])]
    pq.write_table(pa.table({"path": column}), tmp_path / "in.parquet")
    out = tmp_path / "out"
    args = ["run", str(exported("clip").directory), str(tmp_path / "in.parquet"), "-o", str(out)]
    done = subprocess.run(
        [sys.executable, "-m", "ortbatch.cli", *args, "--format", "jsonl", "--text-column", "path"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    got = np.array([r["embedding"] for r in sorted(_records(out), key=lambda r: r["row"])])
    want = _hf_image_features(checkpoint("clip"), pics)
    assert _cosines(got, want).min() >= COSINE
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


def test_concurrent_clients_get_their_own_rows_in_order(clip_server, checkpoint, pics):
    """16 clients at once, each its own order of the pictures: every answer is its own rows,
    in its order (the image requests of all clients share the session's batches)."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    want = _hf_image_features(checkpoint("clip"), pics)
    rng = np.random.default_rng(0)
    orders = [rng.permutation(len(pics))[: 2 + i % 4] for i in range(16)]

    def one(order: np.ndarray) -> float:
        body = {"input": [_uri(pics[i]) for i in order], "modality": "image"}
        r = httpx.post(clip_server.url + "/v1/embeddings", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return float(_cosines(np.array([d["embedding"] for d in r.json()["data"]]), want[order]).min())

    with ThreadPoolExecutor(16) as pool:
        assert min(pool.map(one, orders)) >= COSINE
