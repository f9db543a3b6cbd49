"""Beam search of one request, step by step, as transformers' ``_beam_search`` (4.57) does it. Pure numpy.

transformers runs every request of a batch in lockstep, but each request's beams only ever
read their own scores: what one request returns does not depend on the others. So ortbatch
keeps one :class:`BeamSearch` per request and its ``num_beams`` rows anywhere in the decode
batch, beside greedy and sampled rows; each step :meth:`BeamSearch.step` takes the processed
log-probabilities of its rows and says which row each new beam continues (the caller moves
the rows' self-attention cache accordingly, as ``_reorder_cache`` does) and its new token.

The arithmetic is transformers' (float32 scores, the top ``max(2, 1 + eos) * num_beams``
continuations, finished hypotheses kept in ``num_beams`` slots with the length penalty, the
early-stop heuristic with ``early_stopping`` True / False / ``"never"``), so the hypotheses and
their order are the ones ``generate(num_beams=...)`` returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["BeamSearch", "Hypothesis"]

_NEG = np.float32(-1.0e9)


def _topk(values: np.ndarray, k: int) -> np.ndarray:
    """Indices of the ``k`` largest, largest first; ties keep the lower index first (torch.topk's
    CPU order for the sizes involved)."""
    return np.argsort(-values, kind="stable")[:k]


@dataclass(frozen=True)
class Hypothesis:
    """One returned sequence: the generated tokens (the decoder prompt excluded, eos included when
    it ended on one), its score (log-probability / length ** length_penalty) and whether it ended
    on eos."""

    tokens: tuple[int, ...]
    score: float
    ended_on_eos: bool


class BeamSearch:
    """The beams of one request. ``prompt``: its decoder prompt (the decoder start token for an
    encoder-decoder model); ``max_length`` counts it, as ``generate``'s does."""

    def __init__(
        self,
        num_beams: int,
        prompt: Sequence[int],
        max_length: int,
        eos_token_ids: Sequence[int],
        length_penalty: float = 1.0,
        early_stopping: bool | str = False,
        num_return_sequences: int = 1,
    ) -> None:
        self.num_beams = nb = num_beams
        self.prompt_length = len(prompt)
        self.max_length = max_length
        self.eos = np.array(sorted(set(eos_token_ids)), np.int64)
        self.length_penalty = float(length_penalty)
        self.early_stopping = early_stopping
        self.num_return_sequences = num_return_sequences
        self.keep = max(2, 1 + self.eos.size) * nb
        self.top_mask = np.arange(self.keep) < nb
        self.cur_len = len(prompt)
        self.running = np.zeros((nb, max_length), np.int64)
        self.running[:, : self.cur_len] = np.asarray(prompt, np.int64)
        self.running_scores = np.zeros(nb, np.float32)
        self.running_scores[1:] = _NEG
        self.sequences = self.running.copy()
        self.lengths = np.full(nb, self.cur_len, np.int64)  # of each finished slot
        self.scores = np.full(nb, _NEG, np.float32)
        self.finished = np.zeros(nb, bool)
        self.heuristic = True
        self.done = False

    def histories(self) -> list[list[int]]:
        """Each running beam's decoder sequence so far (for the logits processors)."""
        return [list(map(int, row[: self.cur_len])) for row in self.running]

    def step(self, log_probs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """One step from ``log_probs`` (``[num_beams, vocab]``, the processed log-softmax of each
        running beam): returns ``(source, tokens)``, the running beam each new beam continues and
        its new token. Sets :attr:`done` when the search ends (then nothing more is read)."""
        nb, vocab = log_probs.shape
        cur = self.cur_len
        acc = (np.asarray(log_probs, np.float32) + self.running_scores[:, None]).reshape(-1)
        top = _topk(acc, self.keep)
        top_scores = acc[top]
        src, ids = top // vocab, top % vocab
        top_seqs = self.running[src].copy()
        top_seqs[:, cur] = ids
        hits = np.isin(ids, self.eos) | (cur + 1 >= self.max_length)
        # the running beams of the next step: the best continuations that did not finish
        running_scores = (top_scores + hits.astype(np.float32) * _NEG).astype(np.float32)
        nxt = _topk(running_scores, nb)
        self.running = top_seqs[nxt]
        self.running_scores = running_scores[nxt]
        source = src[nxt]
        tokens = ids[nxt]
        self._update_finished(top_seqs, top_scores, hits, cur)
        self.cur_len = cur = cur + 1
        self._check_heuristic()
        exists_open = not (bool(self.finished.all()) and self.early_stopping is True)
        if not (self.heuristic and exists_open and not bool(hits.all())):
            self.done = True
        return source, tokens

    def _update_finished(self, seqs: np.ndarray, scores: np.ndarray, hits: np.ndarray, cur: int) -> None:
        just = hits & self.top_mask
        denom = np.float32((cur + 1 - self.prompt_length) ** self.length_penalty)
        s = (scores / denom).astype(np.float32)
        if bool(self.finished.all()) and self.early_stopping is True:
            s = s + _NEG
        if not self.heuristic:
            s = s + _NEG
        s = (s + (~just).astype(np.float32) * _NEG).astype(np.float32)
        merged = np.concatenate([self.scores, s])
        pick = _topk(merged, self.num_beams)
        all_seqs = np.concatenate([self.sequences, seqs])
        all_lengths = np.concatenate([self.lengths, np.full(len(seqs), cur + 1, np.int64)])
        self.sequences = all_seqs[pick]
        self.lengths = all_lengths[pick]
        self.scores = merged[pick]
        self.finished = np.concatenate([self.finished, just])[pick]

    def _check_heuristic(self) -> None:
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_len = self.max_length - self.prompt_length
        else:
            best_len = self.cur_len - self.prompt_length
        best = np.float32(self.running_scores[0] / np.float32(best_len**self.length_penalty))
        worst = np.where(self.finished, self.scores.min(), _NEG)
        self.heuristic = self.heuristic and bool((best > worst).any())

    def results(self) -> list[Hypothesis]:
        """The ``num_return_sequences`` best hypotheses, best first."""
        out = []
        for i in range(self.num_return_sequences):
            end = int(self.lengths[i])
            tokens = tuple(int(t) for t in self.sequences[i, self.prompt_length : end])
            eos = bool(tokens) and tokens[-1] in set(self.eos.tolist())
            out.append(Hypothesis(tokens, float(self.scores[i]), eos))
        return out
