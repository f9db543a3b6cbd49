"""Many threads, one model: sentence embeddings through an Embedder.

    python examples/embed_concurrently.py exports/minilm

Each thread sends one sentence; the Embedder's BatchedSession pads and stacks whatever is
queued into one ONNX Runtime run and hands each thread back exactly its own row. The
pooling, Dense layers and normalization are the checkpoint's own (in the exported graph,
recorded in ortbatch.json): nothing is pooled by hand here.
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ortbatch.embed import Embedder


def embed_concurrently(export_dir: str, sentences: list[str], threads: int = 32) -> np.ndarray:
    with Embedder(export_dir) as embedder:  # reads ortbatch.json: pipeline, pads, axes, limits

        def embed(text: str) -> np.ndarray:
            return embedder.encode([text])[0]

        with ThreadPoolExecutor(threads) as pool:
            vectors = list(pool.map(embed, sentences))
        print(f"{len(sentences)} requests in {embedder.session.stats().batches} batches")
    return np.stack(vectors)


if __name__ == "__main__":
    export_dir = sys.argv[1] if len(sys.argv) > 1 else "exports/minilm"
    texts = ["A man is eating food.", "A man is riding a horse.", "Someone is eating a meal."] * 20
    emb = embed_concurrently(export_dir, texts)
    print("similarity(eating, eating a meal) =", round(float(emb[0] @ emb[2]), 3))
