"""Pure-numpy pieces: the KV cache's join/leave/compaction, sampling, text tracking."""

from __future__ import annotations

import numpy as np
import pytest

from ortbatch.errors import ManifestError
from ortbatch.generation.cache import KVCache
from ortbatch.generation.layout import GenerationLayout, layout_from_io
from ortbatch.generation.sampling import SamplingParams, choose_token
from ortbatch.generation.text import TextTracker


def _rows(lens: list[int], tag: int) -> KVCache:
    """A 1-layer cache whose real entries encode (tag, row, position); padding is 0."""
    length = max(lens)
    t = np.zeros((len(lens), 1, length, 2), np.float32)
    for r, n in enumerate(lens):
        for p in range(n):
            t[r, 0, length - n + p] = (tag * 1000 + r * 100 + p, -(tag * 1000 + r * 100 + p))
    return KVCache([t, t * 2], np.array(lens), length)


def _content(cache: KVCache, row: int) -> list[float]:
    n = int(cache.lens[row])
    return cache.tensors[0][row, 0, cache.length - n :, 0].tolist()


def test_mask_matches_lengths_and_positions_count_from_it() -> None:
    cache = _rows([3, 1, 5], tag=1)
    mask = cache.attention_mask(1)
    assert mask.shape == (3, 6)
    assert mask.tolist() == [[0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 1, 1], [1, 1, 1, 1, 1, 1]]
    positions = np.cumsum(mask, axis=1)[:, -1] - 1
    assert positions.tolist() == [3, 1, 5]  # each row's next position, as alone


def test_keep_drops_rows_and_compacts_padding() -> None:
    cache = _rows([3, 7, 2], tag=1)
    before = [_content(cache, r) for r in range(3)]
    cache.keep([2, 0])
    assert cache.length == 3 and cache.lens.tolist() == [2, 3]
    assert [_content(cache, 0), _content(cache, 1)] == [before[2], before[0]]
    assert cache.tensors[0][0, 0, 0].tolist() == [0, 0]  # row 2 is left-padded by one
    cache.keep([])
    assert cache.rows == 0 and cache.length == 0


def test_extend_left_pads_both_sides() -> None:
    a, b = _rows([2, 4], tag=1), _rows([6, 1], tag=2)
    ca, cb = [_content(a, r) for r in range(2)], [_content(b, r) for r in range(2)]
    a.extend(b)
    assert a.length == 6 and a.lens.tolist() == [2, 4, 6, 1]
    assert [_content(a, r) for r in range(4)] == ca + cb
    assert np.array_equal(a.tensors[1], a.tensors[0] * 2)
    mask = a.attention_mask(0)
    assert (mask.sum(axis=1) == a.lens).all()
    # padding is zero everywhere the mask is zero
    assert (a.tensors[0][:, 0, :, 0][mask == 0] == 0).all()


def test_place_overwrites_one_slot_in_place_left_padded() -> None:
    cache = _rows([3, 7, 2], tag=1)
    before = [_content(cache, r) for r in range(3)]
    tensors = list(cache.tensors)
    joiner = _rows([5, 4], tag=2)
    want = _content(joiner, 1)
    cache.place(0, joiner, 1)  # row 0 left; joiner's row 1 takes its slot
    assert all(a is b for a, b in zip(cache.tensors, tensors, strict=True))  # no new arrays
    assert cache.length == 7 and cache.lens.tolist() == [4, 7, 2]
    assert [_content(cache, r) for r in range(3)] == [want, before[1], before[2]]
    assert np.array_equal(cache.tensors[1], cache.tensors[0] * 2)
    mask = cache.attention_mask(0)
    assert (cache.tensors[0][:, 0, :, 0][mask == 0] == 0).all()  # the old row's tokens are gone
    with pytest.raises(ValueError, match="does not fit"):
        cache.place(2, _rows([8], tag=3), 0)
    with pytest.raises(ValueError, match="not a row"):
        cache.place(3, joiner, 0)
    assert cache.nbytes(4) == sum(t.nbytes for t in cache.tensors)


def test_advance_checks_tensor_count() -> None:
    cache = _rows([2], tag=1)
    with pytest.raises(ValueError):
        cache.advance([np.zeros((1, 1, 3, 2))])
    cache.advance([np.zeros((1, 1, 3, 2))] * 2)
    assert cache.length == 3 and cache.lens.tolist() == [3]


def test_greedy_is_argmax_lowest_id_on_ties() -> None:
    logits = np.array([0.1, 3.0, 3.0, -1.0], np.float32)
    assert choose_token(logits, SamplingParams(), None) == 1


def test_sampling_respects_top_k_top_p_and_seed() -> None:
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    draws = lambda params, seed: [  # noqa: E731
        choose_token(logits, params, rng) for rng in [np.random.Generator(np.random.PCG64(seed))] for _ in range(400)
    ]
    top2 = draws(SamplingParams(1.0, top_k=2), 0)
    assert set(top2) == {0, 1}
    nucleus = draws(SamplingParams(1.0, top_p=0.75), 1)  # 0.5 + 0.3 is the first to reach 0.75
    assert set(nucleus) == {0, 1}
    everything = draws(SamplingParams(1.0), 2)
    assert set(everything) == {0, 1, 2, 3}
    assert abs(everything.count(0) / 400 - 0.5) < 0.1
    assert draws(SamplingParams(0.7, top_k=3), 5) == draws(SamplingParams(0.7, top_k=3), 5)
    cold = draws(SamplingParams(0.05), 3)
    assert cold.count(0) > 390


def test_text_tracker_holds_back_partial_stop_strings() -> None:
    pieces = ["Hel", "lo ", "wo", "rld", "!"]
    tracker = TextTracker(lambda ids: "".join(pieces[i] for i in ids), stop=["wor", "xyz"])
    out = []
    for i in range(len(pieces)):
        delta, stopped = tracker.push(i)
        out.append(delta)
        if stopped:
            break
    assert stopped and tracker.stop_string == "wor"
    assert "".join(out) == tracker.text == "Hello "
    assert out[2] == "lo " or "".join(out[:3]) == "Hello "


def _byte_decoder(pieces: list[bytes]):
    # As a byte-level BPE decodes: half a multi-byte character becomes U+FFFD.
    return lambda ids: b"".join(pieces[i] for i in ids).decode("utf-8", errors="replace")


def test_text_tracker_waits_for_whole_characters() -> None:
    pieces = [b"a", b"\xc3", b"\xa9", b"b", b"\xe6\xbc", b"\xa2", b" x", b"\xf0"]
    decode = _byte_decoder(pieces)
    tracker = TextTracker(decode)
    deltas = [tracker.push(i)[0] for i in range(len(pieces))]
    assert deltas == ["a", "", "\u00e9", "b", "", "\u6f22", " x", ""]
    assert tracker.finish() == "\ufffd"  # an unfinished tail shows as the tokenizer shows it
    assert "".join(deltas) + "\ufffd" == tracker.text == decode(range(len(pieces)))


def test_text_tracker_long_completion_matches_full_decode() -> None:
    rs = np.random.RandomState(0)
    pieces = [bytes(rs.randint(0, 256, size=rs.randint(1, 3)).tolist()) for _ in range(300)]
    decode = _byte_decoder(pieces)
    ids = rs.randint(0, 300, size=400).tolist()
    tracker = TextTracker(decode, stop=["\x00\x01\x02\x03"])
    out = [tracker.push(i)[0] for i in ids]
    out.append(tracker.finish())
    assert "".join(out) == tracker.text == decode(ids)


def test_text_tracker_stop_string_split_over_tokens_and_in_the_tail() -> None:
    pieces = [b"ab", b"c", b"S", b"TO", b"P", b"zz"]
    tracker = TextTracker(_byte_decoder(pieces), stop=["STOP"])
    results = [tracker.push(i) for i in range(5)]
    assert results[-1][1] and tracker.text == "abc" and tracker.stop_string == "STOP"
    assert "".join(d for d, _ in results) == "abc"
    assert tracker.push(5) == ("", True)  # nothing after a stop


def test_text_tracker_without_tokenizer_is_silent() -> None:
    tracker = TextTracker(None)
    assert tracker.push(5) == ("", False) and tracker.text == ""


IO_IN = [
    ("input_ids", "int64", ["b", "s"]),
    ("attention_mask", "int64", ["b", "t"]),
    ("position_ids", "int64", ["b", "s"]),
    ("past_key_values.0.key", "float16", ["b", 2, "p", 16]),
    ("past_key_values.0.value", "float16", ["b", 2, "p", 16]),
    ("past_key_values.1.key", "float16", ["b", 2, "p", 16]),
    ("past_key_values.1.value", "float16", ["b", 2, "p", 16]),
]
IO_OUT = [("logits", "float16", ["b", "s", 100])] + [
    (f"present.{i}.{k}", "float16", ["b", 2, "t", 16]) for i in range(2) for k in ("key", "value")
]


def test_layout_from_io_and_round_trip() -> None:
    lay = layout_from_io(
        IO_IN,
        IO_OUT,
        config={"max_position_embeddings": 256, "model_type": "llama"},
        generation_config={"eos_token_id": [7, 9], "bos_token_id": 1},
    )
    assert (lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.cache_dtype) == (2, 2, 16, "float16")
    assert lay.eos_token_ids == (7, 9) and lay.pad_token_id == 7 and lay.max_context_length == 256
    assert lay.vocab_size == 100 and lay.position_ids == "position_ids"
    assert GenerationLayout.from_dict(lay.to_dict()) == lay


def test_layout_eos_from_tokenizer_files() -> None:
    lay = layout_from_io(
        IO_IN,
        IO_OUT,
        config={"n_positions": 64},
        tokenizer_config={"eos_token": "</s>"},
        tokenizer_json={"added_tokens": [{"id": 42, "content": "</s>"}]},
    )
    assert lay.eos_token_ids == (42,)


@pytest.mark.parametrize(
    ("inputs", "outputs", "config", "match"),
    [
        (IO_IN[:3], IO_OUT[:1], {"n_positions": 8}, "text-generation-with-past"),
        (IO_IN[:5], IO_OUT, {"n_positions": 8}, "line up"),
        (IO_IN, IO_OUT, {}, "context length"),
    ],
)
def test_layout_rejects_non_decoders(inputs: list, outputs: list, config: dict, match: str) -> None:
    from ortbatch.errors import ModelContractError

    with pytest.raises(ModelContractError, match=match):
        layout_from_io(inputs, outputs, config=config)


def test_layout_from_dict_names_the_bad_field() -> None:
    lay = layout_from_io(IO_IN, IO_OUT, config={"n_positions": 64}).to_dict()
    with pytest.raises(ManifestError, match="head_dim"):
        GenerationLayout.from_dict({**lay, "head_dim": "16"})
    with pytest.raises(ManifestError, match="padding_side"):
        GenerationLayout.from_dict({**lay, "padding_side": "right"})
    with pytest.raises(ManifestError, match="equal in length"):
        GenerationLayout.from_dict({**lay, "present_values": lay["present_values"][:1]})


def test_text_tracker_checks_stop_strings_only_past_min_tokens() -> None:
    """vLLM's own case (tests/detokenizer/test_min_tokens.py): stop "e" with min_tokens 5 skips
    the "e" of " Lee" and stops in " student"."""
    words = [" is", " Lee", ",", " and", " I", "'m", " a", " student", " in"]
    for min_tokens, want in ((0, " is L"), (5, " is Lee, and I'm a stud")):
        tracker = TextTracker(lambda ids: "".join(words[i] for i in ids), stop=["e"])
        out = []
        for n, i in enumerate(range(len(words)), start=1):
            delta, stopped = tracker.push(i, check_stop=n > min_tokens)
            out.append(delta)
            if stopped:
                break
        assert stopped and "".join(out) == tracker.text == want
