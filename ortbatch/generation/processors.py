"""Logits processors and logprobs, applied only to the rows that asked, over the batch. Pure numpy.

A row whose :class:`SamplingParams` has no extras (no penalty, bias, ``min_tokens`` or
``logprobs``) takes the fast path: :func:`choose_rows` hands its logits row, a view, straight
to :func:`choose_token` as before. The rows with extras are gathered into one
``[rows, vocab]`` float32 array and each processor runs once over the rows that use it:

1. ``logit_bias`` (OpenAI): the bias is added to the token's logit;
2. ``min_tokens`` (vLLM; transformers' ``MinNewTokensLengthLogitsProcessor``): eos and
   ``stop_token_ids`` get ``-inf`` while fewer tokens than that were generated;
3. ``repetition_penalty`` (transformers' ``RepetitionPenaltyLogitsProcessor``, which vLLM
   follows): every token of the prompt or the generated text: ``logit / r`` when positive,
   ``logit * r`` otherwise;
4. ``frequency_penalty`` / ``presence_penalty`` (OpenAI): ``logit -= f * count + p * (count > 0)``
   where ``count`` is how often the token was generated (the prompt does not count, as in
   OpenAI's definition and vLLM).

The order is vLLM's (bias and min_tokens, then the penalties). ``logprobs`` are taken from
the raw logits, before all of it and before temperature (vLLM's default ``raw_logprobs``,
OpenAI's "before temperature"): a log-softmax in float32 of the model's logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import InferenceError
from .sampling import SamplingParams, choose_token

__all__ = ["RowState", "TokenLogprob", "choose_rows", "log_softmax", "top_logprobs"]


@dataclass(frozen=True)
class TokenLogprob:
    """One position's log-probabilities: the token's own and the ``top`` alternatives
    (``(token_id, logprob)``, most likely first; as many as ``logprobs`` asked)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class RowState:
    """What a row with extras remembers between steps: which tokens it saw and how often."""

    def __init__(self, params: SamplingParams, prompt: np.ndarray, vocab: int, eos: Sequence[int]) -> None:
        self.params = params
        p = params
        #: How often each id was generated (frequency/presence penalties).
        self.counts = np.zeros(vocab, np.int32) if (p.frequency_penalty or p.presence_penalty) else None
        #: Ids in the prompt or generated (repetition penalty).
        self.seen: np.ndarray | None = None
        if p.repetition_penalty != 1.0:
            self.seen = np.zeros(vocab, bool)
            self.seen[prompt] = True
        bias = dict(p.logit_bias)
        self.bias_ids = np.array(list(bias), np.int64)
        self.bias_values = np.array(list(bias.values()), np.float32)
        # vLLM masks eos (unless ignore_eos) and stop_token_ids before min_tokens
        banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos))
        self.banned = np.array(sorted(banned), np.int64)
        self.generated = 0

    def observe(self, token: int) -> None:
        self.generated += 1
        if self.counts is not None:
            self.counts[token] += 1
        if self.seen is not None:
            self.seen[token] = True


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float32 (``[rows, vocab]``)."""
    x = np.asarray(logits, np.float32)
    shifted = x - x.max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def top_logprobs(logprobs: np.ndarray, k: int) -> list[tuple[tuple[int, float], ...]]:
    """The ``k`` most likely ``(id, logprob)`` of each row, most likely first (lower id on ties)."""
    if k <= 0:
        return [()] * logprobs.shape[0]
    k = min(k, logprobs.shape[-1])
    part = np.argpartition(-logprobs, k - 1, axis=-1)[:, :k]
    vals = np.take_along_axis(logprobs, part, axis=-1)
    order = np.lexsort((part, -vals), axis=-1)
    ids, vals = np.take_along_axis(part, order, axis=-1), np.take_along_axis(vals, order, axis=-1)
    return [tuple(zip(map(int, i), map(float, v), strict=True)) for i, v in zip(ids, vals, strict=True)]


def process(logits: np.ndarray, states: Sequence[RowState]) -> np.ndarray:
    """Apply each processor once over the rows (of ``logits``, float32, modified in place) using it."""
    for j, s in enumerate(states):
        if s.bias_ids.size:
            logits[j, s.bias_ids] += s.bias_values
        if s.generated < s.params.min_tokens and s.banned.size:
            logits[j, s.banned] = -np.inf
    rep = [j for j, s in enumerate(states) if s.seen is not None]
    if rep:
        seen = np.stack([states[j].seen for j in rep])  # type: ignore[misc]
        pen = np.array([states[j].params.repetition_penalty for j in rep], np.float32)[:, None]
        sub = logits[rep]
        logits[rep] = np.where(seen, np.where(sub < 0, sub * pen, sub / pen), sub)
    freq = [j for j, s in enumerate(states) if s.counts is not None]
    if freq:
        counts = np.stack([states[j].counts for j in freq]).astype(np.float32)  # type: ignore[misc]
        f = np.array([states[j].params.frequency_penalty for j in freq], np.float32)[:, None]
        p = np.array([states[j].params.presence_penalty for j in freq], np.float32)[:, None]
        logits[freq] -= f * counts + p * (counts > 0)
    return logits


Choice = tuple[int | InferenceError, TokenLogprob | None]


def choose_rows(
    params: Sequence[SamplingParams],
    states: Sequence[RowState | None],
    rngs: Sequence[np.random.Generator | None],
    logits: np.ndarray,
    rows: Sequence[int],
) -> list[Choice]:
    """The next token of each request ``j`` from ``logits[rows[j]]`` (``logits``: ``[R, vocab]``),
    with its :class:`TokenLogprob` where ``logprobs`` was asked. A request whose logits are not
    finite gets the :class:`InferenceError` instead of a token (it alone fails)."""
    out: list[Choice | None] = [None] * len(params)
    extra = [j for j, s in enumerate(states) if s is not None]
    chosen_logits: dict[int, np.ndarray] = {}
    if extra:
        raw = np.asarray(logits[[rows[j] for j in extra]], np.float32)
        processing = [k for k, j in enumerate(extra) if params[j].processes_logits]
        if processing:
            sub = process(raw[processing].copy(), [states[extra[k]] for k in processing])  # type: ignore[misc]
            for n, k in enumerate(processing):
                chosen_logits[extra[k]] = sub[n]
        for k, j in enumerate(extra):
            chosen_logits.setdefault(j, raw[k])
        wanting = [k for k, j in enumerate(extra) if params[j].logprobs is not None]
        if wanting:
            lps = log_softmax(raw[wanting])
            tops = top_logprobs(lps, max(params[extra[k]].logprobs or 0 for k in wanting))
            for n, k in enumerate(wanting):
                j = extra[k]
                try:
                    token = choose_token(chosen_logits[j], params[j], rngs[j])
                except InferenceError as exc:
                    out[j] = (exc, None)
                    continue
                top = tops[n][: params[j].logprobs]
                out[j] = (token, TokenLogprob(token, float(lps[n, token]), top))
    for j in range(len(params)):
        if out[j] is not None:
            continue
        row = chosen_logits[j] if j in chosen_logits else logits[rows[j]]
        try:
            out[j] = (choose_token(row, params[j], rngs[j]), None)
        except InferenceError as exc:
            out[j] = (exc, None)
    return out  # type: ignore[return-value]
