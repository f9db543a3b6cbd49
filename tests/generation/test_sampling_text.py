"""Issue 28: what the text of a completion holds with stop_token_ids, include_stop_str_in_output,
skip_special_tokens and ignore_eos (vLLM's definitions), and each token's bytes."""

from __future__ import annotations

import pytest

from ortbatch import BatchedGenerator
from ortbatch.generation import SamplingParams

from .conftest import CORPUS, EOS, TinyModel, random_prompts

pytestmark = [pytest.mark.export]

PROMPT = random_prompts([9], seed=8)[0]


def test_stop_token_ids_end_the_text_before_the_token_unless_included(tiny_gpt2: TinyModel) -> None:
    ref = tiny_gpt2.reference(PROMPT, 16)
    k = next(i for i, t in enumerate(ref) if i >= 3 and t not in ref[:i] and t != EOS)
    with BatchedGenerator(tiny_gpt2.export) as gen:
        cut = gen.generate(PROMPT, params=SamplingParams(max_new_tokens=16, stop_token_ids=[ref[k]]))
        kept = gen.generate(
            PROMPT,
            params=SamplingParams(max_new_tokens=16, stop_token_ids=[ref[k]], include_stop_str_in_output=True),
        )
        assert list(cut.token_ids) == ref[: k + 1] == list(kept.token_ids)  # the stop id is in token_ids
        assert cut.finish_reason == "stop" == kept.finish_reason
        assert cut.text == gen.decode(ref[:k]) and kept.text == gen.decode(ref[: k + 1])
        whole = gen.decode(ref)
        stop = whole[len(whole) // 2 : len(whole) // 2 + 2]
        plain = gen.generate(PROMPT, 16, stop=stop)
        included = gen.generate(
            PROMPT, params=SamplingParams(max_new_tokens=16, stop=stop, include_stop_str_in_output=True)
        )
    assert plain.stop_sequence == stop == included.stop_sequence
    assert included.text == plain.text + stop


def test_ignore_eos_and_skip_special_tokens(tiny_gpt2: TinyModel) -> None:
    eager = {EOS: 12.0}  # eos would come first and end it
    with BatchedGenerator(tiny_gpt2.export) as gen:
        ended = gen.generate(PROMPT, params=SamplingParams(max_new_tokens=6, logit_bias=eager))
        going = gen.generate(PROMPT, params=SamplingParams(max_new_tokens=6, logit_bias=eager, ignore_eos=True))
        special = gen.generate(
            PROMPT,
            params=SamplingParams(max_new_tokens=6, logit_bias=eager, ignore_eos=True, skip_special_tokens=False),
        )
    assert ended.token_ids == (EOS,) and ended.finish_reason == "stop"
    assert going.finish_reason == "length" and len(going.token_ids) == 6 and going.token_ids[0] == EOS
    assert "</s>" not in going.text and special.text.count("</s>") == going.token_ids.count(EOS)


def test_token_bytes_join_into_the_text(tiny_gpt2: TinyModel) -> None:
    with BatchedGenerator(tiny_gpt2.export) as gen:
        ids = gen.encode(CORPUS[3])
        pieces = gen.token_bytes(ids)
        assert len(pieces) == len(ids)
        assert b"".join(pieces).decode() == gen.decode(ids) == CORPUS[3]


def _vllm_stop(texts: list[str], stop: str, min_tokens: int) -> tuple[int, int] | None:
    """Where vLLM's detokenizer stops: ``texts[j]`` is the decode of the first j tokens; a stop
    string is looked for from the first token past ``min_tokens`` on, and must end in the text
    that token added. ``(tokens, text length)`` or ``None``."""
    for j in range(max(1, min_tokens + 1), len(texts)):
        i = texts[j].find(stop, max(0, len(texts[j - 1]) - len(stop) + 1))
        if i != -1:
            return j, i
    return None


def test_min_tokens_holds_off_stop_strings_as_vllm_does(tiny_gpt2: TinyModel) -> None:
    """vLLM (since PR 22014) checks stop strings only on tokens past ``min_tokens``, in the text
    each adds: a stop string in the first ``min_tokens`` tokens' text does not end the completion."""
    from transformers import AutoTokenizer

    new = 40
    ref = tiny_gpt2.reference(PROMPT, new)
    assert EOS not in ref
    tok = AutoTokenizer.from_pretrained(tiny_gpt2.source)
    texts = [tok.decode(ref[:j], skip_special_tokens=True) for j in range(new + 1)]
    cases = [
        (stop, m, _vllm_stop(texts, stop, m))
        for m in range(2, 12)
        for stop in dict.fromkeys(texts[m])
        if stop != "\ufffd" and _vllm_stop(texts, stop, 0) != _vllm_stop(texts, stop, m) is not None
    ]
    assert cases, "no stop string is held off by min_tokens in this text"
    with BatchedGenerator(tiny_gpt2.export) as gen:
        for stop, m, (j, i) in cases[:4]:
            early = gen.generate(PROMPT, new, stop=stop)
            held = gen.generate(PROMPT, new, stop=stop, min_tokens=m)
            assert len(early.token_ids) < j  # without min_tokens it stops sooner
            assert list(held.token_ids) == ref[:j], (stop, m)
            assert (held.text, held.finish_reason, held.stop_sequence) == (texts[j][:i], "stop", stop)
