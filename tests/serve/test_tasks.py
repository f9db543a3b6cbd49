"""The task endpoints (/v1/rerank, /rerank, /v1/classify, /tokenize, /detokenize,
/v1/embeddings truncate) on tiny exports: answers equal each input run alone on a plain
InferenceSession, and N texts are N rows of the model's one BatchedSession."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from tinytasks import TAGS, run_alone
from tokenizers import Tokenizer

from ortbatch.serve import BackgroundServer, ServeConfig, ServedModel

pytestmark = pytest.mark.timeout(120)

QUERY = "the quick fox"
DOCS = ["hello world", "the quick brown fox jumps over the lazy dog", "many callers", "a batched session pads"]


def _server(directory: Path, name: str) -> BackgroundServer:
    model = ServedModel.load(directory, name=name, session_kwargs={"max_batch_size": 4})
    return BackgroundServer(model, ServeConfig(port=0, access_log=False, log_level="warning"))


@pytest.fixture(scope="module")
def servers(task_dirs: dict[str, Path]) -> Iterator[dict[str, BackgroundServer]]:
    started = {name: _server(d, name).start() for name, d in task_dirs.items()}
    yield started
    for srv in started.values():
        srv.stop()


def _post(srv: BackgroundServer, path: str, body: object) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, timeout=30)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1 / (1 + np.exp(-x))


def test_rerank_scores_equal_each_pair_run_alone(servers, task_dirs):
    d = task_dirs["reranker"]
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    raw = []
    for doc in DOCS:
        e = tok.encode(QUERY, doc)  # the tokenizer's own pairing: [CLS] q [SEP] d [SEP], types 0/1
        raw.append(float(run_alone(d, e.ids, e.type_ids)[0]))
    raw_arr = np.array(raw)
    order = list(np.argsort(-raw_arr, kind="stable"))

    r = _post(servers["reranker"], "/v1/rerank", {"model": "reranker", "query": QUERY, "documents": DOCS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "reranker" and body["usage"]["total_tokens"] > 0
    results = body["results"]
    assert [x["index"] for x in results] == order  # most relevant first
    np.testing.assert_allclose([x["relevance_score"] for x in results], _sigmoid(raw_arr)[order], atol=1e-6)
    assert [x["document"]["text"] for x in results] == [DOCS[i] for i in order]

    # raw logits, top_n, documents as objects (Cohere/Jina), no documents back
    r = _post(
        servers["reranker"],
        "/v1/rerank",
        {
            "query": QUERY,
            "documents": [{"text": t} for t in DOCS],
            "top_n": 2,
            "return_documents": False,
            "raw_scores": True,
        },
    )
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [x["index"] for x in results] == order[:2]
    assert all("document" not in x for x in results)
    np.testing.assert_allclose([x["relevance_score"] for x in results], raw_arr[order[:2]], atol=1e-5)

    # TEI's shape
    r = _post(servers["reranker"], "/rerank", {"query": QUERY, "texts": DOCS, "raw_scores": True, "return_text": True})
    assert r.status_code == 200, r.text
    assert [x["index"] for x in r.json()] == order
    np.testing.assert_allclose([x["score"] for x in r.json()], raw_arr[order], atol=1e-5)
    assert [x["text"] for x in r.json()] == [DOCS[i] for i in order]


def test_each_text_is_one_row_of_the_one_session(servers):
    srv = servers["reranker"]
    before = srv.model.session.stats().requests
    r = _post(srv, "/v1/rerank", {"query": QUERY, "documents": DOCS})
    assert r.status_code == 200, r.text
    assert srv.model.session.stats().requests - before == len(DOCS)
    before = srv.model.session.stats().requests
    assert _post(srv, "/v1/classify", {"input": DOCS[:3]}).status_code == 200
    assert srv.model.session.stats().requests - before == 3


def test_classify_is_the_softmax_with_id2label_names(servers, task_dirs):
    d = task_dirs["sentiment"]
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    r = _post(servers["sentiment"], "/v1/classify", {"model": "sentiment", "input": DOCS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and len(body["data"]) == len(DOCS)
    names = ["negative", "neutral", "positive"]
    for item, text in zip(body["data"], DOCS, strict=True):
        e = tok.encode(text)
        logits = run_alone(d, e.ids, e.type_ids).astype(np.float64)
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        np.testing.assert_allclose(item["probs"], probs, atol=1e-6)
        assert item["num_classes"] == 3 and item["label"] == names[int(probs.argmax())]
    # a single string is one input
    r = _post(servers["sentiment"], "/v1/classify", {"input": DOCS[0]})
    assert [x["index"] for x in r.json()["data"]] == [0]


def test_token_classification_answers_entity_spans_with_char_offsets(servers, task_dirs):
    d = task_dirs["ner"]
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    texts = ["the quick brown fox jumps over the lazy dog", "hello world from the inference server"]
    r = _post(servers["ner"], "/v1/classify", {"input": texts})
    assert r.status_code == 200, r.text
    for item, text in zip(r.json()["data"], texts, strict=True):
        e = tok.encode(text)
        labels = [TAGS[int(i)] for i in run_alone(d, e.ids, e.type_ids).argmax(axis=-1)]
        spans = item["entities"]
        for span in spans:
            assert text[span["start"] : span["end"]] == span["text"]
            assert span["label"] in ("PER", "LOC") and 0 < span["score"] <= 1
        # every tagged word lies in exactly one span of its type; "O" words in none
        for label, special, (s, t) in zip(labels, e.special_tokens_mask, e.offsets, strict=True):
            if special:
                continue
            inside = [sp for sp in spans if sp["start"] <= s and t <= sp["end"]]
            if label == "O":
                assert not inside
            else:
                assert len(inside) == 1 and inside[0]["label"] == label[2:]
                if label.startswith("B-"):
                    assert inside[0]["start"] == s  # B- opens a span


def test_tokenize_and_detokenize_in_tei_and_vllm_shapes(servers, task_dirs):
    srv = servers["embedder"]
    tok = Tokenizer.from_file(str(task_dirs["embedder"] / "tokenizer.json"))
    text = "hello world"
    ids = tok.encode(text).ids
    r = _post(srv, "/tokenize", {"inputs": [text, "many callers"]})
    assert r.status_code == 200, r.text
    first = r.json()[0]
    assert [t["id"] for t in first] == ids
    assert first[0]["special"] and first[0]["start"] is None
    assert [(t["start"], t["stop"], t["text"]) for t in first[1:-1]] == [(0, 5, "hello"), (6, 11, "world")]
    r = _post(srv, "/tokenize", {"prompt": text, "add_special_tokens": False})
    assert r.json() == {"count": len(ids) - 2, "max_model_len": 16, "tokens": ids[1:-1]}

    r = _post(srv, "/detokenize", {"ids": [ids, ids[1:-1]]})
    assert r.json() == [text, text]
    assert _post(srv, "/detokenize", {"tokens": ids[1:-1]}).json() == {"prompt": text}
    r = _post(srv, "/detokenize", {"ids": [10**6]})
    assert r.status_code == 400 and "outside the vocabulary" in r.json()["error"]


def test_over_long_inputs_are_refused_unless_truncate(servers, task_dirs):
    long = " ".join(["fox"] * 40)  # the exports' limit is 16 tokens
    for name, path, body in [
        ("embedder", "/v1/embeddings", {"input": [long]}),
        ("reranker", "/v1/rerank", {"query": QUERY, "documents": ["dog", long]}),
        ("sentiment", "/v1/classify", {"input": ["dog", long]}),
    ]:
        r = _post(servers[name], path, body)
        assert r.status_code == 400, (path, r.text)
        message = r.json()["error"]["message"]
        assert "longer than the model's limit of 16 tokens" in message and '"truncate": true' in message
        r = _post(servers[name], path, {**body, "truncate": True})
        assert r.status_code == 200, (path, r.text)
    # TEI's shape names its own field (texts, not documents)
    r = _post(servers["reranker"], "/rerank", {"query": QUERY, "texts": ["dog", long]})
    assert r.status_code == 400 and "'texts'[1] is longer" in r.text, r.text
    # truncated embeddings equal the text cut to 16 tokens
    tok = Tokenizer.from_file(str(task_dirs["embedder"] / "tokenizer.json"))
    tok.enable_truncation(16)
    ids = tok.encode(long).ids
    a = _post(servers["embedder"], "/v1/embeddings", {"input": [long], "truncate": True}).json()
    b = _post(servers["embedder"], "/v1/embeddings", {"input": [ids]}).json()
    np.testing.assert_allclose(a["data"][0]["embedding"], b["data"][0]["embedding"], atol=1e-6)
    # token ids over the limit: cut when asked, refused otherwise
    over = [5] * 20
    assert _post(servers["embedder"], "/v1/embeddings", {"input": [over]}).status_code == 400
    assert _post(servers["embedder"], "/v1/embeddings", {"input": [over], "truncate": True}).status_code == 200


def test_the_server_default_truncates_when_told(task_dirs):
    model = ServedModel.load(task_dirs["sentiment"], name="s", truncate=True)
    with BackgroundServer(model) as srv:
        r = _post(srv, "/v1/classify", {"input": " ".join(["fox"] * 40)})
        assert r.status_code == 200, r.text
        assert _post(srv, "/v1/classify", {"input": " ".join(["fox"] * 40), "truncate": False}).status_code == 400


@pytest.mark.parametrize(
    ("name", "path", "body", "message"),
    [
        ("embedder", "/v1/rerank", {"query": "a", "documents": ["b"]}, "not a cross-encoder"),
        ("sentiment", "/v1/rerank", {"query": "a", "documents": ["b"]}, "3 labels"),
        ("embedder", "/v1/classify", {"input": "a"}, "text- or token-classification"),
        ("reranker", "/v1/rerank", {"documents": ["b"]}, "'query'"),
        ("reranker", "/v1/rerank", {"query": "a"}, "'documents' is required"),
        ("reranker", "/v1/rerank", {"query": "a", "documents": []}, "'documents'"),
        ("reranker", "/v1/rerank", {"query": "a", "documents": [3]}, "'documents'[0]"),
        ("reranker", "/v1/rerank", {"query": "a", "documents": ["b"], "top_n": 0}, "'top_n'"),
        ("reranker", "/v1/rerank", {"query": "a", "documents": ["b"], "top_n": True}, "'top_n'"),
        ("reranker", "/v1/rerank", {"query": "a", "documents": ["b"], "truncate": "yes"}, "'truncate'"),
        ("reranker", "/rerank", {"query": "a"}, "'texts' is required"),
        # Cohere's field on TEI's endpoint: named, not reported as a missing 'texts'
        ("reranker", "/rerank", {"query": "a", "documents": ["b"]}, "supplied: documents"),
        ("sentiment", "/v1/classify", {}, "'input' is required"),
        ("sentiment", "/v1/classify", {"input": [["a"]]}, "'input'[0]"),
        ("embedder", "/tokenize", {"inputs": 3}, "'inputs'"),
        ("embedder", "/tokenize", {"prompt": 3}, "'prompt'"),
        ("embedder", "/tokenize", {}, "send 'inputs'"),
        ("embedder", "/detokenize", {"ids": ["x"]}, "'ids'"),
        ("embedder", "/detokenize", {"tokens": "x"}, "'tokens'"),
        ("embedder", "/v1/embeddings", {"input": "a", "truncate": 1}, "'truncate'"),
        # a misspelled field is named as such, not reported as the one it was meant to be, missing
        ("embedder", "/v1/embeddings", {"inputs": "a"}, "supplied: inputs (/v1/embeddings reads 'input')"),
        ("embedder", "/embed", {"input": "a"}, "supplied: input (/embed reads 'inputs')"),
        ("sentiment", "/v1/classify", {"inputs": ["a"]}, "supplied: inputs (/v1/classify reads 'input')"),
        ("reranker", "/v1/rerank", {"query": "a", "document": ["b"]}, "supplied: document (/v1/rerank reads"),
    ],
)
def test_bad_requests_get_a_400_naming_what_was_wrong(servers, name, path, body, message):
    r = _post(servers[name], path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert message in (err["message"] if isinstance(err, dict) else err)


def test_an_export_without_a_tokenizer_says_it_takes_no_text(adder_path):
    model = ServedModel.load(adder_path, name="adder")
    with BackgroundServer(model) as srv:
        for path, body in [("/tokenize", {"inputs": "a"}), ("/v1/rerank", {"query": "a", "documents": ["b"]})]:
            r = _post(srv, path, body)
            assert r.status_code == 400 and "takes no text" in r.text, r.text


def test_the_text_entry_answers_over_grpc_too(encoder_dir):
    """A metadata-driven gRPC client of ``tiny_text`` sends the one BYTES input it lists."""
    grpcclient = pytest.importorskip("tritonclient.grpc")
    model = ServedModel.load(encoder_dir, name="tiny", session_kwargs={"max_batch_size": 8})
    config = ServeConfig(port=0, grpc_port=0, access_log=False, log_level="warning")
    with BackgroundServer(model, config) as srv:
        client = grpcclient.InferenceServerClient(srv.grpc.address)
        try:
            meta = client.get_model_metadata("tiny_text", as_json=True)
            assert [(i["name"], i["datatype"]) for i in meta["inputs"]] == [("text", "BYTES")]
            assert [i["name"] for i in client.get_model_metadata("tiny", as_json=True)["inputs"]] == [
                "input_ids",
                "attention_mask",
            ]
            text = grpcclient.InferInput("text", [2, 1], "BYTES")
            text.set_data_from_numpy(np.array([["hello world"], ["a b"]], dtype=object))
            got = client.infer("tiny_text", [text]).as_numpy("pooled")
        finally:
            client.close()
        body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [2], "data": ["hello world", "a b"]}]}
        out = {o["name"]: o for o in httpx.post(srv.url + "/v2/models/tiny/infer", json=body).json()["outputs"]}
    np.testing.assert_allclose(got, np.array(out["pooled"]["data"], np.float32).reshape(2, -1), rtol=1e-6)


@pytest.mark.parametrize(
    ("name", "path", "body"),
    [
        ("reranker", "/v1/rerank", {"query": "a", "documents": ["b"], "truncate": "y" * 100_000}),
        ("reranker", "/v1/rerank", {"query": "a", "documents": ["b"], "return_documents": ["y" * 100_000]}),
        ("embedder", "/v1/embeddings", {"input": "a", "truncate": ["y" * 100_000]}),
        ("embedder", "/embed", {"inputs": "a", "truncate": {"y": "y" * 100_000}}),
    ],
)
def test_a_wrong_typed_field_is_named_without_echoing_all_of_it(servers, name, path, body):
    """The 400 names the field and shows the start of what was sent, not 100 kB of it back."""
    r = _post(servers[name], path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    message = err["message"] if isinstance(err, dict) else err
    field = next(k for k, v in body.items() if "y" * 100 in str(v))
    assert f"'{field}' must be" in message and len(message) < 200, message[:300]


@pytest.mark.parametrize(
    ("name", "path", "body", "field"),
    [
        # fields another API defines, which these endpoints do not read: they were dropped
        # without a word (vLLM's normalize changed nothing, TEI's Left answered Right)
        ("embedder", "/v1/embeddings", {"input": "a", "normalize": False}, "normalize"),
        ("embedder", "/v1/embeddings", {"input": "a", "truncate_prompt_tokens": 4}, "truncate_prompt_tokens"),
        ("reranker", "/v1/rerank", {"query": "a", "documents": ["b"], "max_chunks_per_doc": 2}, "max_chunks_per_doc"),
        ("reranker", "/rerank", {"query": "a", "texts": ["b"], "documents": ["c"]}, "documents"),
        ("sentiment", "/v1/classify", {"input": "a", "top_k": 1}, "top_k"),
        ("embedder", "/tokenize", {"prompt": "a", "return_token_strs": True}, "return_token_strs"),
        ("embedder", "/detokenize", {"ids": [5], "decode_options": {}}, "decode_options"),
    ],
)
def test_a_field_an_endpoint_does_not_read_is_a_400_naming_it(servers, name, path, body, field):
    r = _post(servers[name], path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["message"] if isinstance(err, dict) else err) == f"Unrecognized request argument supplied: {field}"
    # the same request without it is answered, with the model named in the body or not
    plain = {k: v for k, v in body.items() if k != field}
    assert _post(servers[name], path, plain).status_code == 200
    assert _post(servers[name], path, {**plain, "model": name}).status_code == 200


def test_truncation_direction_right_is_honoured_and_left_refused_where_it_would_cut(servers):
    long = " ".join(["fox"] * 40)  # over the exports' 16 tokens
    srv = servers["reranker"]
    right = _post(srv, "/rerank", {"query": QUERY, "texts": [long], "truncate": True})
    for side in ("Right", "right"):
        r = _post(srv, "/rerank", {"query": QUERY, "texts": [long], "truncate": True, "truncation_direction": side})
        assert r.json() == right.json()
    # Left cannot be honoured: refused when inputs are cut, harmless (and taken) when they are not
    r = _post(srv, "/rerank", {"query": QUERY, "texts": [long], "truncate": True, "truncation_direction": "Left"})
    assert r.status_code == 400 and "'truncation_direction' Left is not supported" in r.json()["error"]
    r = _post(srv, "/rerank", {"query": QUERY, "texts": ["dog"], "truncation_direction": "Left"})
    assert r.status_code == 200, r.text
    r = _post(srv, "/rerank", {"query": QUERY, "texts": ["dog"], "truncation_direction": "up"})
    assert r.status_code == 400 and 'must be "Left" or "Right"' in r.json()["error"]


def test_tei_tokenize_refuses_prompt_name_with_the_reason(servers):
    r = _post(servers["embedder"], "/tokenize", {"inputs": "a", "prompt_name": "query"})
    assert r.status_code == 400 and "'prompt_name' is not supported: /tokenize tokenizes" in r.json()["error"]
    assert _post(servers["embedder"], "/tokenize", {"inputs": "a", "prompt_name": None}).status_code == 200


def test_lenient_params_takes_an_unread_field_and_answers_as_without_it(task_dirs, caplog):
    model = ServedModel.load(task_dirs["embedder"], name="e", lenient_params=True)
    with BackgroundServer(model, ServeConfig(port=0, access_log=False, log_level="warning")) as srv:
        with caplog.at_level("WARNING", logger="ortbatch.serve"):
            a = _post(srv, "/v1/embeddings", {"input": "a", "normalize": False})
            _post(srv, "/v1/embeddings", {"input": "a", "normalize": False})
        b = _post(srv, "/v1/embeddings", {"input": "a"})
        assert a.status_code == 200 and a.json()["data"] == b.json()["data"]
    logged = [r for r in caplog.records if "'normalize'" in r.getMessage()]
    assert len(logged) == 1  # once per name
