"""The rerank and classification answers of real (tiny, random) exports equal what the user's
own library answers for the same checkpoint: sentence-transformers' ``CrossEncoder.predict`` /
``rank`` for ``/v1/rerank``, ``/rerank`` and ``ortbatch run``'s ``score`` (its ``activation_fn``:
Sigmoid by default, Identity when the checkpoint says so; its default prompt before the
query), transformers'
``pipeline("text-classification")`` for ``/v1/classify`` and ``ortbatch run``'s ``scores``
(softmax; sigmoid for multi-label and for one label; the logits for regression)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pyarrow.parquet as pq
import pytest

import ortbatch
from ortbatch.serve import BackgroundServer, ServeConfig, ServedModel

pytestmark = [pytest.mark.slow, pytest.mark.export, pytest.mark.timeout(300)]

torch = pytest.importorskip("torch")
pytest.importorskip("optimum.exporters.onnx")
st_mod = pytest.importorskip("sentence_transformers")
transformers = pytest.importorskip("transformers")

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
    "hello",
    "world",
    "panda",
    "bear",
    "is",
    "a",
    "species",
    "what",
    "china",
    "giant",
    "many",
    "query",
    ":",
]
QUERY = "what is a panda"
DOCS = ["hello world", "the giant panda is a bear species", "the quick brown fox jumps over the lazy dog", "panda"]
TEXTS = ["the quick brown fox", "hello world panda bear", "a giant species"]
# name -> (num_labels, config kwargs, CrossEncoder activation_fn or None for a plain classifier)
CHECKPOINTS: dict[str, tuple[int, dict[str, Any], Any]] = {
    "ce-sigmoid": (1, {}, "default"),
    "ce-identity": (1, {}, "identity"),
    "ce-prompted": (1, {}, "prompted"),
    "multi-label": (3, {"problem_type": "multi_label_classification"}, None),
    "single-label": (3, {}, None),
    "regression": (1, {"problem_type": "regression"}, None),
}


def _checkpoint(root: Path, name: str) -> Path:
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    n, kwargs, activation = CHECKPOINTS[name]
    vocab = root / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]))
    tok = BertTokenizerFast(vocab_file=str(vocab), model_max_length=64)
    labels = {i: f"L{i}" for i in range(n)}
    config = BertConfig(
        vocab_size=len(tok),
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=64,
        initializer_range=0.5,  # scores far apart: a wrong prompt or function shows
        num_labels=n,
        id2label=labels,
        label2id={v: k for k, v in labels.items()},
        **kwargs,
    )
    torch.manual_seed(sum(map(ord, name)))
    model = BertForSequenceClassification(config).eval()
    plain = root / (name + "-hf")
    model.save_pretrained(plain)
    tok.save_pretrained(plain)
    if activation is None:
        return plain
    fn = torch.nn.Identity() if activation == "identity" else None
    prompts = {"prompts": {"query": "query: "}, "default_prompt_name": "query"} if activation == "prompted" else {}
    st = root / name
    st_mod.CrossEncoder(str(plain), activation_fn=fn, device="cpu", **prompts).save_pretrained(str(st))
    return st


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """name -> (the checkpoint, its export)."""
    root = tmp_path_factory.mktemp("fidelity")
    out = {}
    for name in CHECKPOINTS:
        ckpt = _checkpoint(root, name)
        export = root / (name + "-onnx")
        ortbatch.export_model(str(ckpt), export, task="text-classification", validate=False, max_batch_size=4)
        out[name] = (ckpt, export)
    return out


@pytest.fixture(scope="module")
def servers(checkpoints: dict[str, tuple[Path, Path]]) -> Iterator[dict[str, BackgroundServer]]:
    started = {}
    for name, (_, export) in checkpoints.items():
        model = ServedModel.load(export, name=name, session_kwargs={"max_batch_size": 4})
        started[name] = BackgroundServer(model, ServeConfig(port=0, access_log=False, log_level="warning")).start()
    yield started
    for srv in started.values():
        srv.stop()


def _post(srv: BackgroundServer, path: str, body: object) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, timeout=30)


@pytest.mark.parametrize("name", ["ce-sigmoid", "ce-identity", "ce-prompted"])
def test_rerank_equals_cross_encoder_predict_and_rank(checkpoints, servers, name):
    ce = st_mod.CrossEncoder(str(checkpoints[name][0]), device="cpu")
    want = ce.predict([(QUERY, d) for d in DOCS])
    logits = ce.predict([(QUERY, d) for d in DOCS], activation_fn=torch.nn.Identity())
    ranked = ce.rank(QUERY, DOCS, top_k=3)
    srv = servers[name]

    cohere = _post(srv, "/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": 3}).json()["results"]
    assert [r["index"] for r in cohere] == [r["corpus_id"] for r in ranked]
    np.testing.assert_allclose([r["relevance_score"] for r in cohere], [r["score"] for r in ranked], atol=1e-5)
    tei = _post(srv, "/rerank", {"query": QUERY, "texts": DOCS}).json()
    np.testing.assert_allclose([r["score"] for r in sorted(tei, key=lambda r: r["index"])], want, atol=1e-5)
    raw = _post(srv, "/rerank", {"query": QUERY, "texts": DOCS, "raw_scores": True}).json()
    np.testing.assert_allclose([r["score"] for r in sorted(raw, key=lambda r: r["index"])], logits, atol=1e-5)


@pytest.mark.parametrize("name", ["multi-label", "single-label", "regression", "ce-sigmoid"])
def test_classify_equals_the_text_classification_pipeline(checkpoints, servers, name):
    ckpt = checkpoints[name][0]
    pipe = transformers.pipeline("text-classification", model=str(ckpt), tokenizer=str(ckpt), device="cpu")
    data = _post(servers[name], "/v1/classify", {"input": TEXTS}).json()["data"]
    for text, got in zip(TEXTS, data, strict=True):
        all_scores = {d["label"]: d["score"] for d in pipe(text, top_k=None)}
        labels = [f"L{i}" for i in range(len(all_scores))]
        np.testing.assert_allclose(got["probs"], [all_scores[k] for k in labels], atol=1e-5)
        assert got["label"] == pipe(text)[0]["label"]


def test_ortbatch_run_scores_and_labels_equal_the_libraries(checkpoints, tmp_path):
    src = tmp_path / "rows.jsonl"
    src.write_text("".join(json.dumps({"q": QUERY, "d": d}) + "\n" for d in DOCS))
    for name in ("ce-identity", "ce-prompted"):
        ckpt, export = checkpoints[name]
        ortbatch.run(export, src, tmp_path / name, text_column="q", pair_column="d", window=2, progress=False)
        want = st_mod.CrossEncoder(str(ckpt), device="cpu").predict([(QUERY, d) for d in DOCS])
        np.testing.assert_allclose(pq.read_table(tmp_path / name).column("score").to_pylist(), want, atol=1e-5)

    ckpt, export = checkpoints["multi-label"]
    pipe = transformers.pipeline("text-classification", model=str(ckpt), tokenizer=str(ckpt), device="cpu")
    texts = tmp_path / "texts.jsonl"
    texts.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    ortbatch.run(export, texts, tmp_path / "cls", window=2, progress=False)
    got = pq.read_table(tmp_path / "cls").column("scores").to_pylist()
    for text, scores in zip(TEXTS, got, strict=True):
        by_label = {d["label"]: d["score"] for d in pipe(text, top_k=None)}
        np.testing.assert_allclose(scores, [by_label[f"L{i}"] for i in range(3)], atol=1e-5)


def test_an_activation_ortbatch_cannot_compute_is_a_400_naming_it(checkpoints, tmp_path):
    export = tmp_path / "relu"
    shutil.copytree(checkpoints["ce-sigmoid"][1], export)
    (export / "config_sentence_transformers.json").write_text(
        json.dumps({"activation_fn": "torch.nn.modules.activation.ReLU"})
    )
    model = ServedModel.load(export, name="relu", session_kwargs={"max_batch_size": 4})
    srv = BackgroundServer(model, ServeConfig(port=0, access_log=False, log_level="warning")).start()
    try:
        r = _post(srv, "/v1/rerank", {"query": QUERY, "documents": DOCS})
        assert r.status_code == 400
        assert "activation_fn" in r.text and "ReLU" in r.text
        assert _post(srv, "/rerank", {"query": QUERY, "texts": DOCS, "raw_scores": True}).status_code == 200
    finally:
        srv.stop()
    src = tmp_path / "rows.jsonl"
    src.write_text(json.dumps({"q": QUERY, "d": DOCS[0]}) + "\n")
    with pytest.raises(ortbatch.errors.UnsupportedModelError, match="ReLU"):
        ortbatch.run(export, src, tmp_path / "out", text_column="q", pair_column="d", progress=False)


def test_a_checkpoint_without_the_head_weights_is_refused_at_export(tmp_path):
    """A bare encoder exported for text-classification would get a head transformers
    initializes at random (and pass its checks against that same random model)."""
    from transformers import BertConfig, BertModel, BertTokenizerFast

    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]))
    tok = BertTokenizerFast(vocab_file=str(vocab), model_max_length=64)
    config = BertConfig(
        vocab_size=len(tok), hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
    )
    BertModel(config).save_pretrained(tmp_path / "bare")
    tok.save_pretrained(tmp_path / "bare")
    with pytest.raises(ortbatch.errors.ExportError, match=r"no weights for the text-classification head.*classifier"):
        ortbatch.export_model(str(tmp_path / "bare"), tmp_path / "out", task="text-classification", validate=False)


def test_the_heads_and_label_names_are_read_once_per_loaded_model(checkpoints, tmp_path):
    """What the export's files say is read when the model is first asked, not on every request:
    files changed under a running server do not change its answers (a reload would)."""
    export = tmp_path / "single"
    shutil.copytree(checkpoints["single-label"][1], export)
    model = ServedModel.load(export, name="single", session_kwargs={"max_batch_size": 4})
    srv = BackgroundServer(model, ServeConfig(port=0, access_log=False, log_level="warning")).start()
    try:
        first = _post(srv, "/v1/classify", {"input": TEXTS}).json()["data"]
        config = json.loads((export / "config.json").read_text())
        config["id2label"] = {k: "changed" for k in config["id2label"]}
        config["problem_type"] = "regression"
        (export / "config.json").write_text(json.dumps(config))
        assert _post(srv, "/v1/classify", {"input": TEXTS}).json()["data"] == first
    finally:
        srv.stop()
