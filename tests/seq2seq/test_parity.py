"""Token parity of Seq2SeqGenerator with transformers' ``generate``, whatever shares the batch.

The reference is ``model.generate(**tokenizer(text), **options)`` on the PyTorch checkpoint, one
request alone: with no options (the checkpoint's generation_config.json applies: beams, lengths,
processors), and with greedy, beam and processor overrides. The engine gets 64 such requests per
model in a random order, in waves (the next wave is submitted when a request of the last one
ended), with beams and greedy rows competing for 16 rows, some requests cancelled while queued
and some mid-way (from their own token callback); every other request must come back with the
reference's tokens, and no row may be left active.
"""

from __future__ import annotations

import concurrent.futures
import random
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ortbatch.errors import InvalidInputError, ModelContractError
from ortbatch.generation.seq2seq import Seq2SeqGenerator

from .conftest import CORPUS, KINDS

pytestmark = [pytest.mark.export, pytest.mark.slow]

SOURCES = [
    *CORPUS,
    "Paris",
    "The model pads short rows.",
    "Again and again, the quick brown fox jumps over the lazy dog while the rain falls on the sofa.",
    "Hello",
    "Wie geht es dir? Le chat dort.",
    "Runs fast on CPUs.",
    "Once upon a time there was a capital of France, and it learned to translate ONNX models.",
    "Sehr gut, danke.",
    "What is batching?",
]
MIX: list[dict[str, Any]] = [
    {},  # the checkpoint's generation config, as generate() with no arguments
    {"num_beams": 1},
    {"num_beams": 2},
    {"num_beams": 4, "num_return_sequences": 2, "length_penalty": 0.5},
    {"num_beams": 3, "early_stopping": "never"},
    {"num_beams": 1, "no_repeat_ngram_size": 2, "repetition_penalty": 1.5},
    {"num_beams": 1, "max_new_tokens": 5},
    {"num_beams": 2, "min_new_tokens": 10, "bad_words_ids": [[7], [8, 9]]},
    {"suppress_tokens": [10, 11], "begin_suppress_tokens": [12]},
    {"num_beams": 1, "forced_bos_token_id": 13, "max_new_tokens": 12},
    {"num_beams": 3, "early_stopping": True, "length_penalty": 1.5, "no_repeat_ngram_size": 3},
]
N_REQUESTS = 64


def requests_for(kind: str) -> list[tuple[str, dict[str, Any]]]:
    rng = random.Random(f"mix-{kind}")
    return [(SOURCES[i % len(SOURCES)], dict(MIX[rng.randrange(len(MIX))])) for i in range(N_REQUESTS)]


class Reference:
    """transformers' generate on the checkpoint, one request at a time (cached)."""

    def __init__(self, checkpoint: Path) -> None:
        import torch
        import transformers as tf

        # one thread: on a shared CPU, torch's thread pool is what makes the reference slow
        torch.set_num_threads(1)

        self.model = tf.AutoModelForSeq2SeqLM.from_pretrained(checkpoint).eval()
        self.tokenizer = tf.AutoTokenizer.from_pretrained(checkpoint)
        eos = self.model.generation_config.eos_token_id
        self.eos = {eos} if isinstance(eos, int) else set(eos)

    def encoded(self, text: str) -> dict[str, Any]:
        enc = self.tokenizer(text, return_tensors="pt")
        enc.pop("token_type_ids", None)
        return dict(enc)

    def generate(self, text: str, **options: Any) -> list[tuple[int, ...]]:
        """Each returned sequence's generated tokens (the start token dropped, cut after eos)."""
        import torch

        with torch.no_grad():
            out = self.model.generate(**self.encoded(text), **options)
        return [self.cut(row[1:]) for row in out.tolist()]

    def cut(self, row: list[int]) -> tuple[int, ...]:
        for i, t in enumerate(row):
            if t in self.eos:
                return tuple(row[: i + 1])
        return tuple(row)


@pytest.fixture(scope="module")
def reference(seq2seq_checkpoint: Callable[[str], Path]) -> Callable[[str], Reference]:
    return cache(lambda kind: Reference(seq2seq_checkpoint(kind)))


def run_mixed(gen: Seq2SeqGenerator, reqs: list[tuple[str, dict[str, Any]]], seed: int) -> dict[int, Any]:
    """Submit ``reqs`` in a random order, in waves; cancel some while queued and some mid-way.
    Returns index -> list of futures (or "cancelled")."""
    rng = random.Random(seed)
    order = list(range(len(reqs)))
    rng.shuffle(order)
    greedy_like = [i for i in order if reqs[i][1].get("num_beams") == 1]
    cancel_mid = set(greedy_like[:4])
    cancel_queued = {order[-1], order[-2]}
    futures: dict[int, list[concurrent.futures.Future[Any]]] = {}
    waves = [order[:24], order[24:40], order[40:52], order[52:]]
    for wave in waves:
        for i in wave:
            text, options = reqs[i]
            holder: list[concurrent.futures.Future[Any]] = []

            def cancel_after_two(tok: Any, holder: list[Any] = holder) -> None:
                if tok.index >= 1 and holder:
                    holder[0].cancel()

            on_token = cancel_after_two if i in cancel_mid else None
            fs = gen.submit_choices(text, on_token=on_token, **options)
            holder.extend(fs)
            futures[i] = fs
            if i in cancel_queued:
                for f in fs:
                    f.cancel()
        pending = [f for fs in futures.values() for f in fs if not f.done()]
        if pending:
            concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED, timeout=120)
    # wait() itself must see every future done, the cancelled ones included (it counts a
    # cancelled future only once its waiters were notified: issue 43's stalls)
    _, not_done = concurrent.futures.wait([f for fs in futures.values() for f in fs], timeout=120)
    pending = [i for i, fs in futures.items() if not_done.intersection(fs)]
    assert not pending, f"requests never answered: {[(i, reqs[i]) for i in pending]}, stats {gen.stats()}"
    return {i: (fs, i in cancel_mid or i in cancel_queued) for i, fs in futures.items()}


@pytest.mark.parametrize("kind", KINDS)
def test_mixed_requests_match_generate_alone(
    kind: str, seq2seq_export: Callable[[str], Any], reference: Callable[[str], Reference], no_thread_leak: None
) -> None:
    exported = seq2seq_export(kind)
    assert exported.report is not None and exported.report.passed, exported.report
    ref = reference(kind)
    reqs = requests_for(kind)
    want = [ref.generate(text, **options) for text, options in reqs]
    lengths = {len(w[0]) for w in want}
    # random weights must not all stop at once: the cache is exercised at many lengths
    assert len(lengths) >= 3 and max(lengths) >= 12, lengths
    with Seq2SeqGenerator(exported.directory, max_batch_size=16) as gen:
        results = run_mixed(gen, reqs, seed=len(kind))
        checked = 0
        for i, (fs, cancelled) in results.items():
            if cancelled:
                assert all(f.cancelled() or f.done() for f in fs)
                continue
            got = [f.result().token_ids for f in fs]
            assert got == want[i], f"request {i} {reqs[i]}: {got} != {want[i]}"
            checked += 1
        assert checked >= N_REQUESTS - 8
        stats = gen.stats()
        assert stats.active_rows == 0
        assert stats.queued == 0
        assert stats.cancelled >= 2


def test_stream_and_completion_fields(
    seq2seq_export: Callable[[str], Any], reference: Callable[[str], Reference]
) -> None:
    import asyncio

    exported = seq2seq_export("t5")
    ref = reference("t5")
    text = SOURCES[2]
    want = ref.generate(text, num_beams=1, max_new_tokens=15)[0]

    async def collect(gen: Seq2SeqGenerator) -> list[Any]:
        return [t async for t in gen.stream(text, 15, num_beams=1)]

    with Seq2SeqGenerator(exported.directory) as gen:
        streamed = asyncio.run(collect(gen))
        done = gen.generate(text, 15, num_beams=1)
    assert tuple(t.token_id for t in streamed) == want == done.token_ids
    assert "".join(t.text for t in streamed) == done.text == ref.tokenizer.decode(list(want), skip_special_tokens=True)
    assert streamed[-1].finish_reason == done.finish_reason
    assert done.finish_reason == ("stop" if want[-1] in ref.eos else "length")
    assert done.prompt_tokens == len(ref.encoded(text)["input_ids"][0])


def test_seeded_sampling_is_reproducible_and_distributed_as_generate(
    seq2seq_export: Callable[[str], Any], reference: Callable[[str], Reference]
) -> None:
    """torch.multinomial's draws cannot be reproduced with numpy, so sampling is checked as a
    distribution: the first token's frequencies over many seeds against the probabilities
    generate samples from (its processed and warped scores); and a seed gives the same tokens
    alone and inside a batch of other requests."""
    import torch

    exported = seq2seq_export("bart")
    ref = reference("bart")
    text = SOURCES[0]
    opts = {"do_sample": True, "top_k": 5, "temperature": 1.5, "num_beams": 1}
    with torch.no_grad():
        out = ref.model.generate(
            **ref.encoded(text), **opts, max_new_tokens=2, output_scores=True, return_dict_in_generate=True
        )
    # the second step's distribution (the first is forced_bos) from the row generate sampled
    first = int(out.sequences[0, 1])
    assert first == 0  # forced_bos_token_id
    probs = torch.softmax(out.scores[1][0], -1).numpy()
    n = 600
    with Seq2SeqGenerator(exported.directory, max_batch_size=64) as gen:
        futures = [gen.submit(text, 2, seed=s, **opts) for s in range(n)]
        tokens = [f.result().token_ids[1] for f in futures]
        alone = gen.generate(text, 8, seed=1234, **opts).token_ids
        crowd = [gen.submit(SOURCES[k % len(SOURCES)], 8, seed=k, **opts) for k in range(20)]
        mid = gen.submit(text, 8, seed=1234, **opts)
        assert mid.result().token_ids == alone
        for f in crowd:
            f.result()
    counts = np.bincount(tokens, minlength=probs.shape[0]) / n
    assert set(np.flatnonzero(counts)) <= set(np.flatnonzero(probs > 0))
    assert 0.5 * np.abs(counts - probs).sum() < 0.1


def test_languages_per_request(seq2seq_export: Callable[[str], Any], reference: Callable[[str], Reference]) -> None:
    exported = seq2seq_export("m2m_100")
    ref = reference("m2m_100")
    import transformers as tf

    text = SOURCES[1]
    with Seq2SeqGenerator(exported.directory) as gen:
        for src, tgt in (("fra_Latn", "deu_Latn"), ("eng_Latn", "spa_Latn"), ("deu_Latn", "eng_Latn")):
            tok = tf.AutoTokenizer.from_pretrained(ref.tokenizer.name_or_path, src_lang=src)
            enc = tok(text, return_tensors="pt")
            forced = tok.convert_tokens_to_ids(tgt)
            import torch

            with torch.no_grad():
                out = ref.model.generate(**enc, forced_bos_token_id=forced, num_beams=2)
            got = gen.generate(text, src_lang=src, tgt_lang=tgt, num_beams=2)
            assert got.token_ids == ref.cut(out[0].tolist()[1:])
            assert got.token_ids[0] == forced
        with pytest.raises(InvalidInputError, match=r"xx_Unknown.*accepted: .*deu_Latn") as info:
            gen.submit(text, tgt_lang="xx_Unknown")
        assert info.value.input_name == "tgt_lang"
        with pytest.raises(InvalidInputError) as info:
            gen.submit(text, src_lang="nope")
        assert info.value.input_name == "src_lang"


def test_bad_input_is_a_typed_error_naming_the_field(seq2seq_export: Callable[[str], Any]) -> None:
    exported = seq2seq_export("marian")
    with Seq2SeqGenerator(exported.directory, max_batch_size=4) as gen:
        cases: list[tuple[dict[str, Any], str]] = [
            ({"source": ""}, "source"),
            ({"source": "x " * 400}, "source"),
            ({"source": "hi", "num_beams": 5}, "num_beams"),
            ({"source": "hi", "bad_words_ids": [[10**6]]}, "bad_words_ids"),
            ({"source": "hi", "num_beams": 2, "num_return_sequences": 3}, "num_return_sequences"),
            ({"source": "hi", "early_stopping": "sometimes"}, "early_stopping"),
            ({"source": "hi", "tgt_lang": "de"}, "tgt_lang"),
            ({"source": "hi", "max_new_tokens": 500}, "max_new_tokens"),
            ({"source": [1, 2, 10**6]}, "source"),
        ]
        for kwargs, field in cases:
            with pytest.raises(InvalidInputError) as info:
                gen.submit_choices(**kwargs)
            assert info.value.input_name == field, (kwargs, info.value)
        with pytest.raises(TypeError, match="num_beam"):
            gen.submit("hi", num_beam=2)
        # the generator still answers
        assert gen.generate("hi", 3, num_beams=1).completion_tokens >= 1


def test_generation_config_ignore_and_refusals(
    seq2seq_export: Callable[[str], Any], reference: Callable[[str], Reference], tmp_path: Path
) -> None:
    import json
    import shutil

    import transformers as tf

    exported = seq2seq_export("bart")
    ref = reference("bart")
    text = SOURCES[3]
    mg = ref.model.generation_config
    plain = tf.GenerationConfig(
        decoder_start_token_id=mg.decoder_start_token_id,
        eos_token_id=mg.eos_token_id,
        pad_token_id=mg.pad_token_id,
        bos_token_id=mg.bos_token_id,
        max_new_tokens=14,
    )
    import torch

    # use_model_defaults=False: else generate fills the plain config's default-valued fields from
    # the checkpoint's generation config (transformers >= 4.50), which "ignore" must not do
    with torch.no_grad():
        out = ref.model.generate(**ref.encoded(text), generation_config=plain, use_model_defaults=False)
    with Seq2SeqGenerator(exported.directory, generation_config="ignore") as gen:
        assert gen.generate(text, 14).token_ids == ref.cut(out[0].tolist()[1:])
    copy = tmp_path / "bart"
    shutil.copytree(exported.directory, copy)
    config = json.loads((copy / "generation_config.json").read_text())
    config["forced_decoder_ids"] = [[1, 5]]
    (copy / "generation_config.json").write_text(json.dumps(config))
    with pytest.raises(ModelContractError, match="forced_decoder_ids"):
        Seq2SeqGenerator(copy)
    with Seq2SeqGenerator(copy, generation_config="ignore") as gen:
        assert gen.generate(text, 3).completion_tokens >= 1
