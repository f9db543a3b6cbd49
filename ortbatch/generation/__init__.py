"""Batched text generation with continuous (iteration-level) batching.

    from ortbatch import BatchedGenerator
    with BatchedGenerator("exports/gpt2", max_batch_size=32) as gen:
        out = gen.generate("Once upon a time", max_new_tokens=64)   # Completion
        async for tok in gen.stream("Hello", max_new_tokens=16): ...

Encoder-decoder exports (T5, BART, Marian, NLLB/M2M100, mBART, Pegasus) are served by the
sibling :class:`Seq2SeqGenerator` (same face; beams, the checkpoint's generation config).

Needs numpy and onnxruntime; text prompts also need ``tokenizers``, chat templates
``jinja2`` (both in the ``serve`` extra), the load-time graph rewrites ``onnx``, and
constrained decoding (``SamplingParams(json_schema=...)``, forced tool calls) ``llguidance``
(the ``structured`` extra).
"""

from __future__ import annotations

from .chat import ChatTemplate
from .constrained import GrammarCompiler
from .generator import BatchedGenerator, Completion, GenerationStats, StreamToken
from .layout import GenerationLayout, generation_section
from .processors import TokenLogprob
from .rewrites import RewrittenGraph, rewrite_decoder
from .sampling import PARAMETERS, SamplingParams
from .scheduler import CompactionCost
from .seq2seq import Seq2SeqGenerator
from .tools import ToolRequest

__all__ = [
    "PARAMETERS",
    "BatchedGenerator",
    "ChatTemplate",
    "CompactionCost",
    "Completion",
    "GenerationLayout",
    "GenerationStats",
    "GrammarCompiler",
    "RewrittenGraph",
    "SamplingParams",
    "Seq2SeqGenerator",
    "StreamToken",
    "TokenLogprob",
    "ToolRequest",
    "generation_section",
    "rewrite_decoder",
]
