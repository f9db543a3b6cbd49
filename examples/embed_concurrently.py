"""Many threads, one model: sentence embeddings through a BatchedSession.

    python examples/embed_concurrently.py exports/minilm

Each thread sends one sentence; BatchedSession pads and stacks whatever is queued
into one ONNX Runtime run and hands each thread back exactly its own rows.
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from tokenizers import Tokenizer

from ortbatch import BatchedSession


def embed_concurrently(export_dir: str, sentences: list[str], threads: int = 32) -> np.ndarray:
    tokenizer = Tokenizer.from_file(f"{export_dir}/tokenizer.json")
    tokenizer.no_padding()  # one request = one text at its own length; batching pads later
    with BatchedSession(export_dir) as session:  # reads ortbatch.json: pads, axes, limits

        def embed(text: str) -> np.ndarray:
            enc = tokenizer.encode(text)
            ids = np.array([enc.ids], dtype=np.int64)
            mask = np.array([enc.attention_mask], dtype=np.int64)
            feed = {"input_ids": ids, "attention_mask": mask}
            if "token_type_ids" in session.input_names:
                feed["token_type_ids"] = np.zeros_like(ids)
            if "sentence_embedding" in session.output_names:  # sentence-transformers export
                (vec,) = session.run(["sentence_embedding"], feed)  # this request's row only
                vec = vec[0]
            else:  # plain transformers export: mean-pool the tokens (padding was trimmed off)
                (hidden,) = session.run(["last_hidden_state"], feed)
                vec = hidden[0].mean(axis=0)
            return vec / np.linalg.norm(vec)

        with ThreadPoolExecutor(threads) as pool:
            vectors = list(pool.map(embed, sentences))
        print(f"{len(sentences)} requests in {session.stats().batches} batches")
    return np.stack(vectors)


if __name__ == "__main__":
    export_dir = sys.argv[1] if len(sys.argv) > 1 else "exports/minilm"
    texts = ["A man is eating food.", "A man is riding a horse.", "Someone is eating a meal."] * 20
    emb = embed_concurrently(export_dir, texts)
    print("similarity(eating, eating a meal) =", round(float(emb[0] @ emb[2]), 3))
