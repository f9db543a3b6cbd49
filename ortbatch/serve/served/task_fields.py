"""The JSON fields each embedding and text-task endpoint reads, and what happens to any other.

The completion endpoints check every field against :data:`~.parameters.FIELDS`; these
endpoints did not, so a field they do not read was dropped without a word: TEI's
``truncation_direction: "Left"`` answered right-truncated vectors, vLLM's ``normalize`` or
``truncate_prompt_tokens`` changed nothing. Now, as OpenAI answers a field it does not know,
a field outside :data:`TASK_FIELDS` is a 400 naming it (``Unrecognized request argument
supplied: X``), or with ``ortbatch serve --lenient-params`` is accepted and logged once per
name (the completion endpoints' :class:`~.parameters.ParameterPolicy`). A field an API defines
that ortbatch cannot honour is refused with the reason (:data:`REFUSED`). ``model`` is read by
every body-routed endpoint (a repository dispatches on it).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

from ...embed.options import OPTION_FIELDS as _EMBED_OPTIONS
from ...errors import InvalidInputError
from .parameters import ParameterPolicy

__all__ = ["REFUSED", "TASK_FIELDS", "check_task_fields", "truncation_direction"]

#: endpoint -> the fields it reads (besides ``model``)
TASK_FIELDS: dict[str, frozenset[str]] = {
    # OpenAI's fields (``user`` is an end-user id: taken, no effect), and sentence-transformers'/TEI's
    # options; top_k/threshold are read so that a dense model refuses them with its own reason
    "/v1/embeddings": frozenset({"input", "truncate", "user", *_EMBED_OPTIONS}),
    # TEI's (prompt: sentence-transformers'); top_k/threshold are read to be refused with a reason
    "/embed": frozenset({"inputs", "normalize", "truncate", "truncation_direction", *_EMBED_OPTIONS}),
    # TEI's, and ortbatch's top_k/threshold
    "/embed_sparse": frozenset({"inputs", "truncate", "truncation_direction", *_EMBED_OPTIONS}),
    # Cohere's/Jina's/vLLM's shape, and TEI's
    "/v1/rerank": frozenset({"query", "documents", "top_n", "return_documents", "raw_scores", "truncate"}),
    "/rerank": frozenset({"query", "texts", "top_n", "return_text", "raw_scores", "truncate", "truncation_direction"}),
    "/v1/classify": frozenset({"input", "truncate", "user"}),
    # vLLM's shape (prompt) and TEI's (inputs)
    "/tokenize": frozenset({"prompt", "inputs", "add_special_tokens", "prompt_name"}),
    "/detokenize": frozenset({"tokens", "ids", "skip_special_tokens"}),
}

#: endpoint -> field -> why it is refused (a field its API defines that ortbatch does not honour)
REFUSED: dict[str, dict[str, str]] = {
    "/tokenize": {
        "prompt_name": "/tokenize tokenizes the text as sent; put the prompt before the text yourself",
    },
}


def check_task_fields(doc: Mapping[str, Any], endpoint: str, policy: ParameterPolicy) -> None:
    """Refuse (or, when ``policy`` is lenient, log once) each field of ``doc`` that
    ``endpoint`` does not read, naming the field it reads when one is close (``inputs`` for
    ``input``); refuse a field of :data:`REFUSED` that is not null. Call it before checking
    that a required field is there, so a misspelled field is named as such rather than
    reported as the one it was meant to be, missing."""
    known = TASK_FIELDS[endpoint]
    for name in doc:
        if name != "model" and name not in known:
            close = difflib.get_close_matches(str(name), sorted(known), n=1, cutoff=0.75)
            if close and not policy.lenient:  # "inputs" for "input": say which one was meant
                raise InvalidInputError(
                    f"Unrecognized request argument supplied: {name} ({endpoint} reads '{close[0]}')",
                    input_name=str(name),
                )
            policy.unknown(str(name))
    for name, why in REFUSED.get(endpoint, {}).items():
        if doc.get(name) is not None:
            raise InvalidInputError(f"'{name}' is not supported: {why}", input_name=name)


def truncate_field(doc: Mapping[str, Any], default: bool) -> bool:
    """The text endpoints' ``truncate`` (an input over the model's limit cut to it, or refused):
    true or false; absent or null, ``default`` (``serve --truncate``, or ``run --truncate``)."""
    value = doc.get("truncate")
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidInputError(f"'truncate' must be true or false, got {str(value)[:40]}", input_name="truncate")
    return value


def truncation_direction(doc: Mapping[str, Any], truncate: bool) -> None:
    """TEI's ``truncation_direction``: ``Right`` (the default; any case) is how inputs are cut.
    ``Left`` cannot be honoured, so it is refused when it would matter: with ``truncate`` on.
    (With it off, an input over the limit is refused whichever side it would be cut at.)"""
    value = doc.get("truncation_direction")
    if value is None:
        return
    side = value.lower() if isinstance(value, str) else None
    if side not in ("left", "right"):
        raise InvalidInputError(
            f'\'truncation_direction\' must be "Left" or "Right", got {str(value)[:40]}',
            input_name="truncation_direction",
        )
    if side == "left" and truncate:
        raise InvalidInputError(
            "'truncation_direction' Left is not supported: an input over the model's limit is cut at its end "
            "(Right), as sentence-transformers cuts it",
            input_name="truncation_direction",
        )
