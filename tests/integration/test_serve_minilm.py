"""The server on the real MiniLM export: /v1/embeddings and text infer equal sentence-transformers."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.export


def test_embeddings_and_text_infer_match_sentence_transformers(minilm_export):
    st = pytest.importorskip("sentence_transformers")
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("starlette")
    from ortbatch.serve import BackgroundServer, ServedModel

    texts = ["A man is eating food.", "ok", "Someone in a gorilla costume is playing a set of drums."]
    ref = st.SentenceTransformer(minilm_export.manifest.source["model"], device="cpu").encode(texts)
    model = ServedModel.load(minilm_export.directory, name="minilm")
    with BackgroundServer(model) as srv, httpx.Client(base_url=srv.url, timeout=60) as client:
        r = client.post("/v1/embeddings", json={"model": "minilm", "input": texts})
        assert r.status_code == 200, r.text
        got = np.array([d["embedding"] for d in r.json()["data"]], dtype=np.float32)
        np.testing.assert_allclose(got, ref, atol=1e-4)
        body = {
            "inputs": [{"name": "text", "datatype": "BYTES", "shape": [3], "data": texts}],
            "outputs": [{"name": "sentence_embedding"}],
        }
        r = client.post("/v2/models/minilm/infer", json=body)
        assert r.status_code == 200, r.text
        out = r.json()["outputs"][0]
        emb = np.array(out["data"], dtype=np.float32).reshape(out["shape"])
        cos = (emb * ref).sum(axis=1) / (np.linalg.norm(emb, axis=1) * np.linalg.norm(ref, axis=1))
        assert cos.min() > 0.9999, cos
