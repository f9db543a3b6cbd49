"""The batch's KV cache, of either kind. Pure numpy.

:class:`SlotCache` (with :class:`PrefilledRows`, rows waiting for their slots) is the in-place
cache: one preallocated buffer the model writes into, a slot per row, right-padded (see its
docstring). :class:`KVCache` is the export's own concatenating cache, one row per active
sequence, left-padded, replaced by each step's ``present`` outputs:

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

import mmap
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["KVCache", "PrefilledRows", "SlotCache", "lazy_zeros"]


def lazy_zeros(shape: Sequence[int], dtype: Any) -> np.ndarray:
    """A zeroed array whose memory the operating system maps one 4 KiB page at a time, as it
    is first written (an anonymous ``mmap``, unmapped with the array). ``np.zeros`` of a large
    array asks Linux for transparent huge pages, so that writing one position of it maps
    2 MiB at once: a sparsely written buffer (a cache sized for the longest row, a prefix
    pool) would then be resident almost whole."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    if nbytes < mmap.PAGESIZE:
        return np.zeros(shape, dtype)
    return np.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).reshape(shape)


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


class PrefilledRows:
    """Rows just prefilled on the in-place path, waiting for their slots: each row is row
    ``r`` of a prefill's own buffer ``[2 * layers, rows, kv_heads, capacity, head_dim]``,
    its ``lens[j]`` positions in columns ``[0, lens[j])`` (right-padded)."""

    def __init__(self, sources: Sequence[tuple[np.ndarray, int]], lens: np.ndarray) -> None:
        self.sources = list(sources)
        self.lens = np.asarray(lens, dtype=np.int64)

    @property
    def rows(self) -> int:
        return len(self.sources)

    def keep(self, rows: Sequence[int]) -> None:
        """Keep only ``rows``, in that order (a row may repeat: the ``n`` choices of a prompt)."""
        self.sources = [self.sources[i] for i in rows]
        self.lens = self.lens[list(rows)] if len(rows) else np.zeros(0, np.int64)

    def row(self, j: int) -> np.ndarray:
        """Row ``j``'s positions, ``[2 * layers, kv_heads, lens[j], head_dim]`` (a view)."""
        buffer, r = self.sources[j]
        return buffer[:, r, :, : int(self.lens[j]), :]


class SlotCache:
    """The batch's cache on the in-place path: one preallocated buffer, a slot per row.

    ``arena`` is ``[2 * layers, slots, kv_heads, capacity, head_dim]`` (k0, v0, k1, ...),
    allocated by :func:`lazy_zeros`, so the operating system maps its pages only when a
    position is first written: memory follows the tokens held, not the capacity. Slot ``s`` holds its row's
    ``lens[s]`` positions in columns ``[0, lens[s])`` (right-padded); a slot whose ``lens``
    is 0 is free. A step runs the first ``rows`` slots: tensor ``t`` is ``arena[t, :rows]``,
    contiguous, bound to ONNX Runtime as both past and present, so the model writes its new
    positions in place. Rows join by writing one slot (:meth:`place`) and leave by freeing
    theirs; :meth:`move` brings a row down into a free slot so the batch stays short. The
    capacity grows (one copy of what is held) only when a row would outgrow it.
    """

    def __init__(self, tensors: int, slots: int, kv_heads: int, head_dim: int, dtype: Any) -> None:
        self.shape = (tensors, slots, kv_heads, head_dim)
        self.dtype = np.dtype(dtype)
        self.arena = lazy_zeros((tensors, slots, kv_heads, 0, head_dim), self.dtype)
        self.lens = np.zeros(0, np.int64)

    @property
    def rows(self) -> int:
        return int(self.lens.shape[0])

    @property
    def length(self) -> int:
        """The longest row."""
        return int(self.lens.max()) if self.rows else 0

    @property
    def capacity(self) -> int:
        return int(self.arena.shape[3])

    @property
    def token_bytes(self) -> int:
        """Bytes of one position of one row, every layer's key and value."""
        tensors, _, heads, head_dim = self.shape
        return tensors * heads * head_dim * self.dtype.itemsize

    def nbytes(self, itemsize: int = 0) -> int:
        """Bytes the rows' positions hold (what is written; the rest of the arena is unmapped)."""
        return int(self.lens.sum()) * self.token_bytes

    def views(self) -> list[np.ndarray]:
        """Each layer tensor over the batch's slots, ``[rows, kv_heads, capacity, head_dim]``."""
        return [self.arena[t, : self.rows] for t in range(self.shape[0])]

    def resize(self, rows: int) -> None:
        """Make the batch ``rows`` slots long; new slots are free."""
        if rows > self.shape[1]:
            raise ValueError(f"{rows} rows do not fit {self.shape[1]} slots")
        lens = np.zeros(rows, np.int64)
        keep = min(rows, self.rows)
        lens[:keep] = self.lens[:keep]
        self.lens = lens

    def reserve(self, capacity: int) -> bool:
        """Make room for ``capacity`` positions per row; True when the arena was reallocated
        (every held position copied once, and views taken before are stale)."""
        if capacity <= self.capacity:
            return False
        tensors, slots, heads, head_dim = self.shape
        arena = lazy_zeros((tensors, slots, heads, capacity, head_dim), self.dtype)
        held = self.length
        if held:
            arena[:, : self.rows, :, :held, :] = self.arena[:, : self.rows, :, :held, :]
        self.arena = arena
        return True

    def free(self, slot: int) -> None:
        self.lens[slot] = 0

    def place(self, slot: int, rows: PrefilledRows, j: int) -> None:
        """Write prefilled row ``j`` of ``rows`` into ``slot`` (which must be free or left)."""
        n = int(rows.lens[j])
        if n > self.capacity:
            raise ValueError(f"a row of {n} positions does not fit a capacity of {self.capacity}")
        self.arena[:, slot, :, :n, :] = rows.row(j)
        self.lens[slot] = n

    def move(self, src: int, dst: int) -> None:
        """Move the row in slot ``src`` to the free slot ``dst``; ``src`` becomes free."""
        n = int(self.lens[src])
        self.arena[:, dst, :, :n, :] = self.arena[:, src, :, :n, :]
        self.lens[dst], self.lens[src] = n, 0
