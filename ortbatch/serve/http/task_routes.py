"""The task routes over one :class:`~ortbatch.serve.served.model.ServedModel` (added to
every model's app by :func:`~ortbatch.serve.http.app.create_app`): each reads the JSON
body and sends what :mod:`ortbatch.serve.served.text_tasks` answers (the endpoints, the
request shapes and which export serves what are described there), and TEI's ``/embed``
and ``/embed_sparse`` (:mod:`ortbatch.serve.served.embeddings`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from ..served.embeddings import embed_answer, embed_sparse_answer
from ..served.model import ServedModel
from ..served.protocol import dumps_json
from ..served.text_tasks import (
    classify_answer,
    detokenize_answer,
    rerank_answer,
    rerank_tei_answer,
    tokenize_answer,
)
from .openai_api import read_openai_body
from .plumbing import BodyLimits, handled_route, json_response, run_or_abandon

__all__ = ["task_routes"]

#: path -> the answer computed by the core (awaited unless the client leaves first)
_RUN = {
    "/v1/rerank": rerank_answer,
    "/rerank": rerank_tei_answer,
    "/v1/classify": classify_answer,
    "/embed": embed_answer,
    "/embed_sparse": embed_sparse_answer,
}
#: path -> an answer with no model run (computed in a thread: bounded by the core's caps, yet
#: thousands of id lists or a megabyte of text must not hold the event loop, health included)
_AT_ONCE = {"/tokenize": tokenize_answer, "/detokenize": detokenize_answer}


def _encoded(answer: Callable[[ServedModel, dict[str, Any]], Any], model: ServedModel, doc: dict[str, Any]) -> bytes:
    """The answer's JSON, made and encoded on the calling thread."""
    return dumps_json(answer(model, doc))


def task_routes(model: ServedModel, body: BodyLimits) -> list[Any]:
    """The task routes for ``model`` (for :func:`~ortbatch.serve.http.plumbing.assemble_app`)."""

    def running(answer: Callable[[ServedModel, dict[str, Any]], Awaitable[Any]]) -> Any:
        async def endpoint(request: Any) -> Any:
            doc = await read_openai_body(request, body, model.name)
            return json_response(await run_or_abandon(request.receive, answer(model, doc)))

        return endpoint

    def at_once(answer: Callable[[ServedModel, dict[str, Any]], Any]) -> Any:
        async def endpoint(request: Any) -> Any:
            from starlette.responses import Response

            doc = await read_openai_body(request, body, model.name)
            encoded = await run_or_abandon(request.receive, asyncio.to_thread(_encoded, answer, model, doc))
            return Response(encoded, media_type="application/json")

        return endpoint

    routes = [handled_route(path, running(answer), "POST") for path, answer in _RUN.items()]
    return routes + [handled_route(path, at_once(answer), "POST") for path, answer in _AT_ONCE.items()]
