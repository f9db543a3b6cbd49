"""The prefix cache (ortbatch.generation.prefix_cache) and the in-place cache's slots, in pure
numpy: each cached position holds its token id and position, so a block stored or read in the
wrong place, or a prefix matched on other tokens, shows at once."""

from __future__ import annotations

import numpy as np
import pytest

from ortbatch.generation.cache import PrefilledRows, SlotCache
from ortbatch.generation.prefix_cache import BLOCK_TOKENS, PrefixCache

B = BLOCK_TOKENS
SHAPE = (2, 1, 2)  # one layer's key and value, one head, two values per position


def row_of(prompt: np.ndarray) -> np.ndarray:
    """What a model would cache for ``prompt``: ``[2, 1, len, 2]`` (the token, its position)."""
    values = np.stack([prompt, np.arange(len(prompt))], axis=-1).astype(np.float32)
    return np.broadcast_to(values, (2, 1, len(prompt), 2)).copy()


def cache(blocks: int) -> PrefixCache:
    one = 2 * 1 * B * 2 * 4
    return PrefixCache(SHAPE, np.float32, blocks * one)


def read(pc: PrefixCache, blocks: list[int]) -> np.ndarray:
    out = np.zeros((2, 1, len(blocks) * B, 2), np.float32)
    pc.read(blocks, out)
    return out


def test_a_prefix_is_found_by_every_prompt_that_shares_it() -> None:
    rs = np.random.RandomState(0)
    shared = rs.randint(5, 100, size=3 * B)
    first = np.concatenate([shared, rs.randint(5, 100, size=5)])
    pc = cache(16)
    assert pc.match(first) == []
    pc.store(first, row_of(first))
    other = np.concatenate([shared, rs.randint(5, 100, size=B + 3)])
    blocks = pc.match(other)
    assert len(blocks) == 3
    assert np.array_equal(read(pc, blocks), row_of(other)[:, :, : 3 * B])
    # one token differs in the second block: only the first block is shared
    changed = other.copy()
    changed[B + 4] += 1
    assert len(pc.match(changed)) == 1
    # the same blocks at another offset are another prefix
    assert pc.match(np.concatenate([[7], shared, [8]])) == []


def test_a_match_leaves_the_last_token_to_run() -> None:
    prompt = np.arange(10, 10 + 2 * B)
    pc = cache(8)
    pc.store(prompt, row_of(prompt))
    assert len(pc.match(prompt)) == 1  # two full blocks cached, but the last token must run
    assert len(pc.match(np.concatenate([prompt, [3]]))) == 2


def test_least_recently_used_blocks_go_first_and_a_prefix_outlives_its_extensions() -> None:
    a = np.arange(100, 100 + 2 * B + 1)
    b = np.arange(300, 300 + 2 * B + 1)
    pc = cache(4)
    pc.store(a, row_of(a))
    pc.store(b, row_of(b))
    assert len(pc.match(a)) == 2 and len(pc.match(b)) == 2  # b used last
    c = np.arange(500, 500 + B + 1)
    pc.store(c, row_of(c))  # evicts a's second block, its first survives
    assert len(pc.match(a)) == 1 and len(pc.match(b)) == 2 and len(pc.match(c)) == 1
    stats = pc.stats()
    assert stats.evicted_blocks == 1 and stats.bytes == 4 * pc.block_bytes == stats.budget_bytes


def test_a_budget_smaller_than_the_prefix_keeps_its_start() -> None:
    prompt = np.arange(40, 40 + 5 * B + 2)
    pc = cache(3)
    pc.store(prompt, row_of(prompt))
    blocks = pc.match(prompt)
    assert len(blocks) == 3  # not thrashed by its own later blocks
    assert np.array_equal(read(pc, blocks), row_of(prompt)[:, :, : 3 * B])
    other = np.arange(900, 900 + 2 * B + 1)
    pc.store(other, row_of(other))  # the old prompt's blocks make room
    assert len(pc.match(other)) == 2
    assert np.array_equal(read(pc, pc.match(prompt)), row_of(prompt)[:, :, :B])


def test_counters() -> None:
    pc = cache(4)
    pc.count(0)
    pc.count(3)
    stats = pc.stats()
    assert (stats.lookups, stats.hits, stats.tokens_saved) == (2, 1, 3 * B)
    with pytest.raises(ValueError, match="holds no block"):
        PrefixCache(SHAPE, np.float32, 10)


def test_slot_cache_places_moves_and_grows_without_losing_a_position() -> None:
    cache = SlotCache(2, 4, 1, 2, np.float32)
    prompts = [np.arange(1, 6), np.arange(20, 23), np.arange(40, 48)]
    buffer = np.zeros((2, 3, 1, 8, 2), np.float32)
    for i, p in enumerate(prompts):
        buffer[:, i, :, : len(p)] = row_of(p)
    rows = PrefilledRows([(buffer, i) for i in range(3)], np.array([len(p) for p in prompts]))
    rows.keep([2, 0, 0])  # repeated: the n choices of one prompt
    cache.resize(3)
    cache.reserve(10)
    for slot in range(3):
        cache.place(slot, rows, slot)
    assert cache.lens.tolist() == [8, 5, 5] and cache.length == 8
    cache.free(1)
    cache.move(2, 1)
    assert cache.lens.tolist() == [8, 5, 0]
    assert cache.reserve(12) and not cache.reserve(12)  # grown once, copying what is held
    cache.resize(2)
    views = cache.views()
    assert len(views) == 2 and views[0].shape == (2, 1, 12, 2) and views[0].flags.c_contiguous
    assert np.array_equal(views[0][0, :, :8], row_of(prompts[2])[0])
    assert np.array_equal(views[1][1, :, :5], row_of(prompts[0])[1])
    assert cache.nbytes() == 13 * cache.token_bytes
    with pytest.raises(ValueError, match="do not fit"):
        cache.resize(5)
