"""Prefix caching: prompt keys and values computed once, reused by later prompts that share them.

As vLLM's automatic prefix caching does, a prompt is cut into blocks of
:data:`BLOCK_TOKENS` tokens, and block ``i`` is known by its tokens and the block before
it, so a block stands for the whole prefix up to its end: two prompts share a cached block
exactly when they share every token up to it. A prompt whose first ``k`` blocks are cached
copies their keys and values into its cache row and only the rest of it is run through
the model (at least its last token, whose logits choose the first new token).

The blocks live in one pool, ``[2 * layers, kv_heads, blocks, BLOCK_TOKENS, head_dim]``,
allocated by :func:`~.cache.lazy_zeros` (its pages are mapped as blocks are written) and
bounded by a byte budget. When the pool is full, the least recently used block goes. A lookup touches a
prompt's blocks from its last to its first, so a prefix outlives the blocks that extend it
(they are evicted first); a prompt being stored never evicts its own earlier blocks, so a
budget smaller than a prefix keeps the prefix's start instead of thrashing. Pure numpy;
used by the step loop's thread only, its counters read by ``stats()`` from any thread.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .cache import lazy_zeros

__all__ = ["BLOCK_TOKENS", "PrefixCache", "PrefixCacheStats"]

#: Tokens per cached block (vLLM's default block size).
BLOCK_TOKENS = 16


@dataclass(frozen=True)
class PrefixCacheStats:
    """Counters of a :class:`PrefixCache`: prompts looked up, prompts that reused a cached
    prefix (``hits``), prompt tokens not run because they were cached (``tokens_saved``),
    blocks stored and evicted, and the bytes the stored blocks hold."""

    lookups: int = 0
    hits: int = 0
    tokens_saved: int = 0
    stored_blocks: int = 0
    evicted_blocks: int = 0
    bytes: int = 0
    budget_bytes: int = 0


class PrefixCache:
    """Cached prompt blocks by prefix, least recently used evicted first.

    ``shape``: ``(2 * layers, kv_heads, head_dim)`` of the cache; ``budget_bytes``: the most
    the blocks may hold (at least one block).
    """

    def __init__(self, shape: tuple[int, int, int], dtype: Any, budget_bytes: int) -> None:
        tensors, heads, head_dim = shape
        self.dtype = np.dtype(dtype)
        self.block_bytes = tensors * heads * BLOCK_TOKENS * head_dim * self.dtype.itemsize
        self.capacity = int(budget_bytes // self.block_bytes)
        if self.capacity < 1:
            raise ValueError(f"a prefix cache budget of {budget_bytes} bytes holds no block of {self.block_bytes}")
        self._pool = lazy_zeros((tensors, heads, self.capacity, BLOCK_TOKENS, head_dim), self.dtype)
        # (parent block's serial, the block's tokens) -> (serial, pool index); LRU order, oldest first
        self._blocks: OrderedDict[tuple[int, bytes], tuple[int, int]] = OrderedDict()
        self._free = list(range(self.capacity - 1, -1, -1))
        self._serial = 0
        self._lock = threading.Lock()
        self._counts = {"lookups": 0, "hits": 0, "tokens_saved": 0, "stored_blocks": 0, "evicted_blocks": 0}

    def stats(self) -> PrefixCacheStats:
        with self._lock:
            counts = dict(self._counts)
        held = len(self._blocks) * self.block_bytes
        return PrefixCacheStats(**counts, bytes=held, budget_bytes=self.capacity * self.block_bytes)

    def match(self, prompt: np.ndarray) -> list[int]:
        """Pool indices of the longest cached prefix of ``prompt`` that leaves at least its
        last token to run, in order (touched, so they are the most recently used)."""
        found: list[tuple[tuple[int, bytes], tuple[int, int]]] = []
        parent = -1
        for key in self._keys(prompt, (len(prompt) - 1) // BLOCK_TOKENS):
            entry = self._blocks.get((parent, key))
            if entry is None:
                break
            found.append(((parent, key), entry))
            parent = entry[0]
        for block, _ in reversed(found):  # the first block ends most recent: extensions go first
            self._blocks.move_to_end(block)
        return [index for _, (_, index) in found]

    def count(self, blocks: int) -> None:
        """Count one prompt run with ``blocks`` cached blocks reused (a lookup; a hit when > 0)."""
        with self._lock:
            self._counts["lookups"] += 1
            self._counts["hits"] += blocks > 0
            self._counts["tokens_saved"] += blocks * BLOCK_TOKENS

    def read(self, blocks: Sequence[int], out: np.ndarray) -> None:
        """Copy ``blocks`` into ``out``, ``[2 * layers, kv_heads, len(blocks) * BLOCK_TOKENS, head_dim]``."""
        tensors, heads, _, head_dim = out.shape
        out.reshape(tensors, heads, len(blocks), BLOCK_TOKENS, head_dim)[...] = self._pool[:, :, list(blocks)]

    def store(self, prompt: np.ndarray, row: np.ndarray) -> None:
        """Store the full blocks of ``prompt`` not cached yet; ``row`` holds its keys and values,
        ``[2 * layers, kv_heads, >= len(prompt), head_dim]``."""
        chain: list[tuple[int, bytes]] = []
        parent = -1
        for i, key in enumerate(self._keys(prompt, len(prompt) // BLOCK_TOKENS)):
            entry = self._blocks.get((parent, key))
            if entry is None:
                index = self._take(pinned=chain)
                if index is None:
                    break  # the budget holds no more of this prompt
                self._serial += 1
                entry = (self._serial, index)
                span = slice(i * BLOCK_TOKENS, (i + 1) * BLOCK_TOKENS)
                self._pool[:, :, index] = row[:, :, span, :]
                self._blocks[(parent, key)] = entry
                with self._lock:
                    self._counts["stored_blocks"] += 1
            chain.append((parent, key))
            parent = entry[0]
        for block in reversed(chain):
            self._blocks.move_to_end(block)

    def clear(self) -> None:
        self._blocks.clear()
        self._free = list(range(self.capacity - 1, -1, -1))

    def _take(self, pinned: list[tuple[int, bytes]]) -> int | None:
        """A free pool index, evicting the least recently used block not in ``pinned``."""
        if self._free:
            return self._free.pop()
        keep = set(pinned)
        victim = next((key for key in self._blocks if key not in keep), None)
        if victim is None:
            return None
        _, index = self._blocks.pop(victim)
        with self._lock:
            self._counts["evicted_blocks"] += 1
        return index

    @staticmethod
    def _keys(prompt: np.ndarray, blocks: int) -> list[bytes]:
        ids = np.ascontiguousarray(prompt[: blocks * BLOCK_TOKENS], dtype=np.int64)
        return [ids[i * BLOCK_TOKENS : (i + 1) * BLOCK_TOKENS].tobytes() for i in range(blocks)]
