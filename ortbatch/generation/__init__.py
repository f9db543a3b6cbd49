"""Batched text generation with continuous (iteration-level) batching.

    from ortbatch import BatchedGenerator
    with BatchedGenerator("exports/gpt2", max_batch_size=32) as gen:
        out = gen.generate("Once upon a time", max_new_tokens=64)   # Completion
        async for tok in gen.stream("Hello", max_new_tokens=16): ...

Needs numpy and onnxruntime; text prompts also need ``tokenizers`` (the ``serve`` extra).
"""

from __future__ import annotations

from .generator import BatchedGenerator, Completion, GenerationStats, StreamToken
from .layout import GenerationLayout, generation_section
from .sampling import SamplingParams

__all__ = [
    "BatchedGenerator",
    "Completion",
    "GenerationLayout",
    "GenerationStats",
    "SamplingParams",
    "StreamToken",
    "generation_section",
]
