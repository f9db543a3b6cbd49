"""Model runs on the in-place KV cache: the graph rewritten by :mod:`.gqa`, one
:class:`~.cache.SlotCache` bound as both past and present, and prefix reuse.

A decode step feeds each row's last token at position ``lens[row]`` and the model writes
that one position into the row's slot; free slots run idle (``query_seqlens`` 0: their
cache is neither read nor written). A prefill runs a group of prompts right-padded in a
buffer of its own, each prompt's cached prefix (:class:`~.prefix_cache.PrefixCache`)
copied in first so that only the rest of it runs; the rows then join the batch's slots
(:meth:`InPlaceRuns.seat`). Prompts of one group that share a prefix no one has cached yet
run in two waves: one of them first, the others after it, on its cached blocks.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._extras import require
from ..errors import InferenceError, OrtBatchError, map_ort_error
from .cache import PrefilledRows, SlotCache
from .gqa import LAST_INDEX, QUERY_LENGTHS, SEQLENS_K, TOTAL_LENGTH
from .layout import GenerationLayout
from .prefix_cache import BLOCK_TOKENS, PrefixCache
from .scheduler import Placement

__all__ = ["InPlaceRuns"]

# Capacity grows by at least this factor, so a growing batch copies its cache rarely.
_GROWTH = 1.25


class InPlaceRuns:
    """Prefill, decode and seating on the in-place graph's ``session``.

    ``names``: the graph's past and present tensor names, in cache order (k0, v0, k1, ...);
    ``dtypes``: of the cache, the ids and the positions; ``slots``: most rows in a step.
    """

    def __init__(
        self,
        session: Any,
        layout: GenerationLayout,
        names: tuple[list[str], list[str]],
        dtypes: tuple[Any, Any, Any],
        slots: int,
        prefix: PrefixCache | None,
    ) -> None:
        self._ort = require("onnxruntime")
        self.session = session
        self.layout = layout
        self._past, self._present = names
        self.cache_dtype, self._ids_dtype, self._pos_dtype = dtypes
        self._slots = slots
        self.prefix = prefix
        self.cache = self._empty()

    def _empty(self) -> SlotCache:
        lay = self.layout
        return SlotCache(len(self._past), self._slots, lay.num_kv_heads, lay.head_dim, self.cache_dtype)

    def reset(self) -> None:
        """No row is left: release the arena."""
        self.cache = self._empty()

    # -- prefill ---------------------------------------------------------------------------
    def prefill(self, prompts: Sequence[np.ndarray]) -> tuple[np.ndarray, PrefilledRows]:
        """Run ``prompts``; returns each one's last logits row (``[rows, 1, vocab]``) and
        their caches, waiting for slots."""
        n = len(prompts)
        logits: list[Any] = [None] * n
        sources: list[tuple[np.ndarray, int]] = [(np.zeros(0), 0)] * n
        pending, waited = list(range(n)), set[int]()
        while pending:
            hits = {i: self.prefix.match(prompts[i]) if self.prefix else [] for i in pending}
            wave = self._wave(prompts, pending, hits, waited)
            out, buffer = self._prefill_wave([prompts[i] for i in wave], [hits[i] for i in wave])
            for j, i in enumerate(wave):
                logits[i], sources[i] = out[j], (buffer, j)
                if self.prefix is not None:
                    self.prefix.count(len(hits[i]))
                    self.prefix.store(prompts[i], buffer[:, j])
            pending = [i for i in pending if i not in set(wave)]
        return np.stack(logits), PrefilledRows(sources, np.array([len(p) for p in prompts], np.int64))

    def _wave(
        self, prompts: Sequence[np.ndarray], pending: list[int], hits: dict[int, list[int]], waited: set[int]
    ) -> list[int]:
        """The prompts to run now: all, except those whose next uncached block another
        pending prompt will compute and store (they wait one wave, once, to reuse it)."""
        if self.prefix is None:
            return pending
        wave: list[int] = []
        computing: set[bytes] = set()
        for i in pending:
            end = (len(hits[i]) + 1) * BLOCK_TOKENS
            shared = prompts[i][:end].tobytes() if end <= len(prompts[i]) - 1 else None
            if shared is not None and shared in computing and i not in waited:
                waited.add(i)
                continue
            if shared is not None:
                computing.add(shared)
            wave.append(i)
        return wave

    def _prefill_wave(self, prompts: list[np.ndarray], hits: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
        """One prefill run of ``prompts`` after their cached blocks ``hits``, in a buffer of
        their own (``[2 * layers, rows, kv_heads, capacity, head_dim]``, returned)."""
        lay = self.layout
        g = len(prompts)
        cached = np.array([len(h) * BLOCK_TOKENS for h in hits], np.int64)
        new = np.array([len(p) for p in prompts], np.int64) - cached
        longest = int(new.max())
        buffer = np.zeros(
            (len(self._past), g, lay.num_kv_heads, int(cached.max()) + longest, lay.head_dim), self.cache_dtype
        )
        ids = np.full((g, longest), lay.pad_token_id, self._ids_dtype)
        positions = np.zeros((g, longest), self._pos_dtype)
        for j, prompt in enumerate(prompts):
            c, k = int(cached[j]), int(new[j])
            if c and self.prefix is not None:
                self.prefix.read(hits[j], buffer[:, j, :, :c, :])
            ids[j, :k] = prompt[c:]
            positions[j, :k] = np.arange(c, c + k)
        total = cached + new
        last = np.arange(g, dtype=np.int64) * longest + new - 1
        logits = self._run(ids, positions, total - 1, new, int(total.max()), last, list(buffer))
        return logits, buffer

    # -- decode ----------------------------------------------------------------------------
    def decode(self, tokens: Sequence[int]) -> np.ndarray:
        """One decode step: each live row's ``tokens`` entry at its next position; returns
        the logits (``[rows, 1, vocab]``; a free slot's row is meaningless)."""
        cache = self.cache
        live = cache.lens > 0
        if cache.rows and int(cache.lens.max()) + 1 > cache.capacity:
            cache.reserve(self._grown(int(cache.lens.max()) + 1))
        ids = np.where(live, np.asarray(tokens, dtype=np.int64), self.layout.pad_token_id)[:, None]
        positions = np.where(live, cache.lens, 0)[:, None]
        seqlens = np.where(live, cache.lens, 0)
        total = int(seqlens.max()) + 1 if cache.rows else 1
        last = np.arange(cache.rows, dtype=np.int64)
        logits = self._run(
            ids.astype(self._ids_dtype),
            positions.astype(self._pos_dtype),
            seqlens,
            live.astype(np.int64),
            total,
            last,
            cache.views(),
        )
        cache.lens[live] += 1
        return logits

    def _run(
        self,
        ids: np.ndarray,
        positions: np.ndarray,
        seqlens_k: np.ndarray,
        query_lens: np.ndarray,
        total: int,
        last: np.ndarray,
        tensors: list[np.ndarray],
    ) -> np.ndarray:
        """One model run with ``tensors`` bound as both past and present (written in place)."""
        lay = self.layout
        rows, new = ids.shape
        binding = self.session.io_binding()
        binding.bind_cpu_input(lay.input_ids, np.ascontiguousarray(ids))
        binding.bind_cpu_input(lay.position_ids or "position_ids", np.ascontiguousarray(positions))
        binding.bind_cpu_input(SEQLENS_K, seqlens_k.astype(np.int32))
        binding.bind_cpu_input(TOTAL_LENGTH, np.array(total, np.int32))
        binding.bind_cpu_input(QUERY_LENGTHS, query_lens.astype(np.int32))
        binding.bind_cpu_input(LAST_INDEX, last)
        binding.bind_output(lay.logits, "cpu")
        for past, present, t in zip(self._past, self._present, tensors, strict=True):
            value = self._ort.OrtValue.ortvalue_from_numpy(t)
            binding.bind_ortvalue_input(past, value)
            binding.bind_ortvalue_output(present, value)
        try:
            self.session.run_with_iobinding(binding)
            logits = binding.get_outputs()[0].numpy()
        except OrtBatchError:
            raise
        except Exception as exc:
            raise map_ort_error(exc, f"generation step ({rows} rows, {new} new positions, in place)") from exc
        if logits.shape[:2] != (rows, 1):
            raise InferenceError(f"logits have shape {logits.shape}; expected ({rows}, 1, vocab)")
        return logits

    # -- membership --------------------------------------------------------------------------
    def seat(self, plan: Placement, joining: Sequence[PrefilledRows]) -> float | None:
        """Carry out ``plan``: free the slots of rows that left, move rows down into free
        slots, write the joining rows into theirs; returns how long the moves took (``None``:
        none)."""
        if plan.reset:
            self.reset()
            return None
        cache = self.cache
        cache.resize(max(plan.rows, cache.rows))
        cache.reserve(self._grown(plan.capacity))
        for slot in plan.free:
            cache.free(slot)
        t0 = time.perf_counter()
        for src, dst in plan.moves:
            cache.move(src, dst)
        moved = time.perf_counter() - t0
        incoming = [(rows, j) for rows in joining for j in range(rows.rows)]
        for (rows, j), slot in zip(incoming, plan.slots, strict=True):
            cache.place(slot, rows, j)
        cache.resize(plan.rows)
        return moved if plan.moves else None

    def _grown(self, need: int) -> int:
        """The capacity to reserve for ``need`` positions per row."""
        have = self.cache.capacity
        if need <= have:
            return have
        step = -(-int(have * _GROWTH) // BLOCK_TOKENS) * BLOCK_TOKENS
        return min(max(need, step), max(need, self.layout.max_context_length))
