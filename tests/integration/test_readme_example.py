"""The README's BatchedSession example (examples/embed_concurrently.py) runs and is right."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.export

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "embed_concurrently.py"


def test_example_matches_sentence_transformers(minilm_export):
    st = pytest.importorskip("sentence_transformers")
    spec = importlib.util.spec_from_file_location("embed_concurrently", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    texts = ["A man is eating food.", "The weather is lovely today, isn't it?", "ok", "Batching " * 30]
    got = module.embed_concurrently(str(minilm_export.directory), texts * 8, threads=16)
    ref = st.SentenceTransformer(minilm_export.manifest.source["model"], device="cpu").encode(texts)
    cos = (got[:4] * ref).sum(axis=1) / np.linalg.norm(ref, axis=1)
    assert cos.min() > 0.999, cos
    assert np.allclose(got[:4], got[4:8], atol=1e-5)  # same text, other batch company: same vector
