"""Choosing the next token from one row's logits. Pure numpy.

Each request carries its own :class:`numpy.random.Generator`, seeded from the request's
``seed``, and draws exactly one uniform number per sampled token from it. What else is
in the batch therefore never changes which random numbers a request sees, so seeded
sampling is reproducible per request.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["SamplingParams", "choose_token"]


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks tokens. ``temperature == 0`` is greedy (argmax)."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def choose_token(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator | None) -> int:
    """Pick the next token id from a 1-D ``logits`` row.

    Greedy takes the argmax (lowest id on ties, as torch does). Sampling applies
    temperature, then top-k, then top-p (nucleus: the smallest set of most likely
    tokens whose probability reaches ``top_p``), in float64, and inverts the CDF of
    what is left at one uniform draw from ``rng``.
    """
    if params.greedy:
        return int(np.argmax(logits))
    if rng is None:
        raise ValueError("sampling needs a random generator")
    scores = logits.astype(np.float64) / params.temperature
    vocab = scores.shape[0]
    k = vocab if params.top_k is None else min(params.top_k, vocab)
    # Candidates sorted by score, highest first; stable so ties keep id order.
    order = np.argsort(-scores, kind="stable")[:k]
    kept = scores[order]
    probs = np.exp(kept - kept[0])
    probs /= probs.sum()
    if params.top_p is not None and params.top_p < 1.0:
        cumulative = np.cumsum(probs)
        # Keep every token up to and including the one that crosses top_p.
        cut = int(np.searchsorted(cumulative, params.top_p, side="left")) + 1
        order, probs = order[:cut], probs[:cut]
        probs = probs / probs.sum()
    u = rng.random()
    index = int(np.searchsorted(np.cumsum(probs), u, side="right"))
    return int(order[min(index, len(order) - 1)])
