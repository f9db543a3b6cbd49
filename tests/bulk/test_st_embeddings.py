"""Embeddings through ``ortbatch run`` are sentence-transformers' own: tiny random checkpoints
(tests/embed/stmodels.py) with the pipeline in their export — CLS pooling, a Dense layer, no
Normalize and a default prompt; mean pooling that leaves the prompt out (``include_prompt=False``)
and normalizes — give ``SentenceTransformer.encode``'s vectors (not re-normalized, prompts
applied), and Batch API embedding lines take ``dimensions``, ``prompt_name``, ``prompt`` and the
quantized encodings as ``ortbatch serve`` does (bodies equal) and as ``encode(truncate_dim=,
prompt_name=)`` and ``quantize_embeddings`` compute them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ortbatch
from ortbatch.errors import InvalidInputError
from ortbatch.manifest import Manifest

from .conftest import cli, serve_embeddings, write_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.export]

pytest.importorskip("torch")
pytest.importorskip("optimum.exporters.onnx")
st_mod = pytest.importorskip("sentence_transformers")
pytest.importorskip("httpx")
pytest.importorskip("starlette")

PROMPTS = {"query": "query: ", "passage": "passage: "}
# name -> build_st's arguments
CHECKPOINTS: dict[str, dict[str, Any]] = {
    "cls": dict(pooling="cls", dense=((16, "Tanh"),), normalize=False, default_prompt_name="query"),
    "prompted": dict(pooling="mean", include_prompt=False, normalize=True, default_prompt_name="passage"),
}


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    """name -> (its export, the SentenceTransformer to compare with)."""
    from tests.embed.stmodels import build_base, build_st, export_transformer, make_export

    root = tmp_path_factory.mktemp("st")
    base = build_base("bert", root / "base")
    onnx = export_transformer(base, root / "onnx")
    out = {}
    for name, kwargs in CHECKPOINTS.items():
        st_dir = build_st(base, root / f"st-{name}", prompts=PROMPTS, **kwargs)
        export = make_export(onnx, st_dir, root / name)
        out[name] = (export, st_mod.SentenceTransformer(str(st_dir), device="cpu"))
    return out


def _embedded(export: Path, texts: list[str], tmp_path: Path) -> np.ndarray:
    """``texts`` through ``ortbatch run`` (windows of 5, JSONL), every row succeeding: the vectors."""
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in texts])
    summary = ortbatch.run(export, src, tmp_path / "out", window=5, output_format="jsonl", progress=False)
    assert summary.succeeded == len(texts)
    return np.array(
        [
            json.loads(x)["embedding"]
            for p in sorted((tmp_path / "out").glob("part-*"))
            for x in p.read_text().splitlines()
        ]
    )


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_rows_are_sentence_transformers_encode(exports: dict[str, tuple[Path, Any]], tmp_path: Path, name: str):
    from tests.embed.stmodels import TEXTS

    export, model = exports[name]
    texts = TEXTS * 2
    got = _embedded(export, texts, tmp_path)
    want = model.encode(texts)  # the default prompt, as encode applies it
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    norms = np.linalg.norm(got, axis=1)
    assert np.allclose(norms, 1.0, atol=1e-5) == CHECKPOINTS[name]["normalize"]  # not re-normalized by hand


def test_no_normalize_is_refused_where_the_pipeline_normalizes(
    exports: dict[str, tuple[Path, Any]], tmp_path: Path
) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "hello"}])
    with pytest.raises(InvalidInputError, match="normalizes inside its graph"):
        ortbatch.run(exports["prompted"][0], src, tmp_path / "out", normalize=False, progress=False)
    proc = cli(str(exports["prompted"][0]), str(src), "-o", str(tmp_path / "cli"), "--no-normalize")
    assert proc.returncode == 2 and "normalizes inside its graph" in proc.stderr and "Traceback" not in proc.stderr


def _line(custom_id: str, body: dict[str, Any]) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings", "body": body}


TEXTS3 = ["hello world", "the quick brown fox jumps over the lazy dog", "many callers"]
LINES = [
    _line("default", {"input": TEXTS3}),
    _line("passage", {"input": TEXTS3, "prompt_name": "passage"}),
    _line("prompt", {"input": "hello world", "prompt": "search: "}),
    _line("dims", {"input": TEXTS3, "dimensions": 8}),
    _line("int8", {"input": TEXTS3, "encoding_format": "int8"}),
    _line("ubinary", {"input": TEXTS3, "encoding_format": "ubinary", "dimensions": 8}),
    _line("b64", {"input": "hello", "encoding_format": "base64"}),
    _line("ids", {"input": [[2, 5, 6, 3]]}),
    _line("ids-prompt", {"input": [[2, 5, 6, 3]], "prompt_name": "query"}),
    _line("top-k", {"input": "hello", "top_k": 3}),
    _line("too-wide", {"input": "hello", "dimensions": 99}),
    _line("no-such-prompt", {"input": "hello", "prompt_name": "nope"}),
]


def test_batch_api_embedding_options_as_serve_and_sentence_transformers(
    exports: dict[str, tuple[Path, Any]], tmp_path: Path
) -> None:
    from sentence_transformers.util import quantize_embeddings

    from tests.embed.stmodels import CORPUS

    export, model = exports["cls"]
    src = write_jsonl(tmp_path / "batch.jsonl", LINES)
    summary = ortbatch.run(export, src, tmp_path / "out", window=5, progress=False)
    assert (summary.succeeded, summary.failed) == (8, 4)
    out = [json.loads(x) for p in sorted((tmp_path / "out").glob("part-*")) for x in p.read_text().splitlines()]
    errors = [json.loads(x) for x in (tmp_path / "out" / "_errors.jsonl").read_text().splitlines()]
    answers = {x["custom_id"]: x["response"] for x in out + errors}
    for line in LINES:
        status, served = serve_embeddings(export, line["body"])
        response = answers[line["custom_id"]]
        assert response["status_code"] == status, line["custom_id"]
        if status == 200:
            assert response["body"] == served, line["custom_id"]
        else:
            error, want = response["body"]["error"], served["error"]
            assert (error["message"], error["type"], error["param"]) == (want["message"], want["type"], want["param"])

    def vectors(custom_id: str) -> np.ndarray:
        return np.array([d["embedding"] for d in answers[custom_id]["body"]["data"]])

    np.testing.assert_allclose(vectors("default"), model.encode(TEXTS3), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(vectors("passage"), model.encode(TEXTS3, prompt_name="passage"), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(vectors("prompt"), model.encode(["hello world"], prompt="search: "), atol=1e-5)
    np.testing.assert_allclose(vectors("dims"), model.encode(TEXTS3, truncate_dim=8), rtol=1e-4, atol=1e-5)
    calibration = model.encode(CORPUS)
    want = quantize_embeddings(model.encode(TEXTS3), "int8", calibration_embeddings=calibration)
    assert np.abs(vectors("int8") - want).max() <= 1  # a bucket edge may round either way
    assert answers["ids-prompt"]["body"]["error"]["param"] == "prompt_name"
    assert answers["top-k"]["body"]["error"]["param"] == "top_k"


def test_decoder_embedder_rows_are_sentence_transformers_encode(tmp_path: Path) -> None:
    """A decoder embedder (GPT-2, last-token pooling, the prompt left out) takes position_ids
    besides input_ids and attention_mask; its rows are encode's, as ``ortbatch serve``'s."""
    from tests.embed.stmodels import TEXTS, build_base, build_st, export_transformer, make_export

    base = build_base("gpt2", tmp_path / "base")
    st_dir = build_st(
        base, tmp_path / "st", pooling="lasttoken", include_prompt=False, prompts=PROMPTS, default_prompt_name="query"
    )
    export = make_export(export_transformer(base, tmp_path / "onnx"), st_dir, tmp_path / "export")
    assert "position_ids" in Manifest.load(export).inputs
    texts = TEXTS * 2
    got = _embedded(export, texts, tmp_path)
    np.testing.assert_allclose(got, st_mod.SentenceTransformer(str(st_dir), device="cpu").encode(texts), atol=1e-5)
