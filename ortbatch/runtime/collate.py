"""Collators: the seam between requests and the model.

A collator does three things, all pure numpy:

* :meth:`Collator.prepare` checks one request at submit time and returns a
  :class:`Prepared` (its feed, how many rows it carries, its per-row length) or
  raises :class:`~ortbatch.errors.InvalidInputError`;
* :meth:`Collator.collate` pads and stacks a group of prepared requests into one feed;
* :meth:`Collator.split` cuts the batch outputs back into one result per request.

:class:`PaddingCollator` is the default, built from the model's signature (the
manifest, or the graph's symbolic dims). Pass your own subclass of
:class:`Collator` to ``BatchedSession(collator=...)`` for custom request types
(images of different sizes, extra per-request inputs, other padding rules).
"""

from __future__ import annotations

import abc
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import InferenceError, InvalidInputError
from .signature import InputSig, ModelSignature

__all__ = ["Collator", "PaddingCollator", "Prepared"]


@dataclass
class Prepared:
    """One checked request.

    ``feed`` is what :meth:`Collator.collate` receives back; ``rows`` counts toward
    ``max_batch_size``; ``length`` is the per-row cost along the padded axes (the
    product of its ragged lengths; 1 when nothing is ragged): a batch costs
    ``sum(rows) * max(length)`` padded elements. ``lengths`` maps each ragged axis
    name to this request's length along it.
    """

    feed: Any
    rows: int = 1
    length: int = 1
    lengths: dict[str, int] = field(default_factory=dict)


class Collator(abc.ABC):
    """Turns requests into one model feed and the outputs back into per-request results."""

    @abc.abstractmethod
    def prepare(self, feed: Any) -> Prepared:
        """Check one request; raise :class:`InvalidInputError` naming what is wrong."""

    @abc.abstractmethod
    def collate(self, items: Sequence[Prepared]) -> tuple[dict[str, np.ndarray], Any]:
        """Stack ``items`` into one feed. Returns ``(feed, state)``; ``state`` is
        handed back to :meth:`split`."""

    @abc.abstractmethod
    def split(self, outputs: Mapping[str, np.ndarray], state: Any) -> list[dict[str, np.ndarray]]:
        """Cut batch ``outputs`` (only those requested) into one dict per item, in order."""


@dataclass
class _BatchState:
    rows: list[int]
    lengths: list[dict[str, int]]
    padded: dict[str, int]


class PaddingCollator(Collator):
    """Pads ragged axes to the batch's longest and trims outputs back per request.

    ``signature`` says, per input, the dtype, the fixed dims, which axes are ragged
    (and under which shared name), the pad value, and per output which axes to
    trim. ``padding_side`` is ``"right"`` (pad after the data) or ``"left"``.
    """

    def __init__(self, signature: ModelSignature) -> None:
        self.signature = signature
        self._left = signature.padding_side == "left"
        self._inputs = list(signature.inputs.values())
        self._names = frozenset(signature.inputs)
        # Inputs whose one ragged axis is axis 1 (token sequences) are padded with one
        # boolean-mask scatter instead of a slice assignment per request.
        self._seq_key = {
            sig.name: sig.ragged_axes[0][1]
            for sig in self._inputs
            if len(sig.ragged_axes) == 1 and sig.ragged_axes[0][0] == 1
        }
        self._out_seq: dict[str, str | None] = {}  # output -> key, when its only trim is axis 1
        for name in signature.outputs:
            trims = signature.output_ragged(name)
            self._out_seq[name] = trims[0][1] if len(trims) == 1 and trims[0][0] == 1 else None

    # -- submit-time checks ------------------------------------------------------------
    def prepare(self, feed: Any) -> Prepared:
        if type(feed) is not dict and not isinstance(feed, Mapping):
            raise InvalidInputError(f"input_feed must be a mapping of input name to array, got {type(feed).__name__}")
        if len(feed) != len(self._names) or not self._names.issuperset(feed):
            self._refuse_names(feed)
        arrays: dict[str, np.ndarray] = {}
        rows = -1
        rows_from = ""
        lengths: dict[str, int] = {}
        lengths_from: dict[str, str] = {}
        for sig in self._inputs:
            value = feed[sig.name]
            if type(value) is np.ndarray and (value.dtype is sig.dtype or value.dtype == sig.dtype):
                arr = value
            else:
                arr = _as_array(sig, value)
            if arr.ndim != len(sig.shape):
                raise InvalidInputError(
                    f"input {sig.name!r}: expected rank {len(sig.shape)} {sig.describe()}, "
                    f"got rank {arr.ndim} with shape {list(arr.shape)}",
                    input_name=sig.name,
                )
            shape = arr.shape
            if shape[0] < 1:
                raise InvalidInputError(
                    f"input {sig.name!r}: zero rows (shape {list(shape)}); a request needs at least one row",
                    input_name=sig.name,
                )
            if rows < 0:
                rows, rows_from = shape[0], sig.name
            elif shape[0] != rows:
                raise InvalidInputError(
                    f"input {sig.name!r} has {shape[0]} rows but {rows_from!r} has {rows}: "
                    "all inputs of a request must have the same batch dimension",
                    input_name=sig.name,
                )
            self._check_axes(sig, shape, lengths, lengths_from)
            arrays[sig.name] = arr
        if rows > self.signature.max_rows:
            raise InvalidInputError(
                f"input {rows_from!r} has {rows} rows, but one request may have at most "
                f"max_batch_size={self.signature.max_rows} rows (this session's setting, never above the "
                "export's limits.max_batch_size; BatchedSession(max_batch_size=N), `--max-batch-size N`): "
                f"split it into requests of at most {self.signature.max_rows} rows",
                input_name=rows_from,
            )
        return Prepared(arrays, rows, math.prod(lengths.values()) if lengths else 1, lengths)

    def _refuse_names(self, feed: Mapping[str, Any]) -> None:
        """The error for a feed whose names are not exactly the model's inputs."""
        unknown = sorted(str(k) for k in feed if k not in self._names)
        if unknown:
            raise InvalidInputError(
                f"unknown input {unknown[0]!r}; the model's inputs are {sorted(self._names)}",
                input_name=unknown[0],
            )
        missing = sorted(self._names.difference(feed))
        raise InvalidInputError(
            f"missing input {missing[0]!r}; the model needs {sorted(self._names)}",
            input_name=missing[0],
        )

    def _check_axes(
        self, sig: Any, shape: tuple[int, ...], lengths: dict[str, int], lengths_from: dict[str, str]
    ) -> None:
        """Fixed axes must match; a ragged axis must be non-empty, within the model's limit, and
        agree with every other input on the same axis (recorded in ``lengths``)."""
        for axis in range(1, len(shape)):
            fixed = sig.shape[axis]
            ragged = sig.axes[axis]
            n = shape[axis]
            if isinstance(fixed, int) and ragged is None:
                if n != fixed:
                    raise InvalidInputError(
                        f"input {sig.name!r}: axis {axis} must be {fixed} {sig.describe()}, got shape {list(shape)}",
                        input_name=sig.name,
                    )
                continue
            if ragged is None:
                continue
            if n < 1:
                raise InvalidInputError(
                    f"input {sig.name!r}: axis {axis} ({ragged!r}) is empty, shape {list(shape)}",
                    input_name=sig.name,
                )
            seen = lengths.get(ragged)
            if seen is None:
                limit = self.signature.max_lengths.get(ragged)
                if limit is not None and n > limit:
                    raise InvalidInputError(
                        f"input {sig.name!r}: {ragged} length {n} is over the model's limit of {limit}",
                        input_name=sig.name,
                    )
                lengths[ragged] = n
                lengths_from[ragged] = sig.name
            elif seen != n:
                raise InvalidInputError(
                    f"input {sig.name!r} has {ragged} length {n} but {lengths_from[ragged]!r} has "
                    f"{seen}: inputs sharing the {ragged!r} axis must agree",
                    input_name=sig.name,
                )

    # -- batching --------------------------------------------------------------------------
    def collate(self, items: Sequence[Prepared]) -> tuple[dict[str, np.ndarray], Any]:
        row_counts = [it.rows for it in items]
        lengths = [it.lengths for it in items]
        padded = {k: max(ls[k] for ls in lengths) for k in lengths[0]} if lengths[0] else {}
        state = _BatchState(row_counts, lengths, padded)
        if len(items) == 1:
            feed = {k: np.ascontiguousarray(v) for k, v in items[0].feed.items()}
            return feed, state
        total = sum(row_counts)
        feed = {}
        masks: dict[str, np.ndarray] = {}
        for sig in self._inputs:
            parts = [it.feed[sig.name] for it in items]
            if not sig.ragged_axes:
                feed[sig.name] = np.concatenate(parts, axis=0)
                continue
            key = self._seq_key.get(sig.name)
            if key is not None:
                width = padded[key]
                mask = masks.get(key)
                if mask is None:
                    # row r of the batch holds its request's first n positions (right) or last n (left)
                    n = np.fromiter((ls[key] for ls in lengths), dtype=np.int64, count=len(lengths))
                    if total != len(items):
                        n = np.repeat(n, row_counts)
                    pos = np.arange(width)
                    mask = pos >= (width - n)[:, None] if self._left else pos < n[:, None]
                    masks[key] = mask
                tail = parts[0].shape[2:]
                out = np.full((total, width, *tail), sig.pad, dtype=sig.dtype)
                if total == len(items):  # one row each: join along the sequence axis (no per-part reshape)
                    out[mask] = np.concatenate(parts, axis=1)[0]
                else:
                    out[mask] = np.concatenate([p.reshape(-1, *tail) for p in parts])
                feed[sig.name] = out
                continue
            out_shape = list(parts[0].shape)
            out_shape[0] = total
            for axis, key in sig.ragged_axes:
                out_shape[axis] = padded[key]
            if all(p.shape[1:] == tuple(out_shape[1:]) for p in parts):
                feed[sig.name] = np.concatenate(parts, axis=0)
                continue
            out = np.full(out_shape, sig.pad, dtype=sig.dtype)
            r = 0
            for p in parts:
                index: list[slice] = [slice(r, r + p.shape[0])]
                for axis in range(1, p.ndim):
                    n = p.shape[axis]
                    if n == out_shape[axis]:
                        index.append(slice(None))
                    elif self._left:
                        index.append(slice(out_shape[axis] - n, None))
                    else:
                        index.append(slice(0, n))
                out[tuple(index)] = p
                r += p.shape[0]
            feed[sig.name] = out
        return feed, state

    def split(self, outputs: Mapping[str, np.ndarray], state: Any) -> list[dict[str, np.ndarray]]:
        st: _BatchState = state
        total = sum(st.rows)
        plans: list[tuple[str, np.ndarray, list[tuple[int, str]], str | None]] = []
        for name, arr in outputs.items():
            if arr.ndim == 0 or arr.shape[0] != total:
                raise InferenceError(
                    f"output {name!r} has shape {list(arr.shape)} for a batch of {total} rows: "
                    "the model does not keep the batch axis on this output"
                )
            trims = []
            for axis, key in self.signature.output_ragged(name):
                want = st.padded.get(key)
                if want is None:
                    continue
                if arr.shape[axis] != want:
                    raise InferenceError(
                        f"output {name!r} axis {axis} ({key!r}) has size {arr.shape[axis]} but the "
                        f"batch was padded to {want}: cannot trim it back per request"
                    )
                trims.append((axis, key))
            # the common case, trimming axis 1 only, takes one slice per request
            plans.append((name, arr, trims, self._out_seq.get(name) if trims else None))
        results: list[dict[str, np.ndarray]] = []
        r = 0
        left = self._left
        for rows, lengths in zip(st.rows, st.lengths, strict=True):
            res: dict[str, np.ndarray] = {}
            for name, arr, trims, seq in plans:
                if not trims:
                    res[name] = arr[r : r + rows]
                    continue
                if seq is not None:
                    n = lengths[seq]
                    res[name] = arr[r : r + rows, arr.shape[1] - n :] if left else arr[r : r + rows, :n]
                    continue
                index: list[slice] = [slice(r, r + rows)] + [slice(None)] * (arr.ndim - 1)
                for axis, key in trims:
                    n = lengths[key]
                    full = st.padded[key]
                    if n != full:
                        index[axis] = slice(full - n, None) if self._left else slice(0, n)
                res[name] = arr[tuple(index)]
            results.append(res)
            r += rows
        return results


def _as_array(sig: InputSig, value: Any) -> np.ndarray:
    if isinstance(value, np.ndarray):
        arr = value
    elif value is None:
        raise InvalidInputError(
            f"input {sig.name!r} is None; expected a numpy array {sig.describe()}", input_name=sig.name
        )
    elif isinstance(value, (list, tuple, int, float, bool, np.generic)):
        try:
            arr = np.asarray(value)
        except ValueError as exc:  # ragged nested lists
            raise InvalidInputError(
                f"input {sig.name!r} could not be made into an array {sig.describe()}: {exc}",
                input_name=sig.name,
            ) from None
        # numbers convert (exactly); booleans do not become numbers, as a bool array is refused
        if arr.dtype != sig.dtype and arr.dtype.kind in "iuf" and np.can_cast(arr.dtype, sig.dtype, "same_kind"):
            arr = _cast_exactly(sig, arr)
    else:
        raise InvalidInputError(
            f"input {sig.name!r}: expected a numpy array {sig.describe()}, got {type(value).__name__}",
            input_name=sig.name,
        )
    if arr.dtype != sig.dtype:
        raise InvalidInputError(
            f"input {sig.name!r}: expected dtype {sig.dtype} {sig.describe()}, got {arr.dtype}",
            input_name=sig.name,
        )
    return arr


def _cast_exactly(sig: InputSig, arr: np.ndarray) -> np.ndarray:
    """A converted list as ``sig.dtype``, refused where a value does not fit: an integer
    that would wrap around, a finite number that would become infinite (rounding a float
    to fewer bits is fine)."""
    with np.errstate(over="ignore", invalid="ignore"):
        cast = arr.astype(sig.dtype)
    if cast.dtype.kind in "iu":
        bad = cast != arr
    elif cast.dtype.kind == "f":
        bad = np.isinf(cast) & np.isfinite(arr)
    else:
        return cast
    if bad.any():
        value = arr[bad].flat[0]
        raise InvalidInputError(
            f"input {sig.name!r}: value {value!r} does not fit dtype {sig.dtype} {sig.describe()}",
            input_name=sig.name,
        )
    return cast
