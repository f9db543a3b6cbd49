"""TensorRT execution-provider options (pure Python, no onnxruntime needed).

``ortbatch export --trt`` writes these into the manifest's ``providers`` list:

- optimization profiles (``trt_profile_min/opt/max_shapes``) for every input, derived
  from the export's limits: the batch axis spans ``1..max_batch_size``, ragged
  (sequence) axes span ``1..max_sequence_length``, fixed axes keep their size. A decoder
  with a KV cache gets two profiles whose every shape (min, opt and max) satisfies
  ``attention_mask = past + input_ids``, as the graph requires (TensorRT rejects a
  profile whose opt shape breaks it): *prefill* (empty cache, ``1..max`` new tokens)
  and *decode* (one new token, ``1..max-1`` cached), so a growing cache never leaves
  the profiles and never triggers an engine rebuild;
- ``trt_fp16_enable`` when fp16 was asked for;
- engine and timing cache directories under ``trt_cache/<key>`` where ``key`` hashes
  the model file(s), the onnxruntime version and the profile shapes, so an engine is
  never reused for a different model, runtime or shape range.

Cache paths are written *relative to the export directory* so the directory can be
moved; :func:`resolve_cache_paths` turns them into absolute paths before a session
is built (ONNX Runtime would resolve them against the current working directory).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..errors import ProviderError

__all__ = [
    "TRT_PROVIDER",
    "TrtShapes",
    "check_generation_profiles",
    "check_trt_graph",
    "parse_profile_shapes",
    "resolve_cache_paths",
    "tensorrt_provider_options",
]

TRT_PROVIDER = "TensorrtExecutionProvider"
_PATH_KEYS = ("trt_engine_cache_path", "trt_timing_cache_path")


class TrtShapes:
    """min/opt/max sizes for the batch axis and for ragged (sequence) axes."""

    def __init__(
        self,
        max_batch_size: int,
        max_sequence_length: int,
        opt_batch_size: int | None = None,
        opt_sequence_length: int | None = None,
    ) -> None:
        if max_batch_size < 1 or max_sequence_length < 1:
            raise ValueError(
                f"TensorRT profile limits must be positive, got max_batch_size={max_batch_size}, "
                f"max_sequence_length={max_sequence_length}"
            )
        self.max_batch_size = max_batch_size
        self.max_sequence_length = max_sequence_length
        # Serving batches fill up under load, so optimise for the full batch by default,
        # at a typical (not maximal) text length.
        self.opt_batch_size = opt_batch_size if opt_batch_size is not None else max_batch_size
        self.opt_sequence_length = (
            opt_sequence_length if opt_sequence_length is not None else min(128, max_sequence_length)
        )
        for what, opt, top in (
            ("opt_batch_size", self.opt_batch_size, max_batch_size),
            ("opt_sequence_length", self.opt_sequence_length, max_sequence_length),
        ):
            if not 1 <= opt <= top:
                raise ValueError(f"{what}={opt} must be between 1 and {top}")

    def dim(self, axis: str | int | None, role: str = "new") -> tuple[int, int, int]:
        """(min, opt, max) for one axis: ``"batch"``, a ragged axis name, or a fixed size.
        ``role`` says which profile a ragged axis is sized for (see :func:`axis_role`)."""
        if isinstance(axis, int):
            return axis, axis, axis
        if axis == "batch":
            return 1, self.opt_batch_size, self.max_batch_size
        if axis is None:
            raise ValueError("an axis without a name or fixed size cannot be profiled")
        top, opt = self.max_sequence_length, self.opt_sequence_length
        kind = axis_role(axis)
        if role == "prefill":  # empty cache: the mask is as long as the new tokens
            return (0, 0, 0) if kind == "past" else (1, opt, top)
        if role == "decode":  # one new token; the mask covers the cache plus it
            if kind == "past":
                return 1, max(1, opt - 1), top - 1
            if kind == "total":
                return 2, max(2, opt), top
            return 1, 1, 1
        return 1, opt, top

    def to_dict(self) -> dict[str, int]:
        return {
            "max_batch_size": self.max_batch_size,
            "opt_batch_size": self.opt_batch_size,
            "max_sequence_length": self.max_sequence_length,
            "opt_sequence_length": self.opt_sequence_length,
        }


def axis_role(axis: str) -> str:
    """``"past"`` (the KV cache's length), ``"total"`` (cache + new tokens, the attention
    mask of a decoder with past) or ``"new"`` (every other ragged axis)."""
    if "past" in axis:
        return "past"
    if "total" in axis or "+" in axis:
        return "total"
    return "new"


def _roles(inputs: Mapping[str, Sequence[str | int | None]]) -> tuple[str, ...]:
    has_past = any(isinstance(a, str) and axis_role(a) == "past" for dims in inputs.values() for a in dims)
    return ("prefill", "decode") if has_past else ("new",)


def _profile(inputs: Mapping[str, Sequence[str | int | None]], shapes: TrtShapes, which: int, role: str) -> str:
    parts = []
    for name, dims in inputs.items():
        sizes = []
        for i, axis in enumerate(dims):
            try:
                sizes.append(str(shapes.dim(axis, role)[which]))
            except ValueError:
                raise ValueError(f"input {name!r} axis {i} is dynamic but has no role; cannot profile it") from None
        parts.append(f"{name}:{'x'.join(sizes)}")
    return ",".join(parts)


def check_trt_graph(optimize: str | None) -> None:
    """TensorRT builds the plain ONNX graph. optimum's O2+ levels fuse it into ONNX Runtime
    contrib ops (Attention, SkipLayerNormalization, ...) that TensorRT cannot build, so
    the graph would be split between TensorRT and CUDA: refused, with what to do instead."""
    if optimize and optimize.upper() in ("O2", "O3", "O4"):
        raise ValueError(
            f"TensorRT cannot run a graph optimized at {optimize} (its fused ONNX Runtime ops would be split "
            "between TensorRT and CUDA); export with --optimize O1 or none for TensorRT, or serve the "
            f"{optimize} export on CUDA"
        )


def tensorrt_provider_options(
    inputs: Mapping[str, Sequence[str | int | None]],
    shapes: TrtShapes,
    *,
    fp16: bool,
    model_digest: str,
    ort_version: str,
    cache_root: str = "trt_cache",
) -> dict[str, Any]:
    """Options for ``("TensorrtExecutionProvider", options)``.

    ``inputs`` maps each graph input to its axes: ``"batch"``, a ragged-axis name
    (e.g. ``"sequence"``) or a fixed size (int). ``model_digest`` is
    :func:`model_hash` of the exported model. Several profiles are written the way
    ONNX Runtime's TensorRT provider reads them: the same input named once per profile.
    """
    roles = _roles(inputs)
    if "decode" in roles and shapes.max_sequence_length < 2:
        raise ValueError("a decoder's TensorRT profiles need max_sequence_length >= 2 (a cached token plus a new one)")
    min_s, opt_s, max_s = (",".join(_profile(inputs, shapes, i, role) for role in roles) for i in range(3))
    key_src = "\n".join([model_digest, ort_version, min_s, opt_s, max_s, f"fp16={bool(fp16)}"])
    key = hashlib.sha256(key_src.encode()).hexdigest()[:16]
    base = f"{cache_root}/{key}"
    return {
        "trt_fp16_enable": bool(fp16),
        "trt_engine_cache_enable": True,
        "trt_engine_cache_path": f"{base}/engines",
        "trt_timing_cache_enable": True,
        "trt_timing_cache_path": f"{base}/timing",
        "trt_profile_min_shapes": min_s,
        "trt_profile_opt_shapes": opt_s,
        "trt_profile_max_shapes": max_s,
    }


def resolve_cache_paths(options: Mapping[str, Any], directory: str | os.PathLike[str]) -> dict[str, Any]:
    """Return ``options`` with relative TensorRT cache paths made absolute under ``directory``
    (the directories are created: TensorRT does not create them itself)."""
    out = dict(options)
    for key in _PATH_KEYS:
        value = out.get(key)
        if isinstance(value, str) and value and not os.path.isabs(value):
            path = Path(directory) / value
            path.mkdir(parents=True, exist_ok=True)
            out[key] = os.fspath(path)
    return out


def parse_profile_shapes(text: str) -> dict[str, list[list[int]]]:
    """``"a:1x2,b:3,a:4x5"`` -> ``{"a": [[1, 2], [4, 5]], "b": [[3]]}``: one shape per
    profile, as ONNX Runtime's TensorRT provider reads the option."""
    out: dict[str, list[list[int]]] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, dims = part.rpartition(":")
        try:
            out.setdefault(name, []).append([int(d) for d in dims.split("x")])
        except ValueError:
            raise ProviderError(f"cannot read the TensorRT profile shape {part!r}") from None
    return out


def check_generation_profiles(
    chain: Sequence[tuple[str, Mapping[str, Any]]],
    past_inputs: Mapping[str, int],
    context: int,
    max_batch_size: int,
) -> None:
    """Refuse TensorRT for generation unless its profiles cover every step: an empty cache
    (prefill) up to ``context - 1`` cached tokens, and ``max_batch_size`` rows. The cache
    grows every decode step; a shape outside every profile makes TensorRT rebuild its
    engine, step after step. ``past_inputs`` maps each cache input to its past axis."""
    opts = dict(chain).get(TRT_PROVIDER)
    if opts is None:
        return
    how = (
        "export the decoder with `ortbatch export --task text-generation-with-past --trt` (its profiles "
        "cover the whole context), or generate on providers='cuda'"
    )
    mins, maxes = (
        parse_profile_shapes(str(opts.get(k) or "")) for k in ("trt_profile_min_shapes", "trt_profile_max_shapes")
    )
    if not maxes:
        raise ProviderError(
            "TensorRT for generation needs optimization profiles for the KV cache (without them the engine "
            f"is rebuilt as the cache grows every step); {how}"
        )
    for name, axis in past_inputs.items():
        if name not in maxes or name not in mins:
            raise ProviderError(f"the TensorRT profiles have no shape for the cache input {name!r}; {how}")
        low = min(shape[axis] for shape in mins[name])
        top = max(shape[axis] for shape in maxes[name])
        rows = max(shape[0] for shape in maxes[name])
        if low > 0:
            raise ProviderError(f"no TensorRT profile for {name!r} admits an empty cache (the prefill step); {how}")
        if top < context - 1:
            raise ProviderError(
                f"the TensorRT profiles cover a cache of at most {top} tokens but the context limit is {context}: "
                f"pass max_context_length={top + 1}, or {how}"
            )
        if rows < max_batch_size:
            raise ProviderError(
                f"the TensorRT profiles cover at most {rows} rows but max_batch_size is {max_batch_size}: "
                f"pass max_batch_size={rows}, or re-export with a larger --max-batch-size"
            )
