"""The embedding API served: every pipeline, prompt, ``dimensions``, ``encoding_format`` and
``/embed_sparse`` equal to sentence-transformers' own (``encode``, ``truncate_dim``,
``prompt_name``, ``quantize_embeddings``, ``SparseEncoder``), over HTTP (the OpenAI route and
KServe v2 text) and gRPC, from one repository server of tiny checkpoints. The reference is
always sentence-transformers, never ortbatch's output.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("optimum.exporters.onnx")
st_mod = pytest.importorskip("sentence_transformers")
httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
grpcclient = pytest.importorskip("tritonclient.grpc")

from sentence_transformers.util import quantize_embeddings  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from ortbatch import export_model  # noqa: E402
from ortbatch.embed import Embedder  # noqa: E402
from ortbatch.serve import BackgroundServer, ServeConfig, ServedModel  # noqa: E402
from ortbatch.serve.served.repository import ModelRepository  # noqa: E402
from tests.embed.stmodels import CORPUS, TEXTS, build_splade, build_st, cosines  # noqa: E402

pytestmark = [pytest.mark.export, pytest.mark.slow, pytest.mark.timeout(1500)]
MIN_COSINE = 0.9999
REPO = Path(__file__).resolve().parents[2]
PROMPTS = {"query": "query: ", "passage": "passage: "}
# twelve texts of mixed lengths in one request: rows batched (max_batch_size 4) and padded together
BATCH = TEXTS * 2

# name -> (base kind, pooling, dense, normalize): every pooling mode, with and without Dense and Normalize
PIPELINES = {
    "bert-cls": ("bert", "cls", (), False),
    "bert-max": ("bert", "max", (), False),
    "bert-mean": ("bert", "mean", (), True),
    "bert-sqrt": ("bert", "mean_sqrt_len_tokens", (), False),
    "bert-wmean": ("bert", "weightedmean", (), False),
    "bert-last": ("bert", "lasttoken", (), False),
    "bert-cls-dense": ("bert", "cls", ((16, "Tanh"),), True),
    "bert-multi": ("bert", ("cls", "mean", "max"), ((24, "GELU"), (8, "Identity")), True),
    "gpt2-last": ("gpt2", "lasttoken", (), True),
    "gpt2-mean-dense": ("gpt2", "mean", ((16, "ReLU"),), False),
    "gpt2-wmean": ("gpt2", "weightedmean", (), True),
    "gpt2-cls": ("gpt2", "cls", (), False),
    "gpt2-max": ("gpt2", "max", ((16, "SiLU"),), True),
    "gpt2-sqrt": ("gpt2", "mean_sqrt_len_tokens", ((16, "Sigmoid"),), False),
}
# prompts left out of pooling, and a default prompt that applies when a request names none
PROMPTED = {
    "prompted": dict(kind="bert", pooling="cls", dense=((16, "Tanh"),), normalize=True, default="passage"),
    "gpt2-prompted": dict(kind="gpt2", pooling="lasttoken", dense=(), normalize=False, default="query"),
}


@dataclass
class Served:
    srv: BackgroundServer
    root: Path
    checkpoints: dict[str, Path]
    models: dict[str, Any]

    def st(self, name: str) -> Any:
        name = name.removesuffix("-hidden")
        if name not in self.models:
            cls = st_mod.SparseEncoder if name == "splade" else st_mod.SentenceTransformer
            self.models[name] = cls(str(self.checkpoints[name]), device="cpu")
        return self.models[name]


# every checkpoint exported again where sentence-transformers cannot be imported
_EXPORT_HIDDEN = textwrap.dedent(
    """
    import json, sys
    from tests.embed.stmodels import CORPUS, block_sentence_transformers
    block_sentence_transformers()
    from ortbatch import export_model
    for st_dir, out in zip(sys.argv[1::2], sys.argv[2::2]):
        assert export_model(st_dir, out, max_batch_size=4, samples=CORPUS).installed, out
        report = json.load(open(out + "/validation.json"))
        parity = next(c for c in report["checks"] if c["check"] == "reference_parity")
        print("LABELS", out, [case["label"] for case in parity["cases"]])
    """
)


def _checkpoints(bases: dict[str, tuple[Path, Path]], work: Path) -> dict[str, Path]:
    out = {}
    for name, (kind, pooling, dense, normalize) in PIPELINES.items():
        out[name] = build_st(bases[kind][0], work / name, pooling=pooling, dense=dense, normalize=normalize)
    for name, p in PROMPTED.items():
        out[name] = build_st(
            bases[p["kind"]][0],
            work / name,
            pooling=p["pooling"],
            include_prompt=False,
            dense=p["dense"],
            normalize=p["normalize"],
            prompts=PROMPTS,
            default_prompt_name=p["default"],
        )
    return out


@pytest.fixture(scope="module")
def served(bases: dict[str, tuple[Path, Path]], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """One repository server (HTTP and gRPC) of every tiny checkpoint, each exported by
    ``export_model`` (checked, calibrated on CORPUS) with sentence-transformers importable
    (``NAME``) and with it hidden (``NAME-hidden``)."""
    work = tmp_path_factory.mktemp("st-serve")
    root = work / "repository"
    root.mkdir()
    checkpoints = _checkpoints(bases, work / "st")
    for name, st_dir in checkpoints.items():
        assert export_model(st_dir, root / name, max_batch_size=4, samples=CORPUS).installed, name
    args = [str(x) for name, st_dir in checkpoints.items() for x in (st_dir, root / f"{name}-hidden")]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run(
        [sys.executable, "-c", _EXPORT_HIDDEN, *args], capture_output=True, text=True, env=env, timeout=900
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("sentence_embedding vs torch reference") == len(checkpoints), done.stdout
    checkpoints["splade"] = build_splade(work / "st" / "splade")
    assert export_model(checkpoints["splade"], root / "splade", max_batch_size=4).installed
    config = ServeConfig(port=0, grpc_port=0, access_log=False, log_level="warning", max_delay_ms=1.0)
    repo = ModelRepository(root=root, config=config)
    assert repo.load_all() == []
    with BackgroundServer(repo, config) as srv:
        yield Served(srv, root, checkpoints, {})


# -- the three transports --------------------------------------------------------------------


def openai(served: Served, model: str, texts: Any, **options: Any) -> tuple[np.ndarray, dict[str, Any]]:
    r = httpx.post(served.srv.url + "/v1/embeddings", json={"model": model, "input": texts, **options}, timeout=60)
    assert r.status_code == 200, r.text
    doc = r.json()
    assert [d["index"] for d in doc["data"]] == list(range(len(doc["data"])))
    if options.get("encoding_format") == "base64":
        rows = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in doc["data"]]
    else:
        rows = [np.array(d["embedding"]) for d in doc["data"]]
    return np.stack(rows), doc["usage"]


def _v2_body(texts: list[str], output: str, params: dict[str, Any]) -> dict[str, Any]:
    return {
        "inputs": [{"name": "text", "datatype": "BYTES", "shape": [len(texts)], "data": texts}],
        "outputs": [{"name": output}],
        "parameters": params,
    }


def kserve(served: Served, model: str, texts: list[str], output: str = "sentence_embedding", **params: Any) -> Any:
    body = _v2_body(texts, output, params)
    r = httpx.post(f"{served.srv.url}/v2/models/{model}_text/infer", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()["outputs"][0]
    return np.array(out["data"]).reshape(out["shape"]), out["datatype"]


def grpc(served: Served, model: str, texts: list[str], output: str = "sentence_embedding", **params: Any) -> Any:
    assert served.srv.grpc is not None
    with grpcclient.InferenceServerClient(served.srv.grpc.address) as client:
        t = grpcclient.InferInput("text", [len(texts)], "BYTES")
        t.set_data_from_numpy(np.array(texts, dtype=object))
        res = client.infer(
            f"{model}_text", [t], outputs=[grpcclient.InferRequestedOutput(output)], parameters=params or None
        )
        out = res.get_output(output)
        return res.as_numpy(output), out.datatype


# -- 1. every pipeline ---------------------------------------------------------------------------


@pytest.mark.parametrize("hidden", [False, True], ids=["st-importable", "st-hidden"])
@pytest.mark.parametrize("name", [*PIPELINES, *PROMPTED])
def test_every_pipeline_served_and_in_process_equals_encode(served, name, hidden):
    model = f"{name}-hidden" if hidden else name
    want = served.st(name).encode(BATCH, batch_size=4)
    with Embedder(served.root / model, max_batch_size=4) as emb:
        in_process = emb.encode(BATCH)
    for how, got in [
        ("openai", openai(served, model, BATCH)[0]),
        ("kserve", kserve(served, model, BATCH)[0]),
        ("grpc", grpc(served, model, BATCH)[0]),
        ("in process", in_process),
    ]:
        assert got.shape == want.shape, how
        assert cosines(got, want).min() >= MIN_COSINE, how
        # the pipeline's own vectors: no normalization the checkpoint does not do
        np.testing.assert_allclose(np.linalg.norm(got, axis=1), np.linalg.norm(want, axis=1), rtol=1e-3, err_msg=how)


# -- 3. prompts, dimensions, encodings -------------------------------------------------------------


def _tokens(model: Any, prompt: str, texts: list[str]) -> int:
    return sum(len(model.tokenizer(prompt + t)["input_ids"]) for t in texts)


@pytest.mark.parametrize("name", list(PROMPTED))
def test_prompts_and_the_default_prompt(served, name):
    model = served.st(name)
    default = PROMPTS[PROMPTED[name]["default"]]
    cases = [
        ({}, model.encode(BATCH), default),  # the checkpoint's default prompt, as encode applies it
        ({"prompt_name": "query"}, model.encode(BATCH, prompt_name="query"), PROMPTS["query"]),
        ({"prompt_name": "passage"}, model.encode(BATCH, prompt_name="passage"), PROMPTS["passage"]),
        ({"prompt": "many callers "}, model.encode(BATCH, prompt="many callers "), "many callers "),
    ]
    for options, want, prompt in cases:
        got, usage = openai(served, name, BATCH, **options)
        assert cosines(got, want).min() >= MIN_COSINE, options
        assert usage == {"prompt_tokens": _tokens(model, prompt, BATCH), "total_tokens": _tokens(model, prompt, BATCH)}
        assert cosines(kserve(served, name, BATCH, **options)[0], want).min() >= MIN_COSINE, options
        assert cosines(grpc(served, name, BATCH, **options)[0], want).min() >= MIN_COSINE, options
    # a prompt does change the vectors, so the checks above could fail
    assert cosines(openai(served, name, BATCH)[0], model.encode(BATCH, prompt="")).min() < 0.999
    # v2 metadata says what the parameters may name
    params = httpx.get(f"{served.srv.url}/v2/models/{name}_text").json()["parameters"]
    assert set(PROMPTS) <= set(params["prompt_names"]) and params["default_prompt_name"] == PROMPTED[name]["default"]
    assert params["embedding_output"] == "sentence_embedding"


FORMATS = ["float", "base64", "int8", "uint8", "binary", "ubinary"]


def _expected(model: Any, normalize: bool, dimensions: int | None, fmt: str) -> np.ndarray:
    """sentence-transformers: encode(truncate_dim=...) (normalized again when the pipeline
    normalizes, as ``dimensions`` is), then quantize_embeddings calibrated on the same
    encode of the export's calibration texts."""
    vecs = model.encode(BATCH, truncate_dim=dimensions, normalize_embeddings=normalize)
    if fmt in ("float", "base64"):
        return vecs
    cal = model.encode(CORPUS, truncate_dim=dimensions, normalize_embeddings=normalize)
    return quantize_embeddings(vecs, fmt, calibration_embeddings=cal)


def _assert_same(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.shape == want.shape, what
    if want.dtype.kind == "f":
        np.testing.assert_allclose(got, want, atol=2e-5, err_msg=what)
        return
    # the graph's float32 and torch's differ in the last bits: a value on a bucket edge (or
    # a sign of a value near 0) may fall either way, and no more than that
    same = got.astype(np.int64) == want.astype(np.int64)
    assert same.mean() >= 0.97, what
    if not what.endswith("binary"):
        assert np.abs(got.astype(np.int64) - want.astype(np.int64)).max() <= 1, what


@pytest.mark.parametrize("name", ["prompted", "gpt2-mean-dense"])
@pytest.mark.parametrize("dimensions", [None, 8])
def test_dimensions_and_encoding_formats(served, name, dimensions):
    model = served.st(name)
    normalize = name == "prompted"  # its pipeline ends in Normalize; the other's does not
    for fmt in FORMATS:
        want = _expected(model, normalize, dimensions, fmt)
        options: dict[str, Any] = {"encoding_format": fmt}
        if dimensions is not None:
            options["dimensions"] = dimensions
        got, _ = openai(served, name, BATCH, **options)
        _assert_same(got, want, f"openai {fmt}")
        if fmt == "base64":
            continue  # a JSON encoding only: v2 and gRPC send typed tensors
        for how, (out, datatype) in [
            ("kserve", kserve(served, name, BATCH, **options)),
            ("grpc", grpc(served, name, BATCH, **options)),
        ]:
            assert datatype == {"float": "FP32", "int8": "INT8", "uint8": "UINT8"}.get(fmt, datatype)
            _assert_same(out, want, f"{how} {fmt}")


def test_the_openai_client_round_trips(served):
    openai_mod = pytest.importorskip("openai")
    client = openai_mod.OpenAI(base_url=served.srv.url + "/v1", api_key="unused", max_retries=0)
    model = served.st("prompted")
    res = client.embeddings.create(model="prompted", input=BATCH, dimensions=8, encoding_format="base64")
    got = np.stack([np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in res.data])
    np.testing.assert_allclose(got, model.encode(BATCH, truncate_dim=8, normalize_embeddings=True), atol=2e-5)
    assert res.usage.prompt_tokens == _tokens(model, PROMPTS["passage"], BATCH)
    # without encoding_format the client asks for base64 itself and decodes it
    res = client.embeddings.create(model="prompted", input=BATCH[:3], dimensions=8)
    got = np.array([d.embedding for d in res.data])
    np.testing.assert_allclose(got, model.encode(BATCH[:3], truncate_dim=8, normalize_embeddings=True), atol=2e-5)
    with pytest.raises(openai_mod.BadRequestError, match="dimensions"):
        client.embeddings.create(model="prompted", input="x", dimensions=999)


# -- /embed (TEI) ----------------------------------------------------------------------------------


def tei(served: Served, model: str, inputs: Any, **options: Any) -> np.ndarray:
    r = httpx.post(served.srv.url + "/embed", json={"model": model, "inputs": inputs, **options}, timeout=60)
    assert r.status_code == 200, r.text
    return np.array(r.json())


def _normalizes(name: str) -> bool:
    return PIPELINES[name][3] if name in PIPELINES else PROMPTED[name]["normalize"]


@pytest.mark.parametrize(
    "name", ["bert-cls", "bert-mean", "bert-multi", "gpt2-mean-dense", "prompted", "gpt2-prompted"]
)
def test_tei_embed_equals_encode_normalized_and_normalize_false_its_own(served, name):
    model = served.st(name)
    # TEI's default, normalize true: encode(normalize_embeddings=True), the default prompt included
    want = model.encode(BATCH, normalize_embeddings=True)
    got = tei(served, name, BATCH)
    assert got.shape == want.shape and cosines(got, want).min() >= MIN_COSINE
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(
        tei(served, name, BATCH, dimensions=8),
        model.encode(BATCH, truncate_dim=8, normalize_embeddings=True),
        atol=2e-5,
    )
    assert tei(served, name, BATCH[0]).shape == (1, want.shape[1])  # one text in, one vector out
    if name in PROMPTED:
        want = model.encode(BATCH, prompt_name="query", normalize_embeddings=True)
        assert cosines(tei(served, name, BATCH, prompt_name="query"), want).min() >= MIN_COSINE
    own = model.encode(BATCH)
    if _normalizes(name):
        # TEI skips the Normalize module, so its false means un-normalized: not this model's to give
        r = httpx.post(served.srv.url + "/embed", json={"model": name, "inputs": BATCH, "normalize": False})
        assert r.status_code == 400 and "'normalize': false cannot be honoured" in r.json()["error"]
    else:
        assert np.abs(np.linalg.norm(own, axis=1) - 1).max() > 0.05  # so the check below can fail
        got = tei(served, name, BATCH, normalize=False)
        assert cosines(got, own).min() >= MIN_COSINE
        np.testing.assert_allclose(np.linalg.norm(got, axis=1), np.linalg.norm(own, axis=1), rtol=1e-3)


_HUB_CLIENT = textwrap.dedent(
    """
    import json, sys
    from huggingface_hub import InferenceClient
    client = InferenceClient(model=sys.argv[1])
    unit = client.feature_extraction(sys.argv[2])
    raw = client.feature_extraction(sys.argv[2], normalize=False, truncate=True, truncation_direction="Right")
    print(json.dumps({"unit": unit.tolist(), "raw": raw.tolist()}))
    """
)


def test_huggingface_hubs_client_reads_embed_as_it_reads_tei(served):
    pytest.importorskip("huggingface_hub")
    model = served.st("bert-cls")  # no Normalize module: normalize true and false differ
    # TEI's clients send no model field: one model served alone, as `ortbatch serve DIR` does
    alone = ServedModel.load(served.root / "bert-cls", name="bert-cls")
    with BackgroundServer(alone, ServeConfig(port=0, access_log=False, log_level="warning")) as srv:
        # HF_HUB_OFFLINE=1 (or TRANSFORMERS_OFFLINE=1, the suite's) stops the client from calling
        # any URL, this 127.0.0.1 server's included: it runs without them (it calls nothing else)
        env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
        done = subprocess.run(
            [sys.executable, "-c", _HUB_CLIENT, srv.url + "/embed", BATCH[1]],
            capture_output=True, text=True, env=env, timeout=120,
        )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    unit, raw = np.array(out["unit"]), np.array(out["raw"])
    assert unit.shape == (1, model.encode(BATCH[:1]).shape[1])
    assert cosines(unit, model.encode(BATCH[1:2], normalize_embeddings=True)).min() >= MIN_COSINE
    np.testing.assert_allclose(np.linalg.norm(raw), np.linalg.norm(model.encode(BATCH[1])), rtol=1e-3)


# -- /embed_sparse ---------------------------------------------------------------------------------


def _sparse(rows: list[list[dict[str, Any]]], width: int) -> np.ndarray:
    out = np.zeros((len(rows), width), dtype=np.float32)
    for i, row in enumerate(rows):
        idx = [e["index"] for e in row]
        assert idx == sorted(idx), "vocabulary order"
        out[i, idx] = [e["value"] for e in row]
    return out


def test_embed_sparse_equals_sparse_encoder(served):
    model = served.st("splade")
    dense = model.encode(BATCH, convert_to_tensor=True).to_dense().numpy()
    width = dense.shape[1]
    url = served.srv.url + "/embed_sparse"
    r = httpx.post(url, json={"inputs": BATCH}, timeout=60)
    assert r.status_code == 200, r.text
    got = _sparse(r.json(), width)
    np.testing.assert_array_equal(got != 0, dense != 0)
    np.testing.assert_allclose(got, dense, rtol=1e-4, atol=1e-6)
    one = httpx.post(url, json={"inputs": BATCH[1], "truncate": True}, timeout=60).json()
    assert len(one) == 1  # TEI: a list per input, for one string too
    np.testing.assert_allclose(_sparse(one, width)[0], dense[1], rtol=1e-4, atol=1e-6)
    top = model.encode(BATCH, max_active_dims=5, convert_to_tensor=True).to_dense().numpy()
    r = httpx.post(url, json={"inputs": BATCH, "top_k": 5}, timeout=60)
    np.testing.assert_allclose(_sparse(r.json(), width), top, rtol=1e-4, atol=1e-6)
    r = httpx.post(url, json={"inputs": BATCH, "threshold": 0.15}, timeout=60)
    np.testing.assert_allclose(_sparse(r.json(), width), np.where(dense > 0.15, dense, 0), rtol=1e-4, atol=1e-6)
    # KServe v2 and gRPC: the dense sparse_embedding output, top_k as a parameter
    for how, (out, _) in [
        ("kserve", kserve(served, "splade", BATCH, output="sparse_embedding")),
        ("grpc", grpc(served, "splade", BATCH, output="sparse_embedding")),
    ]:
        np.testing.assert_allclose(out, dense, rtol=1e-4, atol=1e-6, err_msg=how)
    for how, (out, _) in [
        ("kserve", kserve(served, "splade", BATCH, output="sparse_embedding", top_k=5)),
        ("grpc", grpc(served, "splade", BATCH, output="sparse_embedding", top_k=5)),
    ]:
        np.testing.assert_allclose(out, top, rtol=1e-4, atol=1e-6, err_msg=how)


def test_the_answers_match_the_openapi_document(served):
    """The server's /openapi.json describes the new fields' answers (checked with jsonschema)."""
    jsonschema = pytest.importorskip("jsonschema")
    referencing = pytest.importorskip("referencing")
    from referencing.jsonschema import DRAFT202012

    doc = httpx.get(served.srv.url + "/openapi.json").json()
    registry = referencing.Registry().with_resource("urn:doc", referencing.Resource(doc, DRAFT202012))

    def errors(schema: str, answer: Any) -> list[Any]:
        ref = {"$ref": f"urn:doc#/components/schemas/{schema}"}
        return list(jsonschema.Draft202012Validator(ref, registry=registry).iter_errors(answer))

    for fmt in ("float", "base64", "int8", "ubinary"):
        body = {"model": "prompted", "input": TEXTS, "dimensions": 8, "encoding_format": fmt, "prompt_name": "query"}
        assert errors("EmbeddingRequest", body) == []
        answer = httpx.post(served.srv.url + "/v1/embeddings", json=body).json()
        assert errors("EmbeddingResponse", answer) == [], fmt
    body = {"model": "splade", "inputs": TEXTS, "top_k": 4}
    assert errors("EmbedSparseRequest", body) == []
    answer = httpx.post(served.srv.url + "/embed_sparse", json=body).json()
    assert errors("EmbedSparseResponse", answer) == []
    assert errors("EmbedSparseResponse", [{"index": 1}])  # the check can fail


# -- bad values ------------------------------------------------------------------------------------


BAD = [
    ({"dimensions": 0}, "dimensions"),
    ({"dimensions": 999}, "dimensions"),
    ({"dimensions": "8"}, "dimensions"),
    ({"prompt_name": "nope"}, "prompt_name"),
    ({"prompt": 3}, "prompt"),
    ({"encoding_format": "int4"}, "encoding_format"),
    ({"top_k": 3}, "top_k"),
]


@pytest.mark.parametrize(("options", "field"), BAD)
def test_bad_values_are_400s_naming_the_field(served, options, field):
    r = httpx.post(served.srv.url + "/v1/embeddings", json={"model": "prompted", "input": "x", **options})
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"]
    r = httpx.post(
        served.srv.url + "/v2/models/prompted_text/infer", json=_v2_body(["x"], "sentence_embedding", options)
    )
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]
    assert served.srv.grpc is not None
    with grpcclient.InferenceServerClient(served.srv.grpc.address) as client:
        t = grpcclient.InferInput("text", [1], "BYTES")
        t.set_data_from_numpy(np.array(["x"], dtype=object))
        with pytest.raises(InferenceServerException) as err:
            client.infer("prompted_text", [t], parameters=options)
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert field in err.value.message()


@pytest.mark.parametrize(
    ("path", "body", "status", "says"),
    [
        ("/v1/embeddings", {"model": "prompted", "input": [[5, 6]], "prompt_name": "query"}, 400, "prompt_name"),
        (
            "/v2/models/prompted_text/infer",
            _v2_body(["x"], "sentence_embedding", {"encoding_format": "base64"}),
            400,
            "encoding_format",
        ),
        ("/v1/embeddings", {"model": "splade", "input": "x"}, 400, "/embed_sparse"),  # a repository: 400
        ("/embed_sparse", {"model": "prompted", "inputs": "x"}, 400, "not a sparse"),
        ("/embed_sparse", {"model": "splade", "inputs": "x", "dimensions": 4}, 400, "dimensions"),
        ("/embed_sparse", {"model": "splade", "inputs": "x", "top_k": 0}, 400, "top_k"),
        ("/embed_sparse", {"model": "splade", "inputs": "x", "threshold": "high"}, 400, "threshold"),
        # an unknown field is named before a required one is found missing (then: the missing one)
        ("/embed_sparse", {"model": "splade", "texts": "x"}, 400, "Unrecognized request argument supplied: texts"),
        ("/embed_sparse", {"model": "splade"}, 400, "inputs"),
    ],
)
def test_what_a_model_cannot_answer(served, path, body, status, says):
    r = httpx.post(served.srv.url + path, json=body)
    assert r.status_code == status, r.text
    assert says in r.text
