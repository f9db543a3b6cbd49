"""Prompt logprobs (``prompt_logprobs``, what ``echo`` with logprobs and lm-evaluation-harness's
loglikelihood requests need): the log-probability of every prompt token given those before it.

The generator's graph usually returns the last position's logits only (the
``last_position_logits`` rewrite), which is all generation needs. Scoring a prompt needs
every position's, so the first request that asks builds a second session on the export as
it is (all positions) and runs its prompt through it; a generator whose graph already
returns every position reuses its prefill's logits and builds nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from .processors import TokenLogprob, log_softmax, top_logprobs

__all__ = ["PromptScorer", "prompt_logprobs"]

log = logging.getLogger("ortbatch.generation")


def prompt_logprobs(prompt: np.ndarray, logits: np.ndarray, k: int) -> tuple[TokenLogprob | None, ...]:
    """``logits``: ``[len(prompt), vocab]``, position ``t`` predicting token ``t + 1``. The first
    token has none (``None``), as in vLLM and OpenAI's ``echo``. Each carries its rank."""
    lps = log_softmax(logits[:-1])
    targets = prompt[1:]
    own = lps[np.arange(len(targets)), targets]
    ranks = (lps >= own[:, None]).sum(axis=-1)
    tops = top_logprobs(lps, k)
    scored = (
        TokenLogprob(int(t), float(v), top, int(r)) for t, v, top, r in zip(targets, own, tops, ranks, strict=True)
    )
    return (None, *scored)


class PromptScorer:
    """Scores prompts; ``full_runner`` builds a runner whose prefill returns every position."""

    def __init__(self, full_runner: Callable[[], Any]) -> None:
        self._make = full_runner
        self._runner: Any = None

    def score(self, prompt: np.ndarray, k: int) -> tuple[TokenLogprob | None, ...]:
        if self._runner is None:  # only the step loop's thread scores
            log.info("prompt_logprobs asked: loading the export once more with logits for every position")
            self._runner = self._make()
        logits, _ = self._runner.prefill([prompt])
        return prompt_logprobs(prompt, np.asarray(logits[0], np.float32), k)
