"""``/openapi.json`` of each existing kind of served thing, pinned byte for byte.

The documents in ``data/openapi-pinned.json`` were written from main *before* the model kinds
(``ortbatch/serve/served/kinds.py``) replaced the ``isinstance`` dispatch, so moving the
encoder and decoder onto their declarations cannot change a route, a refusal, an example or
a word of what a client reads. Only the package version (``info.version``) is left out.

A deliberate change to the document rewrites them: ``ORTBATCH_WRITE_OPENAPI=1 pytest
tests/serve/test_openapi_pinned.py``, and the diff is reviewed with the change.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fakegen import FakeGenerator
from starlette.testclient import TestClient

from ortbatch.generation.chat import ChatTemplate
from ortbatch.serve import ServeConfig, ServedModel
from ortbatch.serve.assembly import app_for
from ortbatch.serve.served.generator import ServedGenerator
from ortbatch.serve.served.repository import ModelRepository

PINNED = Path(__file__).parent / "data" / "openapi-pinned.json"
#: what each document's ``components.schemas`` is replaced by in the pinned file
SHARED = "<shared schemas>"
TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
WRITE = os.environ.get("ORTBATCH_WRITE_OPENAPI") == "1"


def _generator(name: str) -> ServedGenerator:
    if name == "chat":
        return ServedGenerator(FakeGenerator(), name, chat_template=ChatTemplate(TEMPLATE))
    return ServedGenerator(FakeGenerator(), name)


@pytest.fixture(scope="module")
def served(task_dirs: dict[str, Path]) -> Iterator[dict[str, Any]]:
    """One of each: embedder, reranker, classifier, tagger, generator (with and without a
    chat template), and a repository holding encoders and a generator."""
    out: dict[str, Any] = {n: ServedModel.load(d, name=n) for n, d in task_dirs.items()}
    out["gen"] = _generator("gen")
    out["chat"] = _generator("chat")

    def loader(directory: Path, name: str) -> Any:
        return _generator(name) if name in ("gen", "chat") else ServedModel.load(directory, name=name)

    pairs = [(n, task_dirs[n]) for n in ("embedder", "reranker", "ner")]
    pairs += [("chat", task_dirs["embedder"])]
    repo = ModelRepository(pairs, config=ServeConfig(warmup=False), loader=loader)
    repo.load_all()
    out["repository"] = repo
    yield out
    for s in out.values():
        s.close(drain=False)


def _document(served: Any, api_key: str | None) -> dict[str, Any]:
    config = ServeConfig(api_key=api_key)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with TestClient(app_for(served, config, close_model_on_shutdown=False)) as client:
        response = client.get("/openapi.json", headers=headers)
    assert response.status_code == 200, response.text
    doc = response.json()
    doc["info"].pop("version")
    return dict(doc)


CASES = ["embedder", "reranker", "sentiment", "ner", "gen", "chat", "repository"]


@pytest.fixture(scope="module")
def pinned() -> Iterator[dict[str, Any]]:
    """The pinned documents (``components.schemas``, the same in each, kept once), and the
    startup lines; written back at the end with ``ORTBATCH_WRITE_OPENAPI=1``."""
    doc: dict[str, Any] = json.loads(PINNED.read_text()) if PINNED.is_file() else {"documents": {}}
    yield doc
    if WRITE:
        PINNED.write_text(json.dumps(doc, indent=1) + "\n")


@pytest.mark.parametrize("auth", [False, True], ids=["open", "key"])
@pytest.mark.parametrize("name", CASES)
def test_openapi_document_is_unchanged(served: dict[str, Any], pinned: dict[str, Any], name: str, auth: bool) -> None:
    doc = _document(served[name], "pinned-key" if auth else None)
    key = f"{name}{'-key' if auth else ''}"
    schemas = doc["components"]["schemas"]
    doc["components"]["schemas"] = SHARED
    if WRITE:
        pinned["schemas"], pinned["documents"][key] = schemas, doc
    # byte for byte: the same keys in the same order, the same values
    assert json.dumps(schemas) == json.dumps(pinned["schemas"]), "the OpenAPI schemas changed"
    assert json.dumps(doc, indent=1) == json.dumps(pinned["documents"][key], indent=1), (
        f"/openapi.json of {key!r} changed"
    )


def test_startup_lines_are_unchanged(served: dict[str, Any], pinned: dict[str, Any]) -> None:
    """What ``serve`` prints of each (``served_label (served_summary)``, and a repository's
    model lines), as main printed it before the kinds."""
    from ortbatch.serve.assembly import served_label, served_summary

    lines: dict[str, Any] = {name: f"{served_label(served[name])} ({served_summary(served[name])})" for name in CASES}
    lines["repository-models"] = [
        re.sub(r" \(/[^)]*\)", " (DIR)", line) for line in served["repository"].status_lines()
    ]
    if WRITE:
        pinned["startup-lines"] = lines
    assert lines == pinned["startup-lines"]
