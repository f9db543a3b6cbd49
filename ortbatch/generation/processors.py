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

A constrained row (a :class:`~.constrained.RowGrammar` in its state) first has every token its
grammar does not allow set to ``-inf`` (:func:`~.constrained.mask_rows`), before all of the
above and before its logprobs, as vLLM applies the grammar bitmask to the logits it samples
and reports from; its ``top`` alternatives are the allowed tokens only (fewer than asked when
fewer are allowed).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import InferenceError
from .constrained import GrammarFailedError, RowGrammar, mask_rows
from .sampling import SamplingParams, choose_token

__all__ = ["RowState", "TokenLogprob", "choose_rows", "log_softmax", "top_logprobs"]


@dataclass(frozen=True)
class TokenLogprob:
    """One position's log-probabilities: the token's own and the ``top`` alternatives
    (``(token_id, logprob)``, most likely first; as many as ``logprobs`` asked). ``rank``: the
    token's among the vocabulary (1 the most likely; ties count against it, as vLLM's), for
    prompt tokens."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None


class RowState:
    """What a row with extras remembers between steps: which tokens it saw and how often,
    and where it is in its grammar (``grammar``, for a constrained row)."""

    def __init__(
        self,
        params: SamplingParams,
        prompt: np.ndarray,
        vocab: int,
        eos: Sequence[int],
        grammar: RowGrammar | None = None,
    ) -> None:
        self.params = params
        self.grammar = grammar
        p = params
        #: How often each id was generated (frequency/presence penalties).
        self.counts = np.zeros(vocab, np.int32) if (p.frequency_penalty or p.presence_penalty) else None
        #: Ids in the prompt or generated (repetition penalty).
        self.seen: np.ndarray | None = None
        if p.repetition_penalty not in (None, 1.0):  # None: resolved at submit, never seen here
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
        if self.grammar is not None:
            self.grammar.advance(token)
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


def top_logprobs(scores: np.ndarray, k: int, lse: np.ndarray | None = None) -> list[tuple[tuple[int, float], ...]]:
    """The ``k`` most likely ``(id, logprob)`` of each row, most likely first (lower id on ties).
    ``scores`` are logprobs, or logits with ``lse`` their rows' log-sum-exp."""
    if k <= 0:
        return [()] * scores.shape[0]
    k = min(k, scores.shape[-1])
    if k <= 20:
        # A few argmax passes beat argpartition's selection over a large vocabulary by ~10x;
        # argmax takes the lowest id on ties, so the order is the one asked.
        work = np.array(scores, np.float32)
        picked = np.empty((work.shape[0], k), np.int64)
        every = np.arange(work.shape[0])
        for c in range(k):
            picked[:, c] = work.argmax(axis=-1)
            work[every, picked[:, c]] = -np.inf
        ids, vals = picked, np.take_along_axis(np.asarray(scores, np.float32), picked, axis=-1)
    else:
        part = np.argpartition(-scores, k - 1, axis=-1)[:, :k]
        vals = np.take_along_axis(scores, part, axis=-1)
        order = np.lexsort((part, -vals), axis=-1)
        ids, vals = np.take_along_axis(part, order, axis=-1), np.take_along_axis(vals, order, axis=-1)
    if lse is not None:
        vals = vals - lse[:, None]
    return [
        tuple(zip(map(int, i), map(float, v), strict=True)) for i, v in zip(ids.tolist(), vals.tolist(), strict=True)
    ]


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


def _mask_constrained(raw: np.ndarray, states: Sequence[RowState]) -> dict[int, InferenceError]:
    """Mask the constrained rows of ``raw`` in place; the rows whose grammar failed, with their error."""
    constrained = [k for k, s in enumerate(states) if s.grammar is not None]
    if not constrained:
        return {}
    grammars: list[RowGrammar] = [states[k].grammar for k in constrained]  # type: ignore[misc]
    if len(constrained) == len(states):
        errors = mask_rows(raw, grammars)
    else:
        sub = raw[constrained]
        errors = mask_rows(sub, grammars)
        raw[constrained] = sub
    return {
        k: GrammarFailedError(f"{g.kind or 'the grammar'} failed while decoding: {e}", input_name=g.kind)
        for k, g, e in zip(constrained, grammars, errors, strict=True)
        if e is not None
    }


def _choose(row: np.ndarray, params: SamplingParams, rng: np.random.Generator | None) -> int | InferenceError:
    try:
        return choose_token(row, params, rng)
    except InferenceError as exc:
        return exc


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
    extra = [j for j, s in enumerate(states) if s is not None]
    if not extra:  # the fast path: no row asked for anything beyond sampling
        return [(_choose(logits[r], p, g), None) for p, g, r in zip(params, rngs, rows, strict=True)]
    out: list[Choice] = [(0, None)] * len(params)
    extras = set(extra)
    for j, (p, g, r) in enumerate(zip(params, rngs, rows, strict=True)):
        if j not in extras:
            out[j] = (_choose(logits[r], p, g), None)
    raw = np.asarray(logits[[rows[j] for j in extra]], np.float32)  # a copy (fancy indexing)
    failed = _mask_constrained(raw, [states[j] for j in extra])  # type: ignore[misc]
    chosen = raw
    processing = [k for k, j in enumerate(extra) if params[j].processes_logits]
    if processing:
        chosen = raw.copy()
        chosen[processing] = process(raw[processing], [states[extra[k]] for k in processing])  # type: ignore[misc]
    tokens = [failed.get(k) or _choose(chosen[k], params[j], rngs[j]) for k, j in enumerate(extra)]
    wanting = [k for k, j in enumerate(extra) if params[j].logprobs is not None]
    scored: dict[int, TokenLogprob] = {}
    if wanting:
        sub = raw[wanting]
        # log p = x - logsumexp(x): only the chosen and the top-k entries are ever needed
        top_k = max(params[extra[k]].logprobs or 0 for k in wanting)
        m = sub.max(axis=-1, keepdims=True)
        lse = (m + np.log(np.exp(sub - m).sum(axis=-1, keepdims=True)))[:, 0]
        tops = top_logprobs(sub, top_k, lse)
        for n, k in enumerate(wanting):
            token = tokens[k]
            if isinstance(token, int):
                j = extra[k]
                top = tops[n][: params[j].logprobs]
                if states[j].grammar is not None:  # type: ignore[union-attr]
                    top = tuple(t for t in top if t[1] != -np.inf)  # only the tokens its grammar allows
                scored[k] = TokenLogprob(token, float(sub[n, token] - lse[n]), top)
    for k, j in enumerate(extra):
        out[j] = (tokens[k], scored.get(k))
    return out
