"""Tiny exports for the ``ortbatch run`` tests, built offline (no torch): the serve tests'
feature-extraction encoder (WordLevel tokenizer, ``max_sequence_length`` 16), and a
"poisoned" copy whose embedding table is two rows short of the vocabulary, so a text
holding one of the last two words makes ONNX Runtime fail on that row (a row the model
rejects)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.signals import sigint_default

pytest.importorskip("tokenizers")
pytest.importorskip("onnx")
pytest.importorskip("pyarrow")

from tests.serve.tinymodels import CORPUS, build_encoder

REPO = Path(__file__).resolve().parents[2]
WORDS = sorted({w for line in CORPUS for w in line.split()})


@pytest.fixture(scope="session")
def encoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_encoder(tmp_path_factory.mktemp("bulk") / "tiny-encoder", max_batch_size=4)


@pytest.fixture(scope="session")
def poisoned(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """An export whose model fails on the returned words (ids past its table)."""
    import onnx
    from onnx import numpy_helper
    from tokenizers import Tokenizer

    d = build_encoder(tmp_path_factory.mktemp("bulk") / "poisoned", max_batch_size=4)
    model = onnx.load(str(d / "model.onnx"))
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    vocab = tok.get_vocab_size()
    for i, init in enumerate(model.graph.initializer):
        if init.name == "table":
            table = numpy_helper.to_array(init)[: vocab - 2]
            model.graph.initializer[i].CopyFrom(numpy_helper.from_array(table, "table"))
    onnx.save(model, str(d / "model.onnx"))
    bad = [tok.id_to_token(vocab - 1), tok.id_to_token(vocab - 2)]
    return d, bad


def mixed_texts(n: int, seed: int = 0, longest: int = 14) -> list[str]:
    """``n`` texts of 1..``longest`` words (so 3..16 tokens with [CLS]/[SEP]), shuffled lengths."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, longest))) for _ in range(n)]


def write_jsonl(path: Path, docs: list[Any]) -> Path:
    with open(path, "wb") as f:
        for d in docs:
            f.write(d if isinstance(d, bytes) else json.dumps(d).encode())
            f.write(b"\n")
    return path


def alone(export: Path, texts: list[str]) -> list[np.ndarray]:
    """Each text through BatchedSession by itself (tokenized by the tokenizers library),
    mean-pooled over its tokens and L2-normalized: the reference a bulk row must equal."""
    from tokenizers import Tokenizer

    from ortbatch import BatchedSession

    tok = Tokenizer.from_file(str(export / "tokenizer.json"))
    out = []
    with BatchedSession(export) as bs:
        for t in texts:
            ids = np.array([tok.encode(t).ids], dtype=np.int64)
            (h,) = bs.run(["last_hidden_state"], {"input_ids": ids, "attention_mask": np.ones_like(ids)})
            v = h[0].mean(axis=0)
            out.append(v / np.linalg.norm(v))
    return out


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``ortbatch run ...`` in a fresh process (a real one, to SIGKILL)."""
    import os

    full = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "ortbatch.cli", "run", *args, "--quiet"],
        env=full,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        preexec_fn=sigint_default,  # the Ctrl-C tests' child must take SIGINT however the suite was started
    )


def output_bytes(out: Path) -> dict[str, bytes]:
    """What a run leaves as its result: the part files and the errors file."""
    names = [*sorted(p.name for p in out.iterdir() if p.name.startswith("part-")), "_errors.jsonl"]
    return {n: (out / n).read_bytes() for n in names}


def serve_embeddings(export: Path, body: dict[str, Any], truncate: bool = False) -> tuple[int, Any]:
    """What ``ortbatch serve``'s ``/v1/embeddings`` answers ``body`` (status, JSON), in process
    (``truncate``: served with ``--truncate``)."""
    import asyncio

    import httpx

    from ortbatch.serve import ServedModel, create_app

    model = ServedModel.load(export, name=export.name, truncate=truncate)
    app = create_app(model)

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post("/v1/embeddings", json={k: v for k, v in body.items() if k != "model"})

    try:
        r = asyncio.run(go())
    finally:
        model.close()
    return r.status_code, r.json()
