"""choose_token on the edges of float arithmetic (pure numpy, no onnxruntime)."""

from __future__ import annotations

import numpy as np
import pytest

from ortbatch.errors import InferenceError
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
