"""The prefill of the requests admitted at a step boundary (runs on the step loop's thread).

Prompts are grouped by length (:meth:`Scheduler.prefill_groups`) and each group runs once;
a failed group is split so only a request that fails alone gets the error. The ``n``
choices of one prompt admitted together are prefilled once, through their leader (choice
0): the leader's cache row is copied into each choice's row and each chooses its own first
token from the leader's logits. Prompt logprobs are scored here, and requests that asked for
no new tokens (``max_new_tokens=0``: prompt logprobs only) are settled here.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import OrtBatchError
from .cache import KVCache
from .requests import GenerationRequest, StreamToken
from .runner import DecoderRunner
from .scheduler import Scheduler
from .scoring import PromptScorer, prompt_logprobs
from .stats import GenerationStatsRecorder

__all__ = ["Prefill"]


class Prefill:
    """Prefills admitted requests on ``runner``, recording outcomes in ``scheduler``."""

    def __init__(
        self, runner: DecoderRunner, scheduler: Scheduler, stats: GenerationStatsRecorder, scorer: PromptScorer
    ) -> None:
        self.runner, self._scheduler, self._stats, self._scorer = runner, scheduler, stats, scorer

    def run(self, reqs: list[GenerationRequest]) -> tuple[list[KVCache], list[GenerationRequest]]:
        """Prefill ``reqs``; returns the caches of those still generating, and them in row order."""
        caches: list[KVCache] = []
        joined: list[GenerationRequest] = []
        admitted = {id(r) for r in reqs}
        followers: dict[int, list[GenerationRequest]] = {}
        leaders = []
        for r in reqs:
            if r.leader is not None and id(r.leader) in admitted:
                followers.setdefault(id(r.leader), []).append(r)
            else:  # alone, or admitted without its leader: prefilled on its own
                leaders.append(r)
        pending = self._scheduler.prefill_groups(leaders)
        while pending:
            group = pending.pop(0)
            result = self._group(group, followers)
            if result is None:  # the group failed: split it so only a failing request fails
                if len(group) > 1:
                    pending[:0] = [[r] for r in group]
                continue
            cache, survivors = result
            caches.append(cache)
            joined.extend(survivors)
        return caches, joined

    def _group(
        self, group: list[GenerationRequest], followers: dict[int, list[GenerationRequest]]
    ) -> tuple[KVCache, list[GenerationRequest]] | None:
        sched = self._scheduler
        members = [m for r in group for m in (r, *followers.get(id(r), ()))]
        t0 = time.perf_counter()
        try:
            logits, cache = self.runner.prefill([r.prompt for r in group])
            scored = [self._score(r, logits, i) for i, r in enumerate(group)]
        except OrtBatchError as exc:
            self._stats.prefill(time.perf_counter() - t0, 0)
            if len(group) == 1:
                for m in members:
                    sched.fail(m, exc)
            return None
        self._stats.prefill(time.perf_counter() - t0, int(cache.lens.sum()))
        source = []  # the prefilled row each member's first token and cache come from
        for i, r in enumerate(group):
            for m in (r, *followers.get(id(r), ())):
                m.prompt_logprobs = scored[i]
                if scored[i] is not None and m.on_token is not None:
                    m.on_token = _with_prompt_logprobs(m.on_token, scored[i])
                source.append(i)
        wanting = [j for j, m in enumerate(members) if m.max_new_tokens > 0]
        for m in members:
            if m.max_new_tokens == 0:
                sched.finish_without_tokens(m)
        done = sched.next_tokens([members[j] for j in wanting], logits[:, -1], [source[j] for j in wanting])
        keep = [j for j, d in zip(wanting, done, strict=True) if not d]
        # Repeating a prefilled row copies its cache into each choice's row.
        cache.keep([source[j] for j in keep])
        return cache, [members[j] for j in keep]

    def _score(self, req: GenerationRequest, logits: np.ndarray, row: int) -> Any:
        """``req``'s prompt logprobs when it asked (from the prefill's logits when they hold every position)."""
        k = req.params.prompt_logprobs
        if k is None:
            return None
        n = int(req.prompt.shape[0])
        if not self.runner.last_position_logits:
            return prompt_logprobs(req.prompt, np.asarray(logits[row, logits.shape[1] - n :], np.float32), k)
        return self._scorer.score(req.prompt, k)


def _with_prompt_logprobs(on_token: Callable[[StreamToken], None], scored: Any) -> Callable[[StreamToken], None]:
    """``on_token`` whose first token carries the prompt's logprobs (a stream shows them with it)."""

    def call(token: StreamToken) -> None:
        on_token(dataclasses.replace(token, prompt_logprobs=scored) if token.index == 0 else token)

    return call
