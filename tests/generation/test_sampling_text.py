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
