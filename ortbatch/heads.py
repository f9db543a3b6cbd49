"""What a classification export's logits become, read from the export's files, so that
``ortbatch serve`` and ``ortbatch run`` answer what the user's own library answers.

* A cross-encoder's relevance score (``/v1/rerank``, ``/rerank``, ``ortbatch run``'s
  ``score``) is sentence-transformers' ``CrossEncoder.predict``: its ``activation_fn``, from
  ``config_sentence_transformers.json`` (what sentence-transformers 5 saves), else
  ``config.json``'s ``sentence_transformers.activation_fn`` (4.x), else its
  ``sbert_ce_default_activation_function`` (older), else Sigmoid for one label.
* A sequence classifier's label scores (``/v1/classify``, ``ortbatch run``'s ``scores``) are
  transformers' ``pipeline("text-classification")``'s default ``function_to_apply``:
  ``problem_type`` ``regression`` -> the logits; ``multi_label_classification`` or one
  label -> sigmoid; else softmax.
* A cross-encoder's default prompt (``default_prompt_name`` naming one of ``prompts`` in
  ``config_sentence_transformers.json``) is put before each query, as ``CrossEncoder.predict``
  and ``rank`` put it before the first text of each pair.

An activation ortbatch cannot reproduce (a custom module, a torch one outside
:data:`ACTIVATIONS`) is a reason to refuse, never a silently different score.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["ACTIVATIONS", "ST_CONFIG", "Heads", "activate", "read_heads"]

#: the file sentence-transformers 5 writes a CrossEncoder's settings to (copied into exports)
ST_CONFIG = "config_sentence_transformers.json"

#: sentence-transformers' activation class paths ortbatch computes -> the function's name
ACTIVATIONS = {
    "torch.nn.modules.activation.Sigmoid": "sigmoid",
    "torch.nn.modules.linear.Identity": "identity",
    "torch.nn.modules.activation.Tanh": "tanh",
}


@dataclass(frozen=True)
class Heads:
    """How an export's logits are turned into answers."""

    #: the cross-encoder score's function (``sigmoid``/``identity``/``tanh``); ``None`` when the
    #: checkpoint names an activation ortbatch cannot compute
    score: str | None
    #: why ``score`` is ``None`` (the 400's text); ``""`` otherwise
    score_refused: str
    #: the label scores' function: ``softmax``, ``sigmoid`` or ``identity``
    labels: str
    #: the cross-encoder's default prompt, put before the query of each pair ("" for none)
    query_prompt: str = ""
    #: each logit's label name: ``config.json``'s ``id2label`` (``LABEL_i`` where it has none)
    label_names: tuple[str, ...] = ()


def _json(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _default_prompt(st_config: dict[str, Any]) -> str:
    prompts, name = st_config.get("prompts"), st_config.get("default_prompt_name")
    if isinstance(prompts, dict) and isinstance(name, str) and isinstance(prompts.get(name), str):
        return str(prompts[name])
    return ""


def _label_names(config: dict[str, Any], width: int) -> tuple[str, ...]:
    names = [f"LABEL_{i}" for i in range(max(width, 0))]
    mapping = config.get("id2label")
    if isinstance(mapping, dict):
        for key, value in mapping.items():
            try:
                i = int(key)
            except ValueError:
                continue
            if 0 <= i < len(names) and isinstance(value, str):
                names[i] = value
    return tuple(names)


def _st_activation(st_config: dict[str, Any], config: dict[str, Any]) -> str | None:
    """The activation path sentence-transformers' CrossEncoder loads, in its order."""
    value = st_config.get("activation_fn")
    if isinstance(value, str):
        return value
    st = config.get("sentence_transformers")
    if isinstance(st, dict) and isinstance(st.get("activation_fn"), str):
        return str(st["activation_fn"])
    old = config.get("sbert_ce_default_activation_function")
    return old if isinstance(old, str) else None


def read_heads(directory: str | Path | None, width: int) -> Heads:
    """The heads of the export in ``directory`` whose logits are ``width`` wide."""
    root = Path(directory) if directory is not None else None
    config = _json(root / "config.json") if root is not None else {}
    st_config = _json(root / ST_CONFIG) if root is not None else {}
    path = _st_activation(st_config, config)
    score: str | None = "sigmoid" if width == 1 else "identity"
    refused = ""
    if path is not None:
        score = ACTIVATIONS.get(path)
        if score is None:
            refused = (
                f"the cross-encoder's activation_fn {path!r} is not one ortbatch computes "
                f"({', '.join(sorted(ACTIVATIONS))}); ask /rerank for raw_scores and apply it yourself"
            )
    problem = config.get("problem_type")
    if problem == "regression":
        labels = "identity"
    elif problem == "multi_label_classification" or width == 1:
        labels = "sigmoid"
    else:
        labels = "softmax"
    return Heads(score, refused, labels, _default_prompt(st_config), _label_names(config, width))


def activate(kind: str, logits: np.ndarray) -> np.ndarray:
    """``logits`` (float64) through ``kind``; softmax over the last axis."""
    x = np.asarray(logits, dtype=np.float64)
    if kind == "softmax":
        e = np.exp(x - x.max(axis=-1, keepdims=True))
        return np.asarray(e / e.sum(axis=-1, keepdims=True))
    if kind == "sigmoid":
        with np.errstate(over="ignore"):
            return np.asarray(1.0 / (1.0 + np.exp(-x)))
    if kind == "tanh":
        return np.tanh(x)
    if kind == "identity":
        return x
    raise ValueError(f"unknown activation {kind!r}")
