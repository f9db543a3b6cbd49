"""choose_token on the edges of float arithmetic (pure numpy, no onnxruntime)."""

from __future__ import annotations

import numpy as np
import pytest

from ortbatch.errors import InferenceError, InvalidInputError
from ortbatch.generation.sampling import SamplingParams, choose_token


@pytest.mark.parametrize("temperature", [1e-308, 5e-324, 1e-30, 1e-6])
def test_a_tiny_temperature_picks_the_best_token(temperature: float) -> None:
    # logits / 1e-308 overflow to inf; inf - inf was NaN and the draw then fell on token 0 or 1
    logits = np.array([0.5, 1.0, 3.0, 2.5, -1.0], dtype=np.float32)
    params = SamplingParams(temperature=temperature)
    picks = {choose_token(logits, params, np.random.default_rng(s)) for s in range(20)}
    assert picks == {2}


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_logits_are_an_inference_error(temperature: float, bad: float) -> None:
    logits = np.array([0.5, bad, 3.0], dtype=np.float32)
    with pytest.raises(InferenceError, match="non-finite"):
        choose_token(logits, SamplingParams(temperature=temperature), np.random.default_rng(0))


def test_minus_inf_logits_are_masked_tokens_not_an_error() -> None:
    logits = np.array([-np.inf, 1.0, -np.inf, 0.0], dtype=np.float32)
    picks = {choose_token(logits, SamplingParams(temperature=1.0), np.random.default_rng(s)) for s in range(50)}
    assert picks <= {1, 3} and choose_token(logits, SamplingParams(), None) == 1


# -- the parameter table and its checks ---------------------------------------------------------
def test_parameters_lists_every_field_of_sampling_params() -> None:
    from dataclasses import fields

    from ortbatch.generation.sampling import PARAMETERS

    assert set(PARAMETERS) == {f.name for f in fields(SamplingParams)}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -5),
        ("repetition_penalty", float("nan")),
        ("min_p", 1.5),
        ("min_p", -0.1),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.01),
        ("logprobs", 21),
        ("logprobs", -1),
        ("logprobs", True),
        ("prompt_logprobs", 21),
        ("n", 0),
        ("n", 1000),
        ("min_tokens", -1),
        ("stop_token_ids", [-3]),
        ("stop_token_ids", ["a"]),
        ("logit_bias", {5: 101.0}),
        ("logit_bias", {"x": 1.0}),
        ("logit_bias", {-1: 1.0}),
        ("ignore_eos", "yes"),
        ("skip_special_tokens", 1),
        ("include_stop_str_in_output", None),
        ("temperature", -1.0),
    ],
)
def test_out_of_range_values_are_refused_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(InvalidInputError, match=field) as info:
        SamplingParams(**{field: value})
    assert info.value.input_name == field


def test_values_are_normalised() -> None:
    p = SamplingParams(logit_bias={"50": 2, 7: -1}, stop_token_ids=[9, 4], min_p=1, n=2)
    assert p.logit_bias == ((7, -1.0), (50, 2.0)) and p.stop_token_ids == (9, 4) and p.min_p == 1.0
    hash(p)  # frozen and hashable: every field normalised to immutable values


def test_min_tokens_above_max_new_tokens_and_zero_new_tokens() -> None:
    with pytest.raises(InvalidInputError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_new_tokens=4)
    with pytest.raises(InvalidInputError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
    assert SamplingParams(max_new_tokens=0, prompt_logprobs=0).max_new_tokens == 0  # echo scoring


def test_only_rows_that_ask_leave_the_fast_path() -> None:
    assert not SamplingParams(temperature=0.7, top_k=3, top_p=0.9, min_p=0.1, stop_token_ids=[5]).extras
    for extra in (
        {"repetition_penalty": 1.1},
        {"presence_penalty": 0.1},
        {"frequency_penalty": -0.1},
        {"logit_bias": {1: 1}},
        {"min_tokens": 1},
        {"logprobs": 0},
    ):
        assert SamplingParams(**extra).extras, extra


# -- min_p and the processors, against their definitions -----------------------------------------
def test_min_p_drops_tokens_below_a_fraction_of_the_top_probability() -> None:
    probs = np.array([0.5, 0.3, 0.14, 0.06])
    logits = np.log(probs).astype(np.float32)
    params = SamplingParams(temperature=1.0, min_p=0.25)  # keeps p >= 0.125
    picks = {choose_token(logits, params, np.random.default_rng(s)) for s in range(300)}
    assert picks == {0, 1, 2}


def test_processors_follow_their_definitions_row_by_row() -> None:
    from ortbatch.generation.processors import RowState, process

    rs = np.random.RandomState(0)
    vocab, eos = 12, 3
    logits = rs.randn(3, vocab).astype(np.float32) * 3
    prompt = np.array([1, 2, 2], np.int64)
    params = [
        SamplingParams(repetition_penalty=1.7),
        SamplingParams(frequency_penalty=0.5, presence_penalty=0.25, logit_bias={4: 2.0}),
        SamplingParams(min_tokens=2, stop_token_ids=[7]),
    ]
    states = [RowState(p, prompt, vocab, [eos]) for p in params]
    for s in states:
        for t in (5, 5, 8):
            s.observe(t)
    out = process(logits.copy(), states)
    rep = logits[0].copy()
    for t in {1, 2, 5, 8}:  # prompt and generated, each once
        rep[t] = rep[t] / 1.7 if rep[t] > 0 else rep[t] * 1.7
    np.testing.assert_allclose(out[0], rep, rtol=1e-6)
    pen = logits[1].copy()
    pen[4] += 2.0
    pen[5] -= 2 * 0.5 + 0.25
    pen[8] -= 0.5 + 0.25  # the prompt's 1 and 2 are not penalised (OpenAI's definition)
    np.testing.assert_allclose(out[1], pen, rtol=1e-6)
    np.testing.assert_array_equal(out[2], logits[2])  # 3 generated >= min_tokens 2: nothing masked
    early = RowState(params[2], prompt, vocab, [eos])
    masked = process(logits[2:].copy(), [early])[0]
    assert masked[eos] == -np.inf and masked[7] == -np.inf and np.isfinite(np.delete(masked, [eos, 7])).all()


def test_logprobs_and_top_k_of_a_row() -> None:
    from ortbatch.generation.processors import log_softmax, top_logprobs

    logits = np.array([[1.0, 3.0, 3.0, -2.0, 0.5]], np.float32)
    lp = log_softmax(logits)
    want = logits[0] - np.log(np.exp(logits[0].astype(np.float64)).sum())
    np.testing.assert_allclose(lp[0], want, atol=1e-6)
    top = top_logprobs(lp, 3)[0]
    assert [i for i, _ in top] == [1, 2, 0]  # ties: lower id first


def test_the_docs_table_lists_every_parameter() -> None:
    from pathlib import Path

    from ortbatch.generation.sampling import PARAMETERS

    doc = (Path(__file__).resolve().parents[2] / "docs" / "generation.md").read_text()
    rows = {line.split("|")[1].strip().strip("`") for line in doc.splitlines() if line.startswith("| `")}
    assert set(PARAMETERS) <= rows


def test_from_fields_maps_a_protocol_and_names_its_fields() -> None:
    aliases = {"max_tokens": "max_new_tokens"}
    p = SamplingParams.from_fields({"max_tokens": 7, "top_p": None, "repetition_penalty": 1.2}, aliases)
    assert (p.max_new_tokens, p.top_p, p.repetition_penalty) == (7, None, 1.2)
    with pytest.raises(InvalidInputError, match="max_tokens must be") as info:
        SamplingParams.from_fields({"max_tokens": -3}, aliases)
    assert info.value.input_name == "max_tokens"
    with pytest.raises(InvalidInputError, match="Unrecognized request argument supplied: guided_json") as info:
        SamplingParams.from_fields({"guided_json": {}}, aliases)
    assert info.value.input_name == "guided_json"
    with pytest.raises(InvalidInputError, match="min_p") as info:
        SamplingParams.from_fields({"min_p": 5}, aliases)
    assert info.value.input_name == "min_p"
