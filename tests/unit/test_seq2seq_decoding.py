"""generate's settings and processors (ortbatch.generation.decoding) and the beam search's
bookkeeping (ortbatch.generation.beam), without ONNX Runtime or torch. Token parity with
transformers itself is tests/seq2seq/test_parity.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ortbatch.errors import InvalidInputError, ModelContractError
from ortbatch.generation.beam import BeamSearch
from ortbatch.generation.decoding import Decoding, process, read_generation_config


def test_request_overrides_model_then_transformers_defaults() -> None:
    model = Decoding(num_beams=4, length_penalty=2.0, max_length=30, no_repeat_ngram_size=3)
    cfg = Decoding(num_beams=1, max_new_tokens=7).over(model).resolved(1, 64)
    assert (cfg.num_beams, cfg.length_penalty, cfg.no_repeat_ngram_size) == (1, 2.0, 3)
    assert (cfg.max_new_tokens, cfg.max_length) == (7, 8)
    plain = Decoding().over(model).resolved(1, 64)
    assert (plain.num_beams, plain.max_new_tokens, plain.max_length) == (4, 29, 30)
    assert Decoding().resolved(1, 64).max_new_tokens == 64
    assert Decoding().resolved(1, 64).early_stopping is False


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"num_beams": 0}, "num_beams"),
        ({"num_beams": True}, "num_beams"),
        ({"length_penalty": float("nan")}, "length_penalty"),
        ({"early_stopping": "sometimes"}, "early_stopping"),
        ({"bad_words_ids": [[]]}, "bad_words_ids"),
        ({"bad_words_ids": "x"}, "bad_words_ids"),
        ({"suppress_tokens": [-1]}, "suppress_tokens"),
        ({"top_p": 1.5}, "top_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
    ],
)
def test_bad_settings_name_their_field(kwargs: dict, field: str) -> None:
    with pytest.raises(InvalidInputError) as info:
        Decoding(**kwargs)
    assert info.value.input_name == field


def test_resolved_refuses_what_generate_refuses() -> None:
    with pytest.raises(InvalidInputError, match="num_return_sequences"):
        Decoding(num_beams=2, num_return_sequences=3).resolved(1, 8)
    with pytest.raises(InvalidInputError, match="greedy"):
        Decoding(num_return_sequences=2).resolved(1, 8)
    with pytest.raises(InvalidInputError, match="beam sampling"):
        Decoding(num_beams=2, do_sample=True).resolved(1, 8)


def test_generation_config_file(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(
        json.dumps(
            {
                "num_beams": 4,
                "bad_words_ids": [[58100]],
                "eos_token_id": 0,
                "decoder_start_token_id": 58100,
                "pad_token_id": 58100,
                "max_length": 512,
                "transformers_version": "4.57",
            }
        )
    )
    got = read_generation_config(tmp_path)
    assert got.decoding.num_beams == 4 and got.decoding.bad_words_ids == ((58100,),)
    assert got.eos_token_ids == (0,) and got.decoder_start_token_id == 58100
    assert read_generation_config(tmp_path, use=False).decoding == Decoding()
    (tmp_path / "generation_config.json").write_text(json.dumps({"num_beam_groups": 2, "diversity_penalty": 0.5}))
    with pytest.raises(ModelContractError, match="num_beam_groups"):
        read_generation_config(tmp_path)
    assert read_generation_config(tmp_path, use=False).decoding == Decoding()


def test_processors_follow_transformers_definitions() -> None:
    cfg = Decoding(
        repetition_penalty=2.0,
        no_repeat_ngram_size=2,
        bad_words_ids=((4,), (1, 5), (0,)),
        min_length=5,
        suppress_tokens=(6,),
    ).resolved(1, 10)
    scores = np.array([[1.0, -1.0, 2.0, 0.5, 0.0, 3.0, 1.0, 2.0]] * 2, np.float32)
    histories = [[0, 1, 2, 1], [0, 3]]
    out = process(scores.copy(), histories, cfg, eos_token_ids=[0], prompt_length=1)
    # repetition penalty on the row's own history: positive / 2, negative * 2
    assert out[0, 1] == -2.0 and out[0, 2] == -np.inf  # 2 banned: the bigram (1, 2) was seen
    assert out[1, 3] == 0.25 and out[1, 2] == 2.0
    assert np.isneginf(out[:, 4]).all() and np.isneginf(out[:, 6]).all()  # bad word, suppressed
    assert np.isneginf(out[0, 5]) and out[1, 5] == 3.0  # (1, 5): only after a 1
    assert np.isneginf(out[:, 0]).all()  # eos under min_length ([0] is eos: not a bad word, min_length masks it)


def test_forced_tokens_and_begin_suppress() -> None:
    cfg = Decoding(forced_bos_token_id=3, forced_eos_token_id=(2,), begin_suppress_tokens=(5,)).resolved(1, 4)
    first = process(np.zeros((1, 6), np.float32), [[0]], cfg, [2], 1)
    assert first[0, 3] == 0 and np.isneginf(np.delete(first[0], 3)).all()
    # begin_suppress applies one step later when a forced bos takes the first position
    second = process(np.zeros((1, 6), np.float32), [[0, 3]], cfg, [2], 1)
    assert np.isneginf(second[0, 5]) and second[0, 1] == 0
    last = process(np.zeros((1, 6), np.float32), [[0, 3, 1, 1]], cfg, [2], 1)  # max_length 5: last slot
    assert last[0, 2] == 0 and np.isneginf(np.delete(last[0], 2)).all()


def test_beam_search_keeps_the_best_finished_hypotheses() -> None:
    beam = BeamSearch(2, [0], max_length=4, eos_token_ids=[1], num_return_sequences=2)
    logp = np.log(np.array([[0.1, 0.5, 0.4, 0.0], [0.25] * 4], np.float32) + 1e-12)
    src, tokens = beam.step(logp)
    # beam 0 alone is live at the first step: eos (1) finishes; the running beams are 2 and 0
    assert list(src) == [0, 0] and list(tokens) == [2, 0]
    assert beam.finished.sum() == 1
    while not beam.done:
        beam.step(np.log(np.array([[0.05, 0.05, 0.6, 0.3]] * 2, np.float32)))
    results = beam.results()
    assert len(results) == 2 and results[0].score >= results[1].score
    assert results[0].tokens == (1,) or len(results[0].tokens) == 3
