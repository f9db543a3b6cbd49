"""The embedding options through ``ortbatch serve --repository ROOT --frontends 2`` (a
subprocess, as users run it) and through a Ray replica's app: ``dimensions``,
``prompt_name``, ``encoding_format`` and ``/embed_sparse`` over HTTP and gRPC equal to
sentence-transformers, with the checkpoints' default prompt applied."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("optimum.exporters.onnx")
st_mod = pytest.importorskip("sentence_transformers")
grpcclient = pytest.importorskip("tritonclient.grpc")

from sentence_transformers.util import quantize_embeddings  # noqa: E402

from tests.embed.stmodels import (  # noqa: E402
    CORPUS,
    TEXTS,
    build_base,
    build_splade,
    build_st,
    cosines,
    export_transformer,
    make_export,
)

pytestmark = [pytest.mark.slow, pytest.mark.export, pytest.mark.timeout(300)]
PROMPTS = {"query": "query: ", "passage": "passage: "}


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    """A repository of a prompted CLS+Dense+Normalize checkpoint and a SPLADE one."""
    from ortbatch import export_model

    work = tmp_path_factory.mktemp("embed-frontends")
    base = build_base("bert", work / "base")
    onnx_path = export_transformer(base, work / "onnx")
    root = work / "repository"
    root.mkdir()
    prompted = build_st(
        base,
        work / "st-prompted",
        pooling="cls",
        include_prompt=False,
        dense=((16, "Tanh"),),
        normalize=True,
        prompts=PROMPTS,
        default_prompt_name="passage",
    )
    make_export(onnx_path, prompted, root / "prompted", max_batch_size=8)
    splade = build_splade(work / "st-splade")
    assert export_model(splade, root / "splade", max_batch_size=8).installed
    return root, {"prompted": prompted, "splade": splade}


def _check_options(url: str, grpc_address: str | None, checkpoints: dict[str, Path]) -> None:
    model = st_mod.SentenceTransformer(str(checkpoints["prompted"]), device="cpu")
    texts = TEXTS * 2
    with httpx.Client(base_url=url, timeout=60) as client:
        r = client.post("/v1/embeddings", json={"model": "prompted", "input": texts})
        assert r.status_code == 200, r.text
        got = np.array([d["embedding"] for d in r.json()["data"]])
        assert cosines(got, model.encode(texts)).min() >= 0.9999  # the default prompt, as encode applies it
        body = {"model": "prompted", "input": texts, "prompt_name": "query", "dimensions": 8, "encoding_format": "int8"}
        r = client.post("/v1/embeddings", json=body)
        assert r.status_code == 200, r.text
        got = np.array([d["embedding"] for d in r.json()["data"]])
        vecs = model.encode(texts, prompt_name="query", truncate_dim=8, normalize_embeddings=True)
        cal = model.encode(CORPUS, truncate_dim=8, normalize_embeddings=True)
        want = quantize_embeddings(vecs, "int8", calibration_embeddings=cal)
        assert np.abs(got - want).max() <= 1 and (got == want).mean() >= 0.97
        tokens = sum(len(model.tokenizer(PROMPTS["query"] + t)["input_ids"]) for t in texts)
        assert r.json()["usage"]["prompt_tokens"] == tokens
        r = client.post("/v1/embeddings", json={"model": "prompted", "input": "x", "dimensions": 99})
        assert r.status_code == 400 and "dimensions" in r.json()["error"]["message"]
        v2 = {
            "inputs": [{"name": "text", "datatype": "BYTES", "shape": [len(texts)], "data": texts}],
            "outputs": [{"name": "sentence_embedding"}],
            "parameters": {"prompt_name": "query", "dimensions": 8},
        }
        r = client.post("/v2/models/prompted_text/infer", json=v2)
        assert r.status_code == 200, r.text
        out = r.json()["outputs"][0]
        np.testing.assert_allclose(np.array(out["data"]).reshape(out["shape"]), vecs, atol=2e-5)
        sparse = st_mod.SparseEncoder(str(checkpoints["splade"]), device="cpu")
        top = sparse.encode(texts, max_active_dims=5, convert_to_tensor=True).to_dense().numpy()
        r = client.post("/embed_sparse", json={"model": "splade", "inputs": texts, "top_k": 5})
        assert r.status_code == 200, r.text
        got = np.zeros_like(top)
        for i, row in enumerate(r.json()):
            got[i, [e["index"] for e in row]] = [e["value"] for e in row]
        np.testing.assert_allclose(got, top, rtol=1e-4, atol=1e-6)
    if grpc_address is None:
        return
    with grpcclient.InferenceServerClient(grpc_address) as gclient:
        t = grpcclient.InferInput("text", [len(texts)], "BYTES")
        t.set_data_from_numpy(np.array(texts, dtype=object))
        res = gclient.infer("prompted_text", [t], parameters={"encoding_format": "ubinary", "prompt_name": "query"})
        want = quantize_embeddings(model.encode(texts, prompt_name="query"), "ubinary")
        assert (res.as_numpy("sentence_embedding") == want).mean() >= 0.97


def test_options_through_a_repository_and_two_front_ends(serve_process: Any, repo: tuple[Path, dict[str, Path]]):
    root, checkpoints = repo
    srv = serve_process("--repository", str(root), "--frontends", "2", "--grpc-port", "0", "--no-access-log")
    grpc_address = re.search(r"gRPC on (\S+)\)", srv.text())
    assert grpc_address, srv.text()
    for _ in range(2):  # connections are dealt to the front ends in turn: both answer
        _check_options(srv.url, grpc_address.group(1), checkpoints)


def test_options_through_a_ray_replicas_app(repo: tuple[Path, dict[str, Path]]):
    """``ortbatch.ray`` builds each replica's app with the same loader and app as
    ``ortbatch serve``: the options reach it (the replica's ASGI app, run here without a
    Ray cluster)."""
    import asyncio

    pytest.importorskip("ray")
    from ortbatch.ray import load_replica_app
    from ortbatch.serve import ServeConfig

    root, checkpoints = repo
    config = ServeConfig(port=0, access_log=False, log_level="warning")
    model = st_mod.SentenceTransformer(str(checkpoints["prompted"]), device="cpu")
    want = model.encode(TEXTS, prompt_name="query", truncate_dim=8, normalize_embeddings=True)

    async def ask(app: Any, path: str, body: dict[str, Any]) -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://replica") as client:
            return await client.post(path, json=body)

    served, app = load_replica_app(str(root / "prompted"), config, 1.0, "replica-0")
    try:
        body = {"input": TEXTS, "prompt_name": "query", "dimensions": 8}
        r = asyncio.run(ask(app, "/v1/embeddings", body))
        assert r.status_code == 200, r.text
        np.testing.assert_allclose(np.array([d["embedding"] for d in r.json()["data"]]), want, atol=2e-5)
    finally:
        served.close()
    served, app = load_replica_app(str(root / "splade"), config, 1.0, "replica-1")
    try:
        r = asyncio.run(ask(app, "/embed_sparse", {"inputs": TEXTS, "top_k": 3}))
        assert r.status_code == 200, r.text
        assert [len(row) for row in r.json()] == [3] * len(TEXTS)
    finally:
        served.close()
