"""Task endpoints over one :class:`~ortbatch.serve.ServedModel`: what embedding, reranking
and classification users call, in the request shapes their clients already speak.

The logic, transport-free: each ``*_answer`` takes the request's JSON document and
returns the answer's (the HTTP routes, :mod:`ortbatch.serve.http.task_routes`, only read
the body and send the answer). Routes::

    POST /v1/rerank     Cohere / Jina / vLLM: query + documents -> results sorted by relevance
    POST /rerank        text-embeddings-inference: query + texts -> [{index, score}]
    POST /v1/classify   vLLM: label distribution per input (sequence classification), or
                        entity spans with character offsets (token classification)
    POST /tokenize      TEI (``inputs``) or vLLM (``prompt``) shape
    POST /detokenize    TEI (``ids``) or vLLM (``tokens``) shape

Which export serves what (:func:`served_endpoints`): rerank needs a text-classification
export with one logit (a cross-encoder); classify a text- or token-classification export;
tokenize/detokenize any export with a tokenizer. Others answer a 400 that says why.

Every text becomes one request (one row) of the model's one BatchedSession, so a list of
N texts is N rows batched with whatever else is queued, and each answer equals the text
(or the query/document pair) run alone. Pairs are tokenized as the tokenizer pairs them
(``[CLS] query [SEP] document [SEP]`` with token types for BERT), exactly what
``tokenizer(query, document)`` gives in transformers.

Inputs longer than the model's limit are refused with a 400 unless ``truncate`` is true
in the request (default: the server's ``--truncate``); then they are cut to the limit as
the tokenizer cuts them (the longest of a pair first).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from ...errors import InvalidInputError, RequestTooLargeError
from ...heads import Heads, activate, read_heads
from .model import ServedModel, check_texts
from .task_fields import check_task_fields, truncate_field, truncation_direction

__all__ = [
    "CLASSIFY_TASKS",
    "MAX_TOKENIZE_CHARS",
    "MAX_TOKENIZE_ITEMS",
    "RERANK_TASKS",
    "classify",
    "classify_answer",
    "detokenize_answer",
    "rerank_answer",
    "rerank_scores",
    "rerank_tei_answer",
    "served_endpoints",
    "tokenize_answer",
]

#: export tasks whose single-logit exports answer /v1/rerank
RERANK_TASKS = frozenset({"text-classification"})
#: export tasks that answer /v1/classify
CLASSIFY_TASKS = frozenset({"text-classification", "token-classification"})
#: most texts one /tokenize, or id lists one /detokenize, takes (more: 413)
MAX_TOKENIZE_ITEMS = 1024
#: most characters (/tokenize, all texts together) or token ids (/detokenize, all lists
#: together) one request takes (more: 413): what a request costs, the answer's size with it,
#: stays bounded (a 20 MB body once took 6.5 GB to tokenize)
MAX_TOKENIZE_CHARS = 1 << 20


def _task(model: ServedModel) -> str | None:
    task = model.manifest.source.get("task") if model.manifest is not None else None
    return task if isinstance(task, str) else None


def _logits_output(model: ServedModel) -> tuple[str | None, int]:
    """The classification output (``logits``, else the only output) and its width."""
    by_name = {m.name: m for m in model.outputs}
    meta = by_name.get("logits") or (model.outputs[0] if len(model.outputs) == 1 else None)
    if meta is None:
        return None, 0
    return meta.name, meta.shape[-1] if meta.shape else 0


def _id2label(model: ServedModel, width: int) -> list[str]:
    """Label names from the export's ``config.json`` (``LABEL_i`` where it has none)."""
    return list(_heads(model, width).label_names)


def _heads(model: ServedModel, width: int) -> Heads:
    """What the export's logits become (:mod:`ortbatch.heads`): sentence-transformers'
    CrossEncoder activation for rerank, transformers' pipeline function for classify."""
    return model.read_once(("heads", width), lambda: read_heads(getattr(model.manifest, "directory", None), width))


def served_endpoints(model: ServedModel) -> dict[str, str]:
    """Endpoint -> ``""`` if ``model`` serves it, else the reason it does not (the 400's text)."""
    task = _task(model)
    name, width = _logits_output(model)
    out: dict[str, str] = {}
    no_text = f"model {model.name!r} takes no text: {model.text_disabled_reason}"
    out["tokenize"] = "" if model.tokenizer is not None else no_text
    out["embeddings"] = "" if model.embedding_output is not None else model.embeddings_disabled_reason
    out["embed_sparse"] = "" if model.sparse_output is not None else model.sparse_disabled_reason
    if model.tokenizer is None:
        out["rerank"] = out["classify"] = no_text
        return out
    if task not in RERANK_TASKS or name is None:
        out["rerank"] = f"model {model.name!r} is a {task!r} export, not a cross-encoder (text-classification)"
    elif width != 1:
        out["rerank"] = (
            f"model {model.name!r} is a classifier with {width} labels; reranking needs a cross-encoder "
            "with one logit (use /v1/classify)"
        )
    else:
        out["rerank"] = ""
    if task not in CLASSIFY_TASKS or name is None:
        out["classify"] = (
            f"model {model.name!r} is a {task!r} export; /v1/classify needs a text- or token-classification export"
        )
    else:
        out["classify"] = ""
    return out


# -- request fields ------------------------------------------------------------------------
def _field(doc: dict[str, Any], key: str, kind: type | tuple[type, ...], default: Any, what: str) -> Any:
    value = doc.get(key, default)
    if value is None:
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise InvalidInputError(f"'{key}' must be {what}, got {repr(value)[:40]}", input_name=key)
    return value


def _flag(doc: dict[str, Any], key: str, default: bool) -> bool:
    return bool(_field(doc, key, bool, default, "true or false"))


def _text_list(value: Any, key: str, *, allow_objects: bool = False) -> list[str]:
    """A string or a non-empty list of strings (or ``{"text": ...}`` objects, as Cohere's
    and Jina's documents may be)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        texts = []
        for i, item in enumerate(value):
            if allow_objects and isinstance(item, dict) and isinstance(item.get("text"), str):
                item = item["text"]
            if not isinstance(item, str):
                raise InvalidInputError(
                    f"'{key}'[{i}] must be a string{' or an object with a text field' if allow_objects else ''}, "
                    f"got {item!r:.80}",
                    input_name=key,
                )
            texts.append(item)
        return texts
    raise InvalidInputError(f"'{key}' must be a string or a non-empty list of strings", input_name=key)


def _ids(value: Any, key: str) -> list[int]:
    if isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return value
    raise InvalidInputError(f"'{key}' must be a list of token ids (integers)", input_name=key)


# -- tokenizing ----------------------------------------------------------------------------
def _feeds(model: ServedModel, encodings: Sequence[Any]) -> list[dict[str, np.ndarray]]:
    return [model._feed_from_ids(e.ids, e.attention_mask, e.type_ids) for e in encodings]


def _require(model: ServedModel, endpoint: str) -> None:
    reason = served_endpoints(model)[endpoint]
    if reason:
        raise InvalidInputError(reason)


def _softmax(x: np.ndarray) -> np.ndarray:
    z = x.astype(np.float64) - x.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


# -- the endpoints ---------------------------------------------------------------------------
async def rerank_scores(
    model: ServedModel, query: str, documents: list[str], truncate: bool, field: str = "documents"
) -> tuple[np.ndarray, int]:
    """The cross-encoder's logit for each ``(query, document)`` pair (each its own row)
    and the tokens used; ``field`` names the documents in an error (TEI's are ``texts``)."""
    _require(model, "rerank")
    name, _ = _logits_output(model)
    assert name is not None
    encodings = await model.encode_async([(query, d) for d in documents], truncate, field)
    feeds = _feeds(model, encodings)
    results = await model._gather(feeds, [name])
    logits = np.array([float(r[0].reshape(-1)[0]) for r in results], dtype=np.float64)
    return logits, sum(len(e.ids) for e in encodings)


def _parse_rerank(doc: dict[str, Any], texts_key: str) -> tuple[str, list[str], int | None]:
    query = doc.get("query")
    if not isinstance(query, str):
        raise InvalidInputError("'query' must be a string", input_name="query")
    if texts_key not in doc:
        raise InvalidInputError(f"'{texts_key}' is required: the texts to rank against the query", input_name=texts_key)
    documents = _text_list(doc.get(texts_key), texts_key, allow_objects=True)
    top_n = _field(doc, "top_n", int, None, "a positive integer")
    if top_n is not None and top_n < 1:
        raise InvalidInputError(f"'top_n' must be a positive integer, got {top_n}", input_name="top_n")
    return query, documents, top_n


def _ranked(scores: np.ndarray, top_n: int | None) -> list[int]:
    # highest first; equal scores keep the documents' order (a stable sort)
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    return order[:top_n] if top_n is not None else order


async def classify(model: ServedModel, texts: list[str], truncate: bool) -> tuple[list[dict[str, Any]], int]:
    """One answer per text: ``{index, label, probs, num_classes}`` for sequence classification;
    ``{index, entities: [{label, score, start, end, text}]}`` for token classification."""
    _require(model, "classify")
    name, width = _logits_output(model)
    assert name is not None
    labels = _id2label(model, width)
    encodings = await model.encode_async(texts, truncate, "input")
    results = await model._gather(_feeds(model, encodings), [name])
    tokens = sum(len(e.ids) for e in encodings)
    data: list[dict[str, Any]] = []
    if _task(model) == "token-classification":
        for i, (text, enc, (logits,)) in enumerate(zip(texts, encodings, results, strict=True)):
            probs = _softmax(logits.reshape(-1, width)[: len(enc.ids)])
            data.append({"index": i, "entities": _entities(text, enc, probs, labels)})
        return data, tokens
    function = _heads(model, width).labels
    for i, (logits,) in enumerate(results):
        probs = activate(function, logits.reshape(-1))
        best = int(probs.argmax())
        data.append({"index": i, "label": labels[best], "probs": probs.tolist(), "num_classes": width})
    return data, tokens


def _entities(text: str, enc: Any, probs: np.ndarray, labels: list[str]) -> list[dict[str, Any]]:
    """Entity spans as transformers' token-classification pipeline gives them with
    ``aggregation_strategy="simple"``: special tokens and ``O`` dropped, ``B-X``/``I-X``
    tokens grouped into one ``X`` span (a ``B-`` starts a new one), the score the mean of
    the tokens' probabilities, ``start``/``end`` character offsets into the text."""
    spans: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None
    scores: list[float] = []

    def close() -> None:
        nonlocal current
        if current is not None:
            current["score"] = float(np.mean(scores))
            current["text"] = text[current["start"] : current["end"]]
            spans.append(current)
        current = None
        scores.clear()

    for t, (special, (start, end)) in enumerate(zip(enc.special_tokens_mask, enc.offsets, strict=True)):
        if special:
            close()
            continue
        best = int(probs[t].argmax())
        label = labels[best]
        prefix, _, kind = label.partition("-") if label[:2] in ("B-", "I-") else ("", "", label)
        if kind == "O":
            close()
            continue
        if current is not None and current["label"] == kind and prefix != "B":
            current["end"] = end
        else:
            close()
            current = {"label": kind, "start": start, "end": end}
        scores.append(float(probs[t, best]))
    close()
    return spans


def _tokens_tei(model: ServedModel, text: str, enc: Any) -> list[dict[str, Any]]:
    return [
        {
            "id": i,
            "text": text[s:e] if not special else model.tokenizer.id_to_token(i),
            "special": bool(special),
            "start": None if special else s,
            "stop": None if special else e,
        }
        for i, special, (s, e) in zip(enc.ids, enc.special_tokens_mask, enc.offsets, strict=True)
    ]


def _usage(tokens: int) -> dict[str, int]:
    return {"prompt_tokens": tokens, "total_tokens": tokens}


async def _reranked(
    model: ServedModel, doc: dict[str, Any], texts_key: str, return_key: str, return_default: bool
) -> tuple[list[str], np.ndarray, list[int], bool, int]:
    """The texts of a rerank request, their scores (the cross-encoder's activation, as
    sentence-transformers' ``CrossEncoder.predict`` applies it, unless ``raw_scores``), the
    order to answer them in, whether to return the texts, and the tokens it took."""
    check_task_fields(doc, "/rerank" if texts_key == "texts" else "/v1/rerank", model.policy)
    query, texts, top_n = _parse_rerank(doc, texts_key)
    truncate = truncate_field(doc, model.truncate)
    if texts_key == "texts":  # TEI's shape
        truncation_direction(doc, truncate)
    return_texts = _flag(doc, return_key, return_default)
    raw = _flag(doc, "raw_scores", False)
    heads = _heads(model, 1)
    if not raw and heads.score is None:
        raise InvalidInputError(heads.score_refused, input_name="raw_scores")
    # CrossEncoder.predict puts the checkpoint's default prompt before the first text of a pair
    logits, tokens = await rerank_scores(model, heads.query_prompt + query, texts, truncate, texts_key)
    scores = logits if raw or heads.score is None else activate(heads.score, logits)
    return texts, scores, _ranked(scores, top_n), return_texts, tokens


async def rerank_answer(model: ServedModel, doc: dict[str, Any]) -> dict[str, Any]:
    """``/v1/rerank`` (Cohere / Jina / vLLM shape): the documents by relevance."""
    documents, scores, order, return_documents, tokens = await _reranked(
        model, doc, "documents", "return_documents", True
    )
    results = []
    for i in order:
        item: dict[str, Any] = {"index": i, "relevance_score": float(scores[i])}
        if return_documents:
            item["document"] = {"text": documents[i]}
        results.append(item)
    return {"id": "rerank-" + secrets.token_hex(12), "model": model.name, "results": results, "usage": _usage(tokens)}


async def rerank_tei_answer(model: ServedModel, doc: dict[str, Any]) -> list[dict[str, Any]]:
    """``/rerank`` (text-embeddings-inference shape): ``[{index, score}]`` by relevance."""
    texts, scores, order, return_text, _ = await _reranked(model, doc, "texts", "return_text", False)
    out = []
    for i in order:
        item: dict[str, Any] = {"index": i, "score": float(scores[i])}
        if return_text:
            item["text"] = texts[i]
        out.append(item)
    return out


async def classify_answer(model: ServedModel, doc: dict[str, Any]) -> dict[str, Any]:
    """``/v1/classify`` (vLLM shape): a label distribution, or entity spans, per input."""
    check_task_fields(doc, "/v1/classify", model.policy)
    if "input" not in doc:
        raise InvalidInputError("'input' is required: a string or a list of strings", input_name="input")
    texts = _text_list(doc.get("input"), "input")
    data, tokens = await classify(model, texts, truncate_field(doc, model.truncate))
    return {
        "id": "classify-" + secrets.token_hex(12),
        "object": "list",
        "created": int(time.time()),
        "model": model.name,
        "data": data,
        "usage": _usage(tokens),
    }


def tokenize_answer(model: ServedModel, doc: dict[str, Any]) -> Any:
    """``/tokenize``: vLLM's shape (``prompt`` -> its ids) or TEI's (``inputs`` -> tokens)."""
    _require(model, "tokenize")
    check_task_fields(doc, "/tokenize", model.policy)
    if "prompt" not in doc and "inputs" not in doc:
        raise InvalidInputError(
            "send 'inputs' (a string or a list of strings, TEI's shape) or 'prompt' (a string, vLLM's)",
            input_name="inputs",
        )
    special = _flag(doc, "add_special_tokens", True)
    tok = model.tokenizer
    assert tok is not None
    if "prompt" in doc:  # vLLM's shape: one prompt -> its ids
        prompt = doc["prompt"]
        if not isinstance(prompt, str):
            raise InvalidInputError("'prompt' must be a string", input_name="prompt")
        (prompt,) = _bounded_texts(model, [prompt], "prompt")
        ids = tok.encode(prompt, add_special_tokens=special).ids
        limit = model.manifest.max_sequence_length if model.manifest is not None else None
        return {"count": len(ids), "max_model_len": limit, "tokens": ids}
    texts = _bounded_texts(model, _text_list(doc["inputs"], "inputs"), "inputs")
    encodings = tok.encode_batch(texts, add_special_tokens=special)
    return [_tokens_tei(model, t, e) for t, e in zip(texts, encodings, strict=True)]


def _bounded_texts(model: ServedModel, texts: list[str], key: str) -> list[str]:
    """``texts`` to tokenize whole: at most :data:`MAX_TOKENIZE_ITEMS`, each within the
    model's ``max_text_chars`` and all within :data:`MAX_TOKENIZE_CHARS` (else 413), valid
    Unicode (else 400)."""
    if len(texts) > MAX_TOKENIZE_ITEMS:
        raise RequestTooLargeError(
            f"'{key}' has {len(texts)} texts; /tokenize takes at most {MAX_TOKENIZE_ITEMS}", input_name=key
        )
    texts = check_texts(texts, key, None, model.max_text_chars)
    total = sum(map(len, texts))
    if total > MAX_TOKENIZE_CHARS:
        raise RequestTooLargeError(
            f"'{key}' has {total} characters; /tokenize takes at most {MAX_TOKENIZE_CHARS} in all", input_name=key
        )
    return texts


def detokenize_answer(model: ServedModel, doc: dict[str, Any]) -> Any:
    """``/detokenize``: vLLM's shape (``tokens``) or TEI's (``ids``, one list or several)."""
    _require(model, "tokenize")
    if "tokens" not in doc and "ids" not in doc:
        raise InvalidInputError(
            "send 'ids' (token ids or a list of such lists, TEI's shape) or 'tokens' (vLLM's)", input_name="ids"
        )
    check_task_fields(doc, "/detokenize", model.policy)
    tok = model.tokenizer
    assert tok is not None
    # once per request: the tokenizer counts its added tokens afresh on every call
    vocab = tok.get_vocab_size(with_added_tokens=True)
    if "tokens" in doc:  # vLLM's shape
        (ids,) = _bounded_ids([doc["tokens"]], "tokens", vocab)
        return {"prompt": tok.decode(ids, skip_special_tokens=False)}
    skip = _flag(doc, "skip_special_tokens", True)
    value = doc["ids"]
    rows = value if isinstance(value, list) and value and all(isinstance(r, list) for r in value) else [value]
    texts: list[str] = tok.decode_batch(_bounded_ids(rows, "ids", vocab), skip_special_tokens=skip)
    return texts


def _bounded_ids(rows: list[Any], key: str, vocab: int) -> list[list[int]]:
    """Token id lists to decode: at most :data:`MAX_TOKENIZE_ITEMS` lists and
    :data:`MAX_TOKENIZE_CHARS` ids in all (else 413), each id in the vocabulary (else 400)."""
    if len(rows) > MAX_TOKENIZE_ITEMS:
        raise RequestTooLargeError(
            f"'{key}' has {len(rows)} lists of ids; /detokenize takes at most {MAX_TOKENIZE_ITEMS}", input_name=key
        )
    out = [_ids(r, key) for r in rows]
    total = sum(map(len, out))
    if total > MAX_TOKENIZE_CHARS:
        raise RequestTooLargeError(
            f"'{key}' has {total} token ids; /detokenize takes at most {MAX_TOKENIZE_CHARS} in all", input_name=key
        )
    for ids in out:
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidInputError(f"'{key}': id {bad} is outside the vocabulary [0, {vocab})", input_name=key)
    return out
