"""Issue 28, acceptance 1: sampling extras against transformers, in batches of mixed requests.

Greedy with each penalty, ``min_tokens``, ``logit_bias`` and ``stop_token_ids`` must equal
``model.generate`` with the matching transformers ``LogitsProcessor`` (presence and frequency
penalties, which transformers lacks, by a processor written to OpenAI's definition) while
plain rows in the same batch give exactly the tokens they give alone; logprobs must equal
``log_softmax`` of the PyTorch model's logits to 1e-4; ``n`` choices with a seed repeat.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from ortbatch import BatchedGenerator
from ortbatch.generation import SamplingParams

from .conftest import EOS, TinyModel, random_prompts

pytestmark = [pytest.mark.export]

PROMPTS = random_prompts([6, 13, 3, 21, 9, 17, 4, 11], seed=5)
NEW = 14


def hf_generate(model: TinyModel, prompt: list[int], new: int, processors: list, eos: list[int] | None = None) -> list:
    import torch
    from transformers import LogitsProcessorList

    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new,
            do_sample=False,
            pad_token_id=EOS,
            eos_token_id=eos or [EOS],
            logits_processor=LogitsProcessorList(processors),
        )
    return out[0, len(prompt) :].tolist()


def hf_logprobs(model: TinyModel, tokens: list[int]) -> np.ndarray:
    """log_softmax of the PyTorch model's logits at every position of ``tokens``."""
    import torch

    with torch.no_grad():
        logits = model.hf(torch.tensor([tokens])).logits[0].float()
    return torch.log_softmax(logits, dim=-1).numpy()


class OpenAIPenalties:
    """OpenAI's presence/frequency penalties as a transformers logits processor: counts of the
    tokens generated so far (the prompt does not count)."""

    def __init__(self, prompt_len: int, frequency: float, presence: float) -> None:
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        import torch

        generated = input_ids[:, self.prompt_len :]
        counts = torch.zeros_like(scores).scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def together(gen: BatchedGenerator, requests: list[tuple[list[int], SamplingParams]]) -> list:
    """Submit every request while a one-token blocker holds the scheduler, so they prefill
    and decode in one batch. Their completions."""
    entered, gate = threading.Event(), threading.Event()

    def hold(_token: object) -> None:
        entered.set()
        gate.wait(10)

    blocker = gen.submit([5, 6], 1, on_token=hold)
    assert entered.wait(10)
    futures = [gen.submit(p, params=params) for p, params in requests]
    gate.set()
    blocker.result(10)
    return [f.result(60) for f in futures]


def cases(model: TinyModel) -> list[tuple[str, dict, Callable[[list[int]], list], list[int] | None]]:
    """(name, SamplingParams fields, transformers processors for a prompt, extra eos ids)."""
    from transformers import (
        MinNewTokensLengthLogitsProcessor,
        RepetitionPenaltyLogitsProcessor,
        SequenceBiasLogitsProcessor,
    )

    # A stop id the plain greedy run of PROMPTS[5] reaches at its 4th token (and not before).
    plain = model.reference(PROMPTS[5], NEW)
    stop_id = next(t for i, t in enumerate(plain) if i >= 3 and t not in plain[:i] and t != EOS)
    bias = {7: 6.0, 11: -100.0, 40: 3.5}
    return [
        ("repetition 1.8", {"repetition_penalty": 1.8}, lambda p: [RepetitionPenaltyLogitsProcessor(1.8)], None),
        ("repetition 0.5", {"repetition_penalty": 0.5}, lambda p: [RepetitionPenaltyLogitsProcessor(0.5)], None),
        ("presence", {"presence_penalty": 1.7}, lambda p: [OpenAIPenalties(len(p), 0.0, 1.7)], None),
        ("frequency", {"frequency_penalty": 1.3}, lambda p: [OpenAIPenalties(len(p), 1.3, 0.0)], None),
        (
            "logit_bias",
            {"logit_bias": bias},
            lambda p: [SequenceBiasLogitsProcessor({(k,): v for k, v in bias.items()})],
            None,
        ),
        (
            # eos pushed up so it would come first: min_tokens must hold it off for 5 tokens
            "min_tokens",
            {"min_tokens": 5, "logit_bias": {EOS: 9.0}},
            lambda p: [
                SequenceBiasLogitsProcessor({(EOS,): 9.0}),
                MinNewTokensLengthLogitsProcessor(len(p), 5, EOS),
            ],
            None,
        ),
        ("stop_token_ids", {"stop_token_ids": [stop_id]}, lambda p: [], [EOS, stop_id]),
        (
            "all penalties",
            {"repetition_penalty": 1.3, "frequency_penalty": 0.6, "presence_penalty": -0.4, "logit_bias": {9: 2.0}},
            lambda p: [
                SequenceBiasLogitsProcessor({(9,): 2.0}),
                RepetitionPenaltyLogitsProcessor(1.3),
                OpenAIPenalties(len(p), 0.6, -0.4),
            ],
            None,
        ),
    ]


def test_processors_match_transformers_beside_plain_rows(tiny: TinyModel, no_thread_leak: None) -> None:
    todo = cases(tiny)
    requests: list[tuple[list[int], SamplingParams]] = []
    expected: list[tuple[str, list]] = []
    for k, (name, fields, processors, eos) in enumerate(todo):
        prompt = PROMPTS[k % len(PROMPTS)] if name != "stop_token_ids" else PROMPTS[5]
        requests.append((prompt, SamplingParams(max_new_tokens=NEW, **fields)))
        expected.append((name, hf_generate(tiny, prompt, NEW, processors(prompt), eos)))
        # a plain row between each pair: it must give what it gives alone
        plain = PROMPTS[(k + 3) % len(PROMPTS)]
        requests.append((plain, SamplingParams(max_new_tokens=NEW)))
        expected.append(("plain", tiny.reference(plain, NEW)))
    with BatchedGenerator(tiny.export, max_batch_size=len(requests)) as gen:
        results = together(gen, requests)
        # every row that outlives its first token decodes in the one batch
        assert gen.stats().max_decode_rows == sum(len(want) > 1 for _, want in expected)
    for (name, want), out in zip(expected, results, strict=True):
        assert list(out.token_ids) == want, name
    # each processor changed what greedy gives (otherwise the comparison proves nothing)
    for (name, want), (prompt, _) in zip(expected[::2], requests[::2], strict=True):
        assert want != tiny.reference(prompt, NEW), name
    stopped = results[2 * [c[0] for c in todo].index("stop_token_ids")]
    assert stopped.finish_reason == "stop" and len(stopped.token_ids) < NEW
    held = results[2 * [c[0] for c in todo].index("min_tokens")]
    assert held.token_ids[5] == EOS and EOS not in held.token_ids[:5]


def test_logprobs_equal_log_softmax_of_transformers_logits(tiny: TinyModel, no_thread_leak: None) -> None:
    """Chosen and top-5 logprobs of every token, from the raw logits: also on a row whose
    penalty changed which tokens were chosen (logprobs are taken before processing)."""
    requests = [
        (PROMPTS[0], SamplingParams(max_new_tokens=NEW, logprobs=5)),
        (PROMPTS[1], SamplingParams(max_new_tokens=NEW)),
        (PROMPTS[3], SamplingParams(max_new_tokens=NEW, logprobs=0, repetition_penalty=2.0)),
        (PROMPTS[2], SamplingParams(max_new_tokens=NEW, logprobs=3, temperature=0.9, seed=3)),
    ]
    with BatchedGenerator(tiny.export, max_batch_size=8) as gen:
        results = together(gen, requests)
    assert results[1].logprobs is None and list(results[1].token_ids) == tiny.reference(PROMPTS[1], NEW)
    for (prompt, params), out in zip(requests, results, strict=True):
        if params.logprobs is None:
            continue
        assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
        ref = hf_logprobs(tiny, [*prompt, *out.token_ids])
        for t, (token, lp) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
            row = ref[len(prompt) - 1 + t]
            assert lp.token_id == token
            assert abs(lp.logprob - row[token]) < 1e-4
            assert len(lp.top) == params.logprobs
            order = np.argsort(-row, kind="stable")[: params.logprobs]
            np.testing.assert_allclose([v for _, v in lp.top], row[order], atol=1e-4)
            assert [i for i, _ in lp.top] == order.tolist()


@pytest.mark.parametrize("last_position_logits", [None, False])
def test_prompt_logprobs_with_no_new_tokens(tiny: TinyModel, last_position_logits: bool | None) -> None:
    """echo + logprobs + max_tokens 0 (lm-evaluation-harness's loglikelihood): every prompt
    token's logprob, whether the graph returns every position or the last one only."""
    prompt = PROMPTS[3]
    with BatchedGenerator(tiny.export, last_position_logits=last_position_logits) as gen:
        scored = gen.generate(prompt, params=SamplingParams(max_new_tokens=0, prompt_logprobs=2))
        both = gen.generate(prompt, params=SamplingParams(max_new_tokens=4, prompt_logprobs=0))
    ref = hf_logprobs(tiny, prompt)
    assert scored.token_ids == () and scored.finish_reason == "length"
    assert scored.prompt_token_ids == tuple(prompt) and scored.prompt_logprobs is not None
    assert scored.prompt_logprobs[0] is None
    for t in range(1, len(prompt)):
        lp = scored.prompt_logprobs[t]
        assert lp is not None and lp.token_id == prompt[t]
        assert abs(lp.logprob - ref[t - 1, prompt[t]]) < 1e-4
        assert [i for i, _ in lp.top] == np.argsort(-ref[t - 1], kind="stable")[:2].tolist()
    assert list(both.token_ids) == tiny.reference(prompt, 4)
    assert both.prompt_logprobs is not None and both.prompt_logprobs[1] is not None
    assert both.prompt_logprobs[1].top == ()


def test_n_choices_share_one_prefill_and_repeat_with_a_seed(tiny_gpt2: TinyModel, no_thread_leak: None) -> None:
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=11, n=4, logprobs=1)
    with BatchedGenerator(tiny_gpt2.export, max_batch_size=8) as gen:
        before = gen.stats().prefill_runs
        first = gen.generate_choices(PROMPTS[4], params=params)
        assert gen.stats().prefill_runs == before + 1  # one prefill for the four
        again = gen.generate_choices(PROMPTS[4], params=params)
        alone = gen.generate(PROMPTS[4], 12, temperature=1.0, seed=11)
        greedy = gen.generate_choices(PROMPTS[4], 12, n=3)

        async def streamed() -> dict[int, list[int]]:
            got: dict[int, list[int]] = {}
            async for tok in gen.stream(PROMPTS[4], params=params):
                got.setdefault(tok.choice, []).append(tok.token_id)
            return got

        stream = asyncio.run(streamed())
    seqs = [list(c.token_ids) for c in first]
    assert [c.index for c in first] == [0, 1, 2, 3]
    assert seqs == [list(c.token_ids) for c in again]
    assert len({tuple(s) for s in seqs}) > 1  # each choice samples its own stream
    assert seqs[0] == list(alone.token_ids)  # choice 0 is the lone request with that seed
    assert stream == dict(enumerate(seqs))
    ref = tiny_gpt2.reference(PROMPTS[4], 12)
    assert [list(c.token_ids) for c in greedy] == [ref] * 3


def test_seeded_plain_rows_are_untouched_by_rows_with_extras(tiny_gpt2: TinyModel, no_thread_leak: None) -> None:
    """A sampled row draws the same tokens beside penalised, biased and logprob rows as alone;
    streamed tokens carry the logprobs the whole completion reports."""
    sampled = SamplingParams(max_new_tokens=NEW, temperature=0.8, top_k=40, seed=21)
    busy = [
        SamplingParams(max_new_tokens=NEW, repetition_penalty=1.5, logprobs=2),
        SamplingParams(max_new_tokens=NEW, temperature=0.7, seed=4, frequency_penalty=1.0, logit_bias={8: 4}),
        SamplingParams(max_new_tokens=NEW, min_tokens=3, presence_penalty=0.5),
    ]
    with BatchedGenerator(tiny_gpt2.export, max_batch_size=8) as gen:
        alone = gen.generate(PROMPTS[6], params=sampled)
        mixed = together(gen, [(PROMPTS[6], sampled), *[(p, b) for p, b in zip(PROMPTS, busy, strict=False)]])

        async def streamed() -> list:
            return [tok async for tok in gen.stream(PROMPTS[0], params=busy[0])]

        tokens = asyncio.run(streamed())
    assert mixed[0].token_ids == alone.token_ids
    assert tuple(t.token_id for t in tokens) == mixed[1].token_ids
    streamed_lps, whole = [t.logprob for t in tokens], mixed[1].logprobs
    assert whole is not None and all(lp is not None for lp in streamed_lps)
    # alone and in a batch of four, the model's float sums differ in the last bits
    for a, b in zip(streamed_lps, whole, strict=True):
        assert a is not None and a.token_id == b.token_id and [i for i, _ in a.top] == [i for i, _ in b.top]
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
