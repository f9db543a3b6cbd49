"""Acceptance 1 and 2 of the model repository: one server on the real MiniLM, a tiny
cross-encoder, a tiny sequence classifier and a tiny GPT-2, driven by the standard clients
at once (tritonclient, openai, plain HTTP), every answer checked against transformers /
sentence-transformers; and a client that knows only the metadata."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = [pytest.mark.export, pytest.mark.timeout(900)]

TEXTS = [
    "A man is eating food.",
    "ok",
    "Someone in a gorilla costume is playing a set of drums.",
    "The quick brown fox jumps over the lazy dog.",
    "Batching many callers into one run",
    "hello world",
]
QUERY = "what is the man eating?"
PROMPTS = ["Once upon a time", "The model pads short rows", "hello"]
CLIENTS_PER_MODEL = 16
REQUESTS_PER_CLIENT = 32  # 4 models x 16 clients x 32 = 2048 requests


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    return float((a * b).sum() / (np.linalg.norm(a) * np.linalg.norm(b)))


def metadata_client_infer(client: Any, name: str, text: str, tokenizer: Any) -> dict[str, np.ndarray]:
    """A generic v2 client: it reads the model's metadata and sends one tensor for every
    input listed there, with the listed datatype (BYTES: the text; integer tensors: the
    column of that name from the tokenizer)."""
    from tritonclient.http import InferInput
    from tritonclient.utils import triton_to_np_dtype

    meta = client.get_model_metadata(name)
    enc = tokenizer.encode(text)
    columns = {"input_ids": enc.ids, "attention_mask": enc.attention_mask, "token_type_ids": enc.type_ids}
    inputs = []
    for spec in meta["inputs"]:
        if spec["datatype"] == "BYTES":
            value = np.array([[text.encode()]], dtype=object)
        else:
            value = np.array([columns[spec["name"]]], dtype=triton_to_np_dtype(spec["datatype"]))
        inp = InferInput(spec["name"], list(value.shape), spec["datatype"])
        inp.set_data_from_numpy(value)
        inputs.append(inp)
    result = client.infer(name, inputs)
    return {o["name"]: result.as_numpy(o["name"]) for o in meta["outputs"]}


def test_one_server_many_models_every_client_concurrently(minilm_export, exported, tiny_model):
    st = pytest.importorskip("sentence_transformers")
    openai = pytest.importorskip("openai")
    httpx = pytest.importorskip("httpx")
    httpclient = pytest.importorskip("tritonclient.http")
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    from ortbatch.serve import BackgroundServer, ServeConfig
    from ortbatch.serve.served.repository import ModelRepository

    rerank, cls, gpt = exported("bert-rerank"), exported("bert-cls"), exported("gpt2")
    for res in (rerank, cls, gpt):
        assert res.report.passed, res.report.format_table(verbose=True)

    # -- references, computed once ---------------------------------------------------------
    ref_emb = st.SentenceTransformer(minilm_export.manifest.source["model"], device="cpu").encode(TEXTS)
    hf_tok = AutoTokenizer.from_pretrained(tiny_model("bert-rerank"))
    with torch.no_grad():
        rr_model = AutoModelForSequenceClassification.from_pretrained(tiny_model("bert-rerank")).eval()
        ref_rerank = np.array([rr_model(**hf_tok(QUERY, t, return_tensors="pt")).logits[0, 0].item() for t in TEXTS])
        ref_rr_single = np.stack([rr_model(**hf_tok(t, return_tensors="pt")).logits[0].numpy() for t in TEXTS])
        cls_model = AutoModelForSequenceClassification.from_pretrained(tiny_model("bert-cls")).eval()
        ref_cls = np.stack([cls_model(**hf_tok(t, return_tensors="pt")).logits[0].numpy() for t in TEXTS])
        gpt_tok = AutoTokenizer.from_pretrained(tiny_model("gpt2"))
        gpt_model = AutoModelForCausalLM.from_pretrained(tiny_model("gpt2")).eval()
        ref_text = []
        for p in PROMPTS:
            ids = gpt_tok(p, return_tensors="pt").input_ids
            out = gpt_model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False, pad_token_id=0
            )
            ref_text.append(gpt_tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    id2label = cls_model.config.id2label
    tok_minilm = Tokenizer.from_file(str(Path(minilm_export.directory) / "tokenizer.json"))
    tok_cls = Tokenizer.from_file(str(Path(cls.directory) / "tokenizer.json"))

    config = ServeConfig(port=0, access_log=False, log_level="warning", max_batch_size=16)
    models = [("minilm", minilm_export.directory), ("rerank", rerank.directory), ("cls", cls.directory)]
    repo = ModelRepository([*models, ("gpt2", gpt.directory)], config=config)
    assert repo.load_all() == []

    with BackgroundServer(repo, config) as srv:
        host = srv.url.removeprefix("http://")
        triton = httpclient.InferenceServerClient(host)
        index = {m["name"]: m["state"] for m in triton.get_model_repository_index()}
        assert {k: index[k] for k in ("minilm", "rerank", "cls", "gpt2")} == dict.fromkeys(
            ("minilm", "rerank", "cls", "gpt2"), "READY"
        )
        assert triton.is_server_ready() and all(triton.is_model_ready(n) for n in ("minilm", "rerank", "cls"))

        # Acceptance 2: a metadata-driven client on the tensor model and on the text model
        for i, text in enumerate(TEXTS[:3]):
            tensor = metadata_client_infer(triton, "minilm", text, tok_minilm)["sentence_embedding"]
            by_text = metadata_client_infer(triton, "minilm_text", text, tok_minilm)["sentence_embedding"]
            assert _cos(tensor[0], ref_emb[i]) > 0.9999 and _cos(by_text[0], ref_emb[i]) > 0.9999
            logits = metadata_client_infer(triton, "cls", text, tok_cls)["logits"]
            np.testing.assert_allclose(logits[0], ref_cls[i], atol=1e-4)
            logits = metadata_client_infer(triton, "rerank_text", text, tok_cls)["logits"]
            np.testing.assert_allclose(logits[0], ref_rr_single[i], atol=1e-4)
        triton.close()

        errors: list[str] = []
        counts = {"minilm": 0, "rerank": 0, "cls": 0, "gpt2": 0}
        lock = threading.Lock()

        def check(ok: bool, what: str) -> None:
            if not ok:
                with lock:
                    errors.append(what)

        def minilm_client(c: int) -> None:
            oa = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
            tc = httpclient.InferenceServerClient(host)
            try:
                for j in range(REQUESTS_PER_CLIENT):
                    i = (c + j) % len(TEXTS)
                    if j % 2 == 0:
                        got = oa.embeddings.create(model="minilm", input=[TEXTS[i]]).data[0].embedding
                        emb = np.array(got)
                    else:
                        emb = metadata_client_infer(tc, "minilm_text", TEXTS[i], tok_minilm)["sentence_embedding"][0]
                    check(_cos(emb, ref_emb[i]) > 0.9999, f"minilm {i}: cosine {_cos(emb, ref_emb[i])}")
            finally:
                tc.close()
                oa.close()

        def rerank_client(c: int) -> None:
            with httpx.Client(base_url=srv.url, timeout=120) as h:
                for j in range(REQUESTS_PER_CLIENT):
                    docs = [TEXTS[(c + j + k) % len(TEXTS)] for k in range(3)]
                    want = np.array([ref_rerank[TEXTS.index(d)] for d in docs])
                    r = h.post("/v1/rerank", json={"model": "rerank", "query": QUERY, "documents": docs})
                    if r.status_code != 200:
                        check(False, f"rerank: {r.status_code} {r.text}")
                        continue
                    results = r.json()["results"]
                    order = list(np.argsort(-want, kind="stable"))
                    check([x["index"] for x in results] == order, f"rerank order {results} vs {want}")
                    got = np.array([x["relevance_score"] for x in sorted(results, key=lambda x: x["index"])])
                    check(np.allclose(got, 1 / (1 + np.exp(-want)), atol=1e-4), f"rerank scores {got} vs {want}")

        def cls_client(c: int) -> None:
            with httpx.Client(base_url=srv.url, timeout=120) as h:
                for j in range(REQUESTS_PER_CLIENT):
                    idx = [(c + j) % len(TEXTS), (c + 2 * j + 1) % len(TEXTS)]
                    r = h.post("/v1/classify", json={"model": "cls", "input": [TEXTS[i] for i in idx]})
                    if r.status_code != 200:
                        check(False, f"cls: {r.status_code} {r.text}")
                        continue
                    for item, i in zip(r.json()["data"], idx, strict=True):
                        want = _softmax(ref_cls[i])
                        check(np.allclose(item["probs"], want, atol=1e-4), f"cls {i}: {item['probs']} vs {want}")
                        check(item["label"] == id2label[int(want.argmax())], f"cls label {item['label']}")

        def gpt_client(c: int) -> None:
            oa = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
            try:
                for j in range(REQUESTS_PER_CLIENT):
                    i = (c + j) % len(PROMPTS)
                    out = oa.completions.create(model="gpt2", prompt=PROMPTS[i], max_tokens=4, temperature=0)
                    check(out.choices[0].text == ref_text[i], f"gpt2 {i}: {out.choices[0].text!r} vs {ref_text[i]!r}")
            finally:
                oa.close()

        def run(kind: str, fn: Any, c: int) -> None:
            try:
                fn(c)
            except Exception as exc:  # collected, asserted in the main thread
                check(False, f"{kind} client {c}: {exc!r}")
            with lock:
                counts[kind] += 1

        clients = {"minilm": minilm_client, "rerank": rerank_client, "cls": cls_client, "gpt2": gpt_client}
        with ThreadPoolExecutor(max_workers=len(clients) * CLIENTS_PER_MODEL) as pool:
            futures = [pool.submit(run, kind, fn, c) for c in range(CLIENTS_PER_MODEL) for kind, fn in clients.items()]
            for f in futures:
                f.result(timeout=600)
        assert not errors, errors[:5]
        assert counts == dict.fromkeys(clients, CLIENTS_PER_MODEL)
        # every request reached the server and was answered (none lost)
        total = len(clients) * CLIENTS_PER_MODEL * REQUESTS_PER_CLIENT
        assert srv.counts.by_status.get(200, 0) >= total

        # the repository extension through tritonclient
        triton = httpclient.InferenceServerClient(host)
        triton.unload_model("cls")
        assert not triton.is_model_ready("cls")
        triton.load_model("cls")
        assert triton.is_model_ready("cls")
        triton.close()
