"""The Ray options of ``ortbatch run --ray`` and ``ortbatch serve --ray``, given from Python:
a share of CPUs or GPUs, or a deadline, that is NaN or infinite is refused with a message
naming it (NaN passed ``cpus <= 0``-style checks and crashed later, converting to int)."""

from __future__ import annotations

import math

import pytest

from ortbatch.bulk import RayOptions
from ortbatch.errors import InvalidInputError
from ortbatch.ray import _ray_mistake
from ortbatch.serve import ServeConfig


@pytest.mark.parametrize(("cpus", "gpus"), [(math.nan, 0.0), (1.0, math.nan), (math.inf, 0.0), (0.0, 0.0), (1.0, -1.0)])
def test_run_on_ray_refuses_a_share_that_is_no_number_of_devices(cpus: float, gpus: float) -> None:
    with pytest.raises(InvalidInputError, match="CPUs > 0 and GPUs >= 0"):
        RayOptions(cpus=cpus, gpus=gpus)
    assert RayOptions(cpus=0.5, gpus=1.0).gpus == 1.0


@pytest.mark.parametrize(
    ("cpus", "gpus", "timeout"), [(math.nan, 0.0, None), (1.0, math.nan, None), (1.0, 0.0, math.nan)]
)
def test_serve_on_ray_refuses_nan_shares_and_deadlines(cpus: float, gpus: float, timeout: float | None) -> None:
    config = ServeConfig(port=8000)
    assert _ray_mistake(config, cpus, gpus, timeout) is not None
    assert _ray_mistake(config, 1.0, 0.0, 30.0) is None
