"""Choosing the next token from one row's logits. Pure numpy.

Each request carries its own :class:`numpy.random.Generator`, seeded from the request's
``seed``, and draws exactly one uniform number per sampled token from it. What else is
in the batch therefore never changes which random numbers a request sees, so seeded
sampling is reproducible per request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import InferenceError, InvalidInputError

__all__ = ["SamplingParams", "choose_token"]


@dataclass(frozen=True)
class SamplingParams:
    """How one request generates: how many tokens, how it picks each, when it stops.

    ``temperature == 0`` is greedy (argmax); above it, tokens are sampled after
    ``top_k`` and ``top_p`` (nucleus) filtering, from a generator seeded by ``seed``
    (``None``: a fresh random seed). ``max_new_tokens=None`` takes the generator's
    default. ``stop``: strings that end the completion (cut before the match; they need
    the export's tokenizer). Bad values raise :class:`~ortbatch.errors.InvalidInputError`
    naming the field, here at construction.
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    max_new_tokens: int | None = None
    stop: str | Sequence[str] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        t, k, p, n = self.temperature, self.top_k, self.top_p, self.max_new_tokens
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not np.isfinite(t) or t < 0:
            raise InvalidInputError(f"temperature must be >= 0, got {t!r}", input_name="temperature")
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise InvalidInputError(f"top_k must be a positive integer, got {k!r}", input_name="top_k")
        if p is not None and not (isinstance(p, (int, float)) and 0.0 < p <= 1.0):
            raise InvalidInputError(f"top_p must be in (0, 1], got {p!r}", input_name="top_p")
        if n is not None and (isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1):
            raise InvalidInputError(
                f"max_new_tokens must be a positive integer, got {n!r}", input_name="max_new_tokens"
            )
        seed = self.seed
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0):
            raise InvalidInputError(f"seed must be a non-negative integer, got {seed!r}", input_name="seed")
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if any(not isinstance(s, str) or not s for s in stops):
            raise InvalidInputError(f"stop must be non-empty strings, got {self.stop!r}", input_name="stop")
        # frozen: normalise through object.__setattr__ (a str, list or tuple becomes a tuple)
        object.__setattr__(self, "temperature", float(t))
        object.__setattr__(self, "top_p", None if p is None else float(p))
        object.__setattr__(self, "max_new_tokens", None if n is None else int(n))
        object.__setattr__(self, "stop", stops)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def choose_token(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator | None) -> int:
    """Pick the next token id from a 1-D ``logits`` row.

    Greedy takes the argmax (lowest id on ties, as torch does). Sampling applies
    temperature, then top-k, then top-p (nucleus: the smallest set of most likely
    tokens whose probability reaches ``top_p``), in float64, and inverts the CDF of
    what is left at one uniform draw from ``rng``.

    Logits with NaN or +inf (a damaged model, an overflow) raise :class:`InferenceError`:
    argmax and the CDF would otherwise silently pick a token from garbage.
    """
    if np.isnan(logits).any() or np.isposinf(logits).any():
        raise InferenceError("the model produced non-finite values (NaN or +inf) in its logits")
    if params.greedy:
        return int(np.argmax(logits))
    if rng is None:
        raise ValueError("sampling needs a random generator")
    # Shifted by the max before dividing: at a tiny temperature the best token scores 0 and
    # the rest -inf (greedy in effect) instead of inf - inf = NaN.
    scores = logits.astype(np.float64)
    with np.errstate(over="ignore"):  # overflowing to -inf is the intended limit
        scores = (scores - scores.max()) / params.temperature
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
