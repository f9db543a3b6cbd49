"""Classification, rerank and token-classification exports through ``ortbatch run``: each
row's fields from its logits run alone on a plain InferenceSession (rerank and labels), and
the entity spans ``ortbatch serve``'s ``/v1/classify`` gives for the same texts."""

from __future__ import annotations

import asyncio
import json
import math
import sys
from pathlib import Path

import httpx
import numpy as np
import pyarrow.parquet as pq
import pytest

import ortbatch

from .conftest import mixed_texts, write_jsonl

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serve"))

from tinytasks import build_classifier, build_tagger, run_alone


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tasks")
    return {
        "reranker": build_classifier(root / "reranker", num_labels=1),
        "sentiment": build_classifier(root / "sentiment", num_labels=3),
        "ner": build_tagger(root / "ner"),
    }


def _tokenize(export: Path, text: str, pair: str | None = None) -> tuple[list[int], list[int]]:
    from tokenizers import Tokenizer

    enc = Tokenizer.from_file(str(export / "tokenizer.json")).encode(text, pair)
    return enc.ids, enc.type_ids


def test_rerank_scores_and_labels_equal_logits_alone(exports: dict[str, Path], tmp_path: Path) -> None:
    queries, docs = mixed_texts(9, seed=7, longest=5), mixed_texts(9, seed=8, longest=7)
    src = write_jsonl(tmp_path / "pairs.jsonl", [{"q": q, "d": d} for q, d in zip(queries, docs, strict=True)])
    ortbatch.run(exports["reranker"], src, tmp_path / "rr", text_column="q", pair_column="d", window=4, progress=False)
    scores = pq.read_table(tmp_path / "rr").column("score").to_pylist()
    for q, d, got in zip(queries, docs, scores, strict=True):
        logit = float(run_alone(exports["reranker"], *_tokenize(exports["reranker"], q, d))[0])
        assert got == pytest.approx(1 / (1 + math.exp(-logit)), abs=1e-6)
    src = write_jsonl(tmp_path / "texts.jsonl", [{"text": t} for t in queries])
    ortbatch.run(exports["sentiment"], src, tmp_path / "cls", window=4, progress=False)
    table = pq.read_table(tmp_path / "cls")
    for t, label, probs in zip(
        queries, table.column("label").to_pylist(), table.column("scores").to_pylist(), strict=True
    ):
        logits = run_alone(exports["sentiment"], *_tokenize(exports["sentiment"], t)).astype(np.float64)
        want = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
        assert np.allclose(probs, want, atol=1e-6)
        assert label == ["negative", "neutral", "positive"][int(want.argmax())]


def test_token_spans_equal_what_serve_answers(exports: dict[str, Path], tmp_path: Path) -> None:
    pytest.importorskip("starlette")
    from ortbatch.serve import ServedModel, create_app

    texts = mixed_texts(10, seed=9, longest=10)
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in texts])
    ortbatch.run(exports["ner"], src, tmp_path / "ner", window=4, output_format="jsonl", progress=False)
    got = [
        json.loads(x)["entities"] for p in sorted((tmp_path / "ner").glob("part-*")) for x in p.read_text().splitlines()
    ]
    model = ServedModel.load(exports["ner"], name="ner")

    async def ask() -> list[list[dict[str, object]]]:
        transport = httpx.ASGITransport(app=create_app(model))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            r = await client.post("/v1/classify", json={"input": texts})
        return [d["entities"] for d in r.json()["data"]]

    try:
        served = asyncio.run(ask())
    finally:
        model.close()
    assert any(got)  # the tiny tagger does find entities, so spans are compared, not just []
    for g, s in zip(got, served, strict=True):
        assert [(e["label"], e["start"], e["end"], e["text"]) for e in g] == [
            (e["label"], e["start"], e["end"], e["text"]) for e in s
        ]
        assert [e["score"] for e in g] == pytest.approx([e["score"] for e in s], abs=1e-6)
