"""Acceptance 1 and 2: batched generation is token-identical to each prompt alone.

The reference is transformers' ``generate(do_sample=False)`` on the PyTorch model, one
prompt at a time. The generator must reproduce it alone, in a batch with prompts of
other lengths, and while requests join and leave mid-flight.
"""

from __future__ import annotations

import threading

import pytest

from ortbatch import BatchedGenerator
from ortbatch.generation import CompactionCost
from ortbatch.generation.rewrites import ATTENTION_SCALE, IN_PLACE_KV, LAST_POSITION_LOGITS

from .conftest import EOS, TinyModel, random_prompts

pytestmark = [pytest.mark.export]

LENGTHS = [1, 5, 17, 9, 30, 2, 12, 23]
NEW = [12, 20, 7, 25, 16, 9, 30, 4]
# One prompt set for every test, so each transformers reference is computed once.
PROMPTS = random_prompts(LENGTHS, seed=2)


def test_greedy_alone_matches_transformers(tiny: TinyModel, no_thread_leak: None) -> None:
    with BatchedGenerator(tiny.export, max_batch_size=1) as gen:
        for prompt, n in zip(PROMPTS[:4], NEW, strict=False):
            out = gen.generate(prompt, n)
            ref = tiny.reference(prompt, n)
            assert list(out.token_ids) == ref
            assert out.prompt_tokens == len(prompt) and out.completion_tokens == len(ref)
            assert out.finish_reason == ("stop" if ref[-1] == EOS else "length")
        assert gen.stats().max_decode_rows == 1


def submit_together(gen: BatchedGenerator, prompts: list, news: list) -> list:
    """Submit every request while the scheduler is held busy by a one-token blocker, so they
    are all queued before it takes any: they prefill and decode together. Their completions."""
    entered, gate = threading.Event(), threading.Event()

    def hold(_token: object) -> None:
        entered.set()
        gate.wait(10)

    blocker = gen.submit([5, 6], 1, on_token=hold)
    assert entered.wait(10)  # the scheduler is busy: the next ones queue together
    futures = [gen.submit(p, n) for p, n in zip(prompts, news, strict=True)]
    gate.set()
    blocker.result(10)
    return [f.result(30) for f in futures]


def test_greedy_batched_mixed_lengths_matches_alone(tiny: TinyModel, no_thread_leak: None) -> None:
    prompts = PROMPTS
    with BatchedGenerator(tiny.export, max_batch_size=len(prompts)) as gen:
        results = submit_together(gen, prompts, NEW)
    # read once the step loop has ended: the last row's future settles before the step that
    # finished it publishes the batch's state, so a read right after it may see that step's
    stats = gen.stats()
    for prompt, n, out in zip(prompts, NEW, results, strict=True):
        assert list(out.token_ids) == tiny.reference(prompt, n), (len(prompt), n)
    assert stats.max_decode_rows == len(prompts)
    assert stats.cache_padding_fraction > 0.1  # rows of other lengths were padded together
    assert (stats.active_rows, stats.reserved_tokens, stats.cache_length, stats.queued) == (0, 0, 0, 0)


def test_greedy_join_and_leave_mid_flight(tiny: TinyModel, no_thread_leak: None) -> None:
    """Rows finish at different steps (the cache is compacted) while queued requests
    are admitted into the running batch (their cache merged left-padded)."""
    # The same prompts twice, in another order and with other companions the second time.
    prompts = PROMPTS + PROMPTS[::-1]
    news = NEW + NEW[::-1]
    with BatchedGenerator(tiny.export, max_batch_size=3) as gen:
        early = [gen.submit(p, n) for p, n in zip(prompts[:8], news[:8], strict=True)]
        # More arrive while the first ones are mid-generation.
        early[0].result(30)
        late = [gen.submit(p, n) for p, n in zip(prompts[8:], news[8:], strict=True)]
        results = [f.result(30) for f in early + late]
    stats = gen.stats()  # once the step loop has ended (see above)
    for prompt, n, out in zip(prompts, news, results, strict=True):
        assert list(out.token_ids) == tiny.reference(prompt, n), (len(prompt), n)
    assert stats.max_decode_rows == 3
    assert stats.prefill_runs >= 6  # requests joined one by one as rows freed up
    assert stats.completed == len(prompts) and stats.active_rows == 0 and stats.cache_length == 0
    assert stats.slot_reuses >= 1  # some joined in place, in the slot of a row that left


@pytest.mark.parametrize("kv_cache", ["in-place", "concat"])
def test_greedy_when_rows_that_left_linger_and_when_they_are_compacted(
    tiny: TinyModel, kv_cache: str, no_thread_leak: None
) -> None:
    """Rows that finish stay in the batch unread until a copy pays off (on the export's
    cache: a rebuild; in place: their slots run idle until rows above move down into them);
    the others' tokens are unchanged either way, whether the copy never comes or comes at once."""
    prompts, news = PROMPTS[:6], [4, 30, 6, 25, 3, 28]
    for copy_s_per_byte in (1.0, 0.0):  # a copy never worth it / always worth it
        cost = CompactionCost(copy_s_per_byte=copy_s_per_byte)
        with BatchedGenerator(tiny.export, max_batch_size=6, compaction_cost=cost, kv_cache=kv_cache) as gen:
            results = submit_together(gen, prompts, news)
            stats = gen.stats()
        for prompt, n, out in zip(prompts, news, results, strict=True):
            assert list(out.token_ids) == tiny.reference(prompt, n), (len(prompt), n, copy_s_per_byte)
        copies = stats.cache_copies if kv_cache == "concat" else stats.row_moves
        if copy_s_per_byte:
            assert copies <= (1 if kv_cache == "concat" else 0)  # (the blocker's own row) finished rows rode along
            assert stats.mean_decode_rows < 6  # ...but were not counted as decoded rows
        else:
            assert copies >= 2  # dropped (or moved down over) as they finished
        if kv_cache == "in-place":
            assert stats.cache_copies == 0  # nothing is ever rebuilt


def test_greedy_on_the_unmodified_graph(tiny: TinyModel, no_thread_leak: None) -> None:
    """The default rewrites the graph (the in-place KV cache, whose LM head runs on one
    position per row); the export's own cache (LM head on the last position only, attention
    scale after the scores), and the export as it is, give the same tokens."""
    with BatchedGenerator(tiny.export, max_batch_size=4) as gen:
        assert gen.last_position_logits and gen.kv_cache == "in-place" and gen.kv_cache_reason == ""
        assert set(gen.graph_rewrites) == {LAST_POSITION_LOGITS, IN_PLACE_KV}
    with BatchedGenerator(tiny.export, max_batch_size=4, kv_cache="concat") as gen:
        assert set(gen.graph_rewrites) == {LAST_POSITION_LOGITS, ATTENTION_SCALE}
    kinds = (
        {"last_position_logits": False, "attention_rewrite": False},
        {"attention_rewrite": False, "kv_cache": "concat"},
    )
    for kwargs in kinds:
        with BatchedGenerator(tiny.export, max_batch_size=4, **kwargs) as gen:  # type: ignore[arg-type]
            assert ATTENTION_SCALE not in gen.graph_rewrites and gen.kv_cache == "concat"
            assert gen.last_position_logits == (LAST_POSITION_LOGITS in gen.graph_rewrites)
            results = [f.result(30) for f in [gen.submit(p, n) for p, n in zip(PROMPTS, NEW, strict=True)]]
        for prompt, n, out in zip(PROMPTS, NEW, results, strict=True):
            assert list(out.token_ids) == tiny.reference(prompt, n), kwargs


def test_greedy_through_io_binding(tiny: TinyModel, no_thread_leak: None) -> None:
    """The IOBinding path of the export's own cache (kept as OrtValues between steps, used on
    GPU) on CPU."""
    prompts = PROMPTS
    with BatchedGenerator(tiny.export, max_batch_size=4, io_binding=True, kv_cache="concat") as gen:
        results = [f.result(30) for f in [gen.submit(p, n) for p, n in zip(prompts, NEW, strict=True)]]
    for prompt, n, out in zip(prompts, NEW, results, strict=True):
        assert list(out.token_ids) == tiny.reference(prompt, n)


def test_text_prompt_and_text_output(tiny_llama: TinyModel, no_thread_leak: None) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama.source)
    text = "Once upon a time the quick brown fox"
    ids = tok(text)["input_ids"]
    with BatchedGenerator(tiny_llama.export) as gen:
        out = gen.generate(text, 24)
    assert out.prompt_tokens == len(ids)
    assert list(out.token_ids) == tiny_llama.reference(ids, 24)
    assert out.text == tok.decode(list(out.token_ids), skip_special_tokens=True)


def test_seeded_sampling_is_reproducible_regardless_of_batch(tiny: TinyModel, no_thread_leak: None) -> None:
    prompt, others = PROMPTS[2], PROMPTS[3:7]
    kwargs = dict(temperature=0.9, top_k=50, top_p=0.95, seed=1234)
    with BatchedGenerator(tiny.export, max_batch_size=1) as gen:
        alone = gen.generate(prompt, 24, **kwargs)
        again = gen.generate(prompt, 24, **kwargs)
        other_seed = gen.generate(prompt, 24, **{**kwargs, "seed": 99})
    with BatchedGenerator(tiny.export, max_batch_size=8) as gen:
        futs = [gen.submit(p, 20, temperature=1.0, seed=i) for i, p in enumerate(others[:2])]
        batched = gen.submit(prompt, 24, **kwargs)
        futs += [gen.submit(p, 20, temperature=1.0, seed=i) for i, p in enumerate(others[2:])]
        batched_out = batched.result(30)
        for f in futs:
            f.result(30)
        assert gen.stats().max_decode_rows > 1
    assert alone.token_ids == again.token_ids == batched_out.token_ids
    assert alone.token_ids != other_seed.token_ids
    greedy = tiny.reference(prompt, NEW[2])
    assert list(alone.token_ids[: len(greedy)]) != greedy  # it really sampled


def test_top_k_one_is_greedy(tiny_gpt2: TinyModel) -> None:
    with BatchedGenerator(tiny_gpt2.export) as gen:
        out = gen.generate(PROMPTS[1], NEW[1], temperature=1.5, top_k=1, seed=3)
    assert list(out.token_ids) == tiny_gpt2.reference(PROMPTS[1], NEW[1])


def test_stop_strings_and_streamed_text(tiny_gpt2: TinyModel, no_thread_leak: None) -> None:
    import asyncio

    prompt = "The quick brown fox"
    with BatchedGenerator(tiny_gpt2.export) as gen:
        full = gen.generate(prompt, 40)
        text = full.text
        clean = [i for i in range(4, len(text) - 3) if "\ufffd" not in text[i : i + 3]]
        assert clean, f"no usable stop string in {text!r}"
        stop = text[clean[0] : clean[0] + 3]
        cut = gen.generate(prompt, 40, stop=["never-there", stop])

        async def collect() -> list:
            return [t async for t in gen.stream(prompt, 40, stop=stop)]

        streamed = asyncio.run(collect())
    assert cut.finish_reason == "stop" and cut.stop_sequence == stop
    assert cut.text == text[: text.index(stop)]
    assert full.token_ids[: len(cut.token_ids)] == cut.token_ids
    assert len(cut.token_ids) < len(full.token_ids)
    assert "".join(t.text for t in streamed) == cut.text
    assert tuple(t.token_id for t in streamed) == cut.token_ids
    assert streamed[-1].finish_reason == "stop"
    # without a stop string, the streamed text pieces add up to the decoded text
    assert full.text == gen.decode(full.token_ids)
