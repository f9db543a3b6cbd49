"""What a benchmark sends: the target model's inputs and a fixed, seeded set of requests.

Every mode of one run (direct, batched, oracle) and every peer harness draws its requests
from :func:`make_workload` with the same arguments, so they serve byte-identical feeds;
:attr:`Workload.digest` proves it. Only numpy (and ``tokenizers`` for real texts) is used.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InvalidInputError
from ..manifest import BATCH_AXIS, Manifest

__all__ = [
    "InputInfo",
    "LengthSpec",
    "Target",
    "Workload",
    "feed_digest",
    "load_target",
    "make_workload",
    "parse_lengths",
]

_ORT_DTYPES = {
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
    "tensor(int8)": np.int8,
    "tensor(uint8)": np.uint8,
    "tensor(bool)": np.bool_,
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(double)": np.float64,
}
RAGGED = "ragged"  # marks a padded (sequence) dim in InputInfo.dims


@dataclass(frozen=True)
class InputInfo:
    """One model input as the benchmark fills it: dims are ``"batch"``, ``"ragged"`` or an int."""

    name: str
    dtype: np.dtype
    dims: tuple[str | int, ...]
    pad: float | int | bool = 0


@dataclass
class Target:
    """The model under test: where it is, its inputs and which output axes are ragged."""

    source: Path
    model_path: Path
    manifest: Manifest | None
    inputs: list[InputInfo] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    #: output name -> indices of axes trimmed back per request (the ragged ones)
    ragged_outputs: dict[str, tuple[int, ...]] = field(default_factory=dict)
    padding_side: str = "right"
    max_sequence_length: int | None = None
    vocab_size: int | None = None

    @property
    def tokenizer_file(self) -> Path | None:
        path = self.model_path.parent / "tokenizer.json"
        return path if path.is_file() else None

    def describe(self) -> dict[str, Any]:
        return {
            "path": str(self.source),
            "model": str(self.model_path),
            "manifest": self.manifest is not None,
            "inputs": {
                i.name: {"dtype": np.dtype(i.dtype).name, "dims": list(i.dims), "pad": i.pad} for i in self.inputs
            },
            "outputs": self.outputs,
            "padding_side": self.padding_side,
        }


def load_target(path: str | Path, session: Any) -> Target:
    """Describe ``path`` (export dir or .onnx) using an already-open InferenceSession on it."""
    source = Path(path)
    manifest = Manifest.load(source) if source.is_dir() else None
    model_path = manifest.model_path if manifest else source
    target = Target(source=source, model_path=model_path, manifest=manifest)
    if manifest:
        target.padding_side = manifest.padding_side
        target.max_sequence_length = manifest.max_sequence_length
    config = model_path.parent / "config.json"
    if config.is_file():
        try:
            target.vocab_size = int(json.loads(config.read_text())["vocab_size"])
        except (ValueError, KeyError, TypeError):
            pass

    symbolic_inputs: set[str] = set()
    for node in session.get_inputs():
        dtype = _ORT_DTYPES.get(node.type)
        if dtype is None:
            raise InvalidInputError(f"bench cannot fill input {node.name!r} of type {node.type}", input_name=node.name)
        spec = manifest.inputs.get(node.name) if manifest else None
        dims: list[str | int] = []
        for k, d in enumerate(node.shape):
            axis = spec.axes[k] if spec and k < len(spec.axes) else None
            if k == 0:
                dims.append(BATCH_AXIS)
            elif spec is not None:
                dims.append(RAGGED if axis else (d if isinstance(d, int) else 1))
            elif isinstance(d, int):
                dims.append(d)
            else:  # no manifest: a dynamic non-batch dim is the sequence to pad
                dims.append(RAGGED)
                if isinstance(d, str):
                    symbolic_inputs.add(d)
        pad = spec.pad if spec else 0
        target.inputs.append(InputInfo(node.name, np.dtype(dtype), tuple(dims), pad))

    for node in session.get_outputs():
        target.outputs.append(node.name)
        ospec = manifest.outputs.get(node.name) if manifest else None
        if ospec is not None:
            axes = tuple(k for k, a in enumerate(ospec.axes) if k > 0 and a)
        else:
            axes = tuple(k for k, d in enumerate(node.shape) if k > 0 and isinstance(d, str) and d in symbolic_inputs)
        target.ragged_outputs[node.name] = axes
    if not any(RAGGED in i.dims for i in target.inputs):
        raise InvalidInputError(f"{source}: no input has a sequence axis to vary; nothing to benchmark")
    return target


# -- lengths -------------------------------------------------------------------------------
@dataclass(frozen=True)
class LengthSpec:
    """``8-128`` (uniform, inclusive), ``64`` (fixed) or ``texts[:FILE]`` (real token lengths)."""

    low: int = 0
    high: int = 0
    texts: str | None = None  # "" = the built-in corpus, else a file with one text per line

    def __str__(self) -> str:
        if self.texts is not None:
            return "texts" + (f":{self.texts}" if self.texts else "")
        return f"{self.low}-{self.high}" if self.low != self.high else str(self.low)


def parse_lengths(text: str) -> LengthSpec:
    text = text.strip()
    if text == "texts" or text.startswith("texts:"):
        return LengthSpec(texts=text[6:])
    m = re.fullmatch(r"(\d+)(?:-(\d+))?", text)
    if not m:
        raise InvalidInputError(f"--lengths: expected A-B, N or texts[:FILE], got {text!r}")
    low = int(m.group(1))
    high = int(m.group(2) or low)
    if low < 1 or high < low:
        raise InvalidInputError(f"--lengths: need 1 <= A <= B, got {text!r}")
    return LengthSpec(low, high)


# -- requests ------------------------------------------------------------------------------
@dataclass
class Workload:
    """A fixed list of single-row requests, and optionally their arrival offsets (seconds)."""

    feeds: list[dict[str, np.ndarray]]
    lengths: np.ndarray
    lengths_spec: str
    seed: int
    arrivals: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.feeds)

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def digest(self) -> str:
        return feed_digest(self.feeds, range(len(self.feeds)), self.arrivals)

    def describe(self) -> dict[str, Any]:
        lengths = self.lengths
        return {
            "requests": len(self),
            "lengths": self.lengths_spec,
            "seed": self.seed,
            "tokens": self.tokens,
            "length": {
                "min": int(lengths.min()),
                "mean": round(float(lengths.mean()), 2),
                "p50": float(np.percentile(lengths, 50)),
                "max": int(lengths.max()),
            },
            "arrival": "closed" if self.arrivals is None else "poisson",
            "digest": self.digest,
        }


def feed_digest(
    feeds: Sequence[dict[str, np.ndarray]] | Mapping[int, dict[str, np.ndarray]],
    ids: Any,
    arrivals: np.ndarray | None = None,
) -> str:
    """sha256 over (id, each input's name, dtype, shape, bytes) for the given request ids."""
    h = hashlib.sha256()
    for i in ids:
        h.update(f"#{int(i)}".encode())
        for name in sorted(feeds[i]):
            a = np.ascontiguousarray(feeds[i][name])
            h.update(f"{name}:{a.dtype.str}:{a.shape}".encode())
            h.update(a.tobytes())
    if arrivals is not None:
        h.update(np.asarray(arrivals, dtype=np.float64).tobytes())
    return h.hexdigest()


def make_workload(target: Target, spec: LengthSpec, n: int, seed: int = 0, rate: float | None = None) -> Workload:
    """``n`` seeded requests; with ``rate`` (req/s) also seeded Poisson arrival offsets."""
    if n < 1:
        raise InvalidInputError(f"need at least one request, got {n}")
    rng = np.random.default_rng(seed)
    limit = target.max_sequence_length
    token_rows: list[np.ndarray] | None = None
    if spec.texts is not None:
        token_rows = _tokenize_texts(target, spec.texts, n, rng)
        lengths = np.array([len(r) for r in token_rows], dtype=np.int64)
    else:
        lengths = rng.integers(spec.low, spec.high + 1, size=n, dtype=np.int64)
        if limit:
            lengths = np.minimum(lengths, limit)
    vocab_hi = min(target.vocab_size or 30000, 30000)
    vocab_lo = min(1000, vocab_hi // 2)
    feeds = []
    for k in range(n):
        length = int(lengths[k])
        feed: dict[str, np.ndarray] = {}
        for info in target.inputs:
            shape = tuple(1 if d == BATCH_AXIS else length if d == RAGGED else int(d) for d in info.dims)
            feed[info.name] = _fill(info, shape, rng, vocab_lo, vocab_hi, None if token_rows is None else token_rows[k])
        feeds.append(feed)
    arrivals = None
    if rate is not None:
        if rate <= 0:
            raise InvalidInputError(f"--rate must be positive, got {rate}")
        arrivals = np.cumsum(np.random.default_rng(seed + 1).exponential(1.0 / rate, size=n))
    return Workload(feeds, lengths, str(spec), seed, arrivals)


def _fill(
    info: InputInfo, shape: tuple[int, ...], rng: np.random.Generator, lo: int, hi: int, tokens: np.ndarray | None
) -> np.ndarray:
    name = info.name.lower()
    dtype = info.dtype
    if "mask" in name:
        return np.ones(shape, dtype=dtype)
    if "token_type" in name or "segment" in name:
        return np.zeros(shape, dtype=dtype)
    if "position" in name and len(shape) == 2:
        return np.broadcast_to(np.arange(shape[1], dtype=dtype), shape).copy()
    if dtype.kind in "iu":
        if tokens is not None and len(shape) == 2:
            return tokens.astype(dtype).reshape(shape)
        return rng.integers(lo, hi, size=shape).astype(dtype)
    if dtype.kind == "b":
        return np.ones(shape, dtype=dtype)
    return rng.standard_normal(shape).astype(dtype)


def _tokenize_texts(target: Target, source: str, n: int, rng: np.random.Generator) -> list[np.ndarray]:
    from .._extras import require

    if target.tokenizer_file is None:
        raise InvalidInputError(
            f"--lengths texts needs a tokenizer.json next to {target.model_path.name} (an export directory)"
        )
    tokenizers = require("tokenizers", "serve")
    tok = tokenizers.Tokenizer.from_file(str(target.tokenizer_file))
    # an exported tokenizer.json may pad every text to a fixed length: real lengths are the point
    tok.no_padding()
    if source:
        texts = [t for t in Path(source).read_text(encoding="utf-8").splitlines() if t.strip()]
    else:
        from .texts import TEXTS

        texts = list(TEXTS)
    if not texts:
        raise InvalidInputError(f"--lengths texts: no texts in {source or 'the built-in corpus'}")
    limit = target.max_sequence_length or 512
    encoded = [np.array(e.ids[:limit], dtype=np.int64) for e in tok.encode_batch(texts)]
    picks = rng.integers(0, len(encoded), size=n)
    return [encoded[p] for p in picks]
