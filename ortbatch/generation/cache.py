"""The batch's KV cache: one row per active sequence, left-padded. Pure numpy.

Every row's tokens are right-aligned: row ``i`` holds its ``lens[i]`` real positions in
the last ``lens[i]`` columns and padding before them. Each decode step appends one
column to every row, so alignment is kept for free; the attention mask masks the
padding and positions are counted from the mask, so each row sees exactly what it
would see alone.

Membership changes are the only copies, and the scheduler keeps them rare (a full
copy of a large cache costs several decode steps): a row that joins may take the slot
of a row that left, written in place (:meth:`KVCache.place`, one row's worth of
copying); rows that leave are dropped, and the columns that are padding in every
remaining row trimmed, by :meth:`KVCache.rebuild`, which also left-pads and stacks rows
that join, in one pass. Layer tensors may also be device-resident ``OrtValue`` objects
(IOBinding); they are brought to the host only when membership changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["KVCache"]


def _host(t: Any) -> np.ndarray:
    return t if isinstance(t, np.ndarray) else t.numpy()


class KVCache:
    """``tensors``: ``2 * layers`` arrays ``[rows, kv_heads, length, head_dim]`` (k0, v0, k1, ...)."""

    def __init__(self, tensors: Sequence[Any], lens: np.ndarray, length: int) -> None:
        self.tensors = list(tensors)
        self.lens = np.asarray(lens, dtype=np.int64)
        self.length = int(length)
        if self.lens.ndim != 1:
            raise ValueError(f"lens must be 1-D, got shape {self.lens.shape}")
        if self.rows and int(self.lens.max()) > self.length:
            raise ValueError(f"a row is longer ({int(self.lens.max())}) than the cache ({self.length})")

    @classmethod
    def empty(cls, layers: int, kv_heads: int, head_dim: int, dtype: Any) -> KVCache:
        z = np.zeros((0, kv_heads, 0, head_dim), dtype=dtype)
        return cls([z] * (2 * layers), np.zeros(0, np.int64), 0)

    @property
    def rows(self) -> int:
        return int(self.lens.shape[0])

    def attention_mask(self, new: int = 1, dtype: Any = np.int64) -> np.ndarray:
        """``[rows, length + new]``: 0 on each row's left padding, 1 on its tokens and the new ones."""
        cols = np.arange(self.length + new)
        return (cols[None, :] >= (self.length - self.lens)[:, None]).astype(dtype)

    def host(self) -> KVCache:
        """The same cache with every tensor as a numpy array."""
        self.tensors = [_host(t) for t in self.tensors]
        return self

    def advance(self, presents: Sequence[Any], new: int = 1) -> None:
        """Replace the tensors by the step's ``present`` outputs (``new`` columns longer)."""
        if len(presents) != len(self.tensors):
            raise ValueError(f"expected {len(self.tensors)} present tensors, got {len(presents)}")
        self.tensors = list(presents)
        self.lens = self.lens + new
        self.length += new

    def nbytes(self, itemsize: int) -> int:
        """Bytes held by the layer tensors (host arrays or device ``OrtValue``s of ``itemsize``)."""
        return sum(t.nbytes if isinstance(t, np.ndarray) else int(np.prod(t.shape())) * itemsize for t in self.tensors)

    def place(self, slot: int, other: KVCache, row: int) -> None:
        """Write ``other``'s row ``row`` into this cache's row ``slot`` in place (left-padded).

        The slot's previous contents are overwritten: use it for a row that has left.
        The row must fit: ``other.lens[row] <= self.length``.
        """
        n = int(other.lens[row])
        if not 0 <= slot < self.rows:
            raise ValueError(f"slot {slot} is not a row of this cache ({self.rows} rows)")
        if n > self.length:
            raise ValueError(f"a row of {n} positions does not fit a cache of length {self.length}")
        self.host()
        other.host()
        pad = self.length - n
        for k, t in enumerate(self.tensors):
            if not t.flags.writeable:
                t = self.tensors[k] = t.copy()
            t[slot, :, :pad, :] = 0
            t[slot, :, pad:, :] = other.tensors[k][row, :, other.length - n :, :]
        self.lens = self.lens.copy()
        self.lens[slot] = n

    def keep(self, rows: Sequence[int]) -> None:
        """Keep only ``rows`` (in that order), then trim columns that are padding everywhere."""
        self.rebuild(rows)

    def extend(self, other: KVCache) -> None:
        """Append ``other``'s rows below this cache's, left-padding the shorter side."""
        self.rebuild(range(self.rows), [other])

    def rebuild(self, keep: Sequence[int], joining: Sequence[KVCache] = ()) -> None:
        """Keep ``keep`` (in that order) and append the rows of each ``joining`` cache, in ONE copy.

        Rows leaving and rows joining at the same step boundary cost a single pass over
        the cache: each surviving row's real columns are copied once into a fresh,
        zero-padded array as long as the longest surviving row (the compaction).
        """
        idx = np.asarray(list(keep), dtype=np.int64)
        joining = [c for c in joining if c.rows]
        if not joining and len(idx) == self.rows and np.array_equal(idx, np.arange(self.rows)):
            return
        if len(joining) == 1 and len(idx) == 0 and int(joining[0].lens.max()) == joining[0].length:
            only = joining[0]
            self.tensors, self.lens, self.length = list(only.tensors), only.lens.copy(), only.length
            return
        self.host()
        sources: list[tuple[KVCache, int]] = [(self, int(i)) for i in idx]
        for other in joining:
            other.host()
            sources += [(other, r) for r in range(other.rows)]
        lens = np.array([src.lens[r] for src, r in sources], dtype=np.int64)
        length = int(lens.max()) if len(lens) else 0
        merged = []
        for k, template in enumerate(self.tensors):
            shape = (len(sources), template.shape[1], length, template.shape[3])
            out = np.zeros(shape, dtype=template.dtype)
            for j, (src, r) in enumerate(sources):
                n = int(lens[j])
                if n:
                    out[j, :, length - n :, :] = src.tensors[k][r, :, src.length - n :, :]
            merged.append(out)
        self.tensors, self.lens, self.length = merged, lens, length
