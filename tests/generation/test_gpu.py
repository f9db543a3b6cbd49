"""BatchedGenerator on CUDA: the cache stays on the device between steps (IOBinding,
present bound as the next past) and tokens equal the CPU run's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ortbatch import BatchedGenerator
from ortbatch.generation import StreamToken

from .fake_decoder import VOCAB, reference


def _has_cuda() -> bool:
    from ortbatch._ort.probe import loads  # a probe session, not the wheel's build list

    return loads("CUDAExecutionProvider")


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _has_cuda(), reason="needs onnxruntime-gpu with the CUDA execution provider"),
]


def test_cuda_cache_stays_on_device_and_tokens_match(fake_dir: Path, no_thread_leak: None) -> None:
    rs = np.random.RandomState(0)
    prompts = [rs.randint(4, VOCAB, size=n).tolist() for n in (1, 5, 9, 17, 3, 30)]
    seen: list[str] = []

    with BatchedGenerator(fake_dir, providers="cuda", max_batch_size=4) as gen:
        assert gen.runner.io_binding and gen.runner.device[0] == "cuda"

        def peek(_tok: StreamToken) -> None:  # runs on the scheduler thread, between steps
            cache = gen.runner.cache
            seen.append(type(cache.tensors[0]).__name__ if cache.rows else "empty")

        futs = [gen.submit(p, 25, on_token=peek if i == 0 else None) for i, p in enumerate(prompts)]
        outs = [f.result(60) for f in futs]
    for p, out in zip(prompts, outs, strict=True):
        assert list(out.token_ids) == reference(p, 25)
    assert "OrtValue" in seen  # device-resident between decode steps


@pytest.mark.export
def test_cuda_matches_cpu_on_tiny_gpt2(tiny_gpt2, no_thread_leak: None) -> None:
    prompts = ["Once upon a time", "The quick brown fox jumps over", "Hi"]
    with BatchedGenerator(tiny_gpt2.export, providers="cpu") as cpu:
        expected = [cpu.generate(p, 20).token_ids for p in prompts]
    with BatchedGenerator(tiny_gpt2.export, providers="cuda") as gpu:
        got = [f.result(60).token_ids for f in [gpu.submit(p, 20) for p in prompts]]
    assert got == expected
