"""Issue 30: the in-place KV cache and prefix caching.

- Decoding writes only the new positions into one preallocated buffer: over 200 steps at a
  fixed batch the buffer stays where it is, holds what the model wrote, and no step
  allocates anything of the cache's size (the export's own cache allocates a new, longer
  copy every step: the same measurement shows it).
- Prompts that share a prefix reuse its keys and values, with the same tokens as
  transformers and as without the prefix cache, also under a budget smaller than the prefix.
- A rewrite whose numbers are wrong is caught at load, and the export's own cache runs.
"""

from __future__ import annotations

import dataclasses
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from ortbatch import BatchedGenerator
from ortbatch.errors import ModelContractError
from ortbatch.generation.layout import generation_section, load_layout
from ortbatch.generation.prefix_cache import BLOCK_TOKENS
from ortbatch.generation.runner import DecoderRunner
from ortbatch.generation.scheduler import Placement

from .conftest import EOS, VOCAB, TinyModel, _tokenizer, random_prompts
from .test_parity import submit_together

pytestmark = [pytest.mark.export]

ROWS, PROMPT, STEPS = 8, 300, 200


@pytest.fixture(scope="module")
def wide_gpt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A GPT-2 with a long context and a cache wide enough to see: 8 KiB per position."""
    pytest.importorskip("torch")
    pytest.importorskip("optimum.exporters.onnx")
    import torch
    from optimum.exporters.onnx import main_export
    from transformers import GPT2Config, GPT2LMHeadModel

    root = tmp_path_factory.mktemp("wide-gpt2")
    source, export = root / "src", root / "onnx"
    _tokenizer(source)
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=512, n_embd=256, n_layer=4, n_head=4, eos_token_id=EOS)
    GPT2LMHeadModel(config).save_pretrained(source)
    main_export(str(source), output=str(export), task="text-generation-with-past", do_validation=False)
    return export


def _memory(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {key}")


def _reset_peak() -> bool:
    """Reset the process's resident-memory high-water mark (Linux 4.0+)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return _memory("VmHWM") <= _memory("VmRSS") + 2**20


def _decode_steps(runner: DecoderRunner) -> tuple[int, int, list[int]]:
    """Prefill ROWS prompts, then STEPS decode steps. Returns how far the resident-memory
    high-water mark rose over the steps (-1: not measurable here), the largest allocation
    any one step made through Python's allocators (numpy, ours), and where the in-place
    arena was before each step."""
    prompts = [np.array(p, np.int64) for p in random_prompts([PROMPT] * ROWS, seed=4)]
    logits, joining = runner.prefill(prompts)
    if runner.in_place:
        plan = Placement(slots=list(range(ROWS)), rows=ROWS, capacity=PROMPT + STEPS + 1)
    else:
        plan = Placement(rebuild=[], append=True)
    runner.seat(plan, [joining])
    tokens = [int(t) for t in logits[:, -1].argmax(-1)]
    for _ in range(3):  # first-run allocations of ONNX Runtime (its arena, kernels' scratch)
        tokens = [int(t) for t in runner.decode(tokens)[:, -1].argmax(-1)]
    peaks, where = [], []
    measured = _reset_peak()
    start = _memory("VmRSS")
    tracemalloc.start()
    try:
        for _ in range(STEPS - 3):
            if runner.in_place:
                where.append(runner.cache.arena.ctypes.data)
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            tokens = [int(t) for t in runner.decode(tokens)[:, -1].argmax(-1)]
            peaks.append(tracemalloc.get_traced_memory()[1] - base)
    finally:
        tracemalloc.stop()
    risen = _memory("VmHWM") - start if measured else -1
    return risen, max(peaks), where


def test_decode_writes_in_place_without_allocating_a_cache(wide_gpt2: Path) -> None:
    """200 steps of 8 rows over a 300-token prompt: the arena never moves, the model wrote
    every position into it, and resident memory rose by the positions written, never by a
    copy of the cache; the export's own cache, measured the same way, rises by a whole copy."""
    layout, _ = load_layout(wide_gpt2)
    in_place = DecoderRunner(wide_gpt2, layout, kv_cache="in-place", max_batch_size=ROWS, prefix_cache_bytes=0)
    token_bytes = in_place.cache.token_bytes
    written = ROWS * STEPS * token_bytes  # 12.5 MiB over the steps
    cache_bytes = ROWS * (PROMPT + STEPS) * token_bytes  # 31 MiB at the end
    risen, python_peak, where = _decode_steps(in_place)
    cache = in_place.cache
    assert cache.lens.tolist() == [PROMPT + STEPS] * ROWS
    assert len(set(where)) == 1 and where[0] == cache.arena.ctypes.data
    held = np.abs(cache.arena[:, :, :, : PROMPT + STEPS]).sum(axis=(0, 2, 4))
    assert np.count_nonzero(held == 0) == 0  # no position of any row left unwritten
    assert python_peak < cache_bytes / 100, python_peak
    if risen < 0:
        pytest.skip("this kernel does not let a process reset its memory high-water mark")
    assert risen < written + cache_bytes // 4, (risen, written, cache_bytes)
    concat = DecoderRunner(wide_gpt2, layout, kv_cache="concat", max_batch_size=ROWS)
    concat_risen, _, _ = _decode_steps(concat)
    assert concat_risen > written + cache_bytes // 2, (concat_risen, written, cache_bytes)


def test_a_shared_prefix_is_computed_once_with_the_same_tokens(tiny: TinyModel, no_thread_leak: None) -> None:
    """Six prompts sharing a 3-block prefix, admitted together: one runs first and stores
    the prefix, the other five reuse it; a later prompt with the same prefix reuses it too.
    Every completion equals transformers' and the prefix cache turned off."""
    prefix = random_prompts([3 * BLOCK_TOKENS], seed=7)[0]
    prompts = [prefix + p for p in random_prompts([5, 1, 9, 3, 7, 2], seed=8)]
    news = [12, 5, 9, 14, 3, 8]
    later = prefix + random_prompts([6], seed=9)[0]
    results = {}
    for cached in (True, False):
        with BatchedGenerator(tiny.export, max_batch_size=8, prefix_cache=cached) as gen:
            assert gen.kv_cache == "in-place"
            together = submit_together(gen, prompts, news)
            alone = gen.generate(later, 10)
            results[cached] = [list(r.token_ids) for r in [*together, alone]]
        stats = gen.stats()  # once the step loop has ended
        if cached:
            assert stats.prefix_cache_hits == 6 and stats.prefix_cache_tokens_saved == 6 * 3 * BLOCK_TOKENS
            assert stats.prefix_cache_lookups == 8  # the blocker, the six, the later one
            assert 0 < stats.prefix_cache_bytes <= stats.prefix_cache_budget_bytes
        else:
            assert stats.prefix_cache_lookups == stats.prefix_cache_hits == stats.prefix_cache_budget_bytes == 0
    assert results[True] == results[False]
    for prompt, n, out in zip([*prompts, later], [*news, 10], results[True], strict=True):
        assert out == tiny.reference(prompt, n)


def test_a_budget_smaller_than_the_prefix_evicts_and_answers_correctly(
    tiny_gpt2: TinyModel, no_thread_leak: None
) -> None:
    layout, _ = load_layout(tiny_gpt2.export)
    token_bytes = 2 * layout.num_layers * layout.num_kv_heads * layout.head_dim * 4
    prefixes = random_prompts([3 * BLOCK_TOKENS, 3 * BLOCK_TOKENS], seed=11)
    prompts = [prefixes[i % 2] + p for i, p in enumerate(random_prompts([4, 6, 2, 5, 3, 7], seed=12))]
    with BatchedGenerator(tiny_gpt2.export, max_batch_size=2, prefix_cache_bytes=2 * BLOCK_TOKENS * token_bytes) as gen:
        outs = [list(gen.generate(p, 9).token_ids) for p in prompts]  # one at a time: each can reuse the last
    stats = gen.stats()
    for prompt, out in zip(prompts, outs, strict=True):
        assert out == tiny_gpt2.reference(prompt, 9)
    assert stats.prefix_cache_budget_bytes == 2 * BLOCK_TOKENS * token_bytes
    assert stats.prefix_cache_evictions > 0 and stats.prefix_cache_bytes <= stats.prefix_cache_budget_bytes
    # the two prefixes alternate, so each prompt finds its own prefix evicted: no hits
    assert stats.prefix_cache_hits == 0


def test_a_wrong_rewrite_is_caught_at_load(tiny_gpt2: TinyModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """The in-place graph is checked against the export's logits when it loads: a rewrite
    that computes something else (here: the wrong attention scale) leaves the export's own
    cache running, saying why, or fails when the in-place cache was required."""
    import ortbatch.generation.gqa as gqa

    real = gqa._attention_nodes

    def wrong_scale(*args: object) -> list:
        nodes = real(*args)  # type: ignore[arg-type]
        for node in nodes:
            for attr in node.attribute:
                if attr.name == "scale":
                    attr.f = 3.0
        return nodes

    monkeypatch.setattr(gqa, "_attention_nodes", wrong_scale)
    with BatchedGenerator(tiny_gpt2.export, max_batch_size=2) as gen:
        assert gen.kv_cache == "concat" and "logits differ" in gen.kv_cache_reason
        assert list(gen.generate([5, 6, 7], 6).token_ids) == tiny_gpt2.reference([5, 6, 7], 6)
    with pytest.raises(ModelContractError, match="logits differ"):
        BatchedGenerator(tiny_gpt2.export, kv_cache="in-place")


def test_the_manifest_says_which_cache_the_graph_allows(
    tiny_gpt2: TinyModel, fake_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``generation_section`` (what ``ortbatch export`` writes) says whether the graph allows
    the in-place cache; a manifest that says ``concat`` keeps the generator on the export's
    own cache, and one that says ``in-place`` is still checked against the export at load."""
    import ortbatch.generation.runner as runner_module

    assert generation_section(tiny_gpt2.export)["kv_cache"] == "in-place"
    assert generation_section(tiny_gpt2.export, check_kv_cache=False)["kv_cache"] is None
    assert generation_section(fake_dir)["kv_cache"] == "concat"
    layout, _ = load_layout(tiny_gpt2.export)
    runner = DecoderRunner(tiny_gpt2.export, dataclasses.replace(layout, kv_cache="concat"))
    assert runner.kv_cache == "concat" and "manifest" in runner.kv_cache_reason

    def checked(*args: object) -> None:
        raise AssertionError("checked")

    monkeypatch.setattr(runner_module, "_Reference", checked)
    with pytest.raises(AssertionError, match="checked"):
        DecoderRunner(tiny_gpt2.export, dataclasses.replace(layout, kv_cache="in-place"))
    with pytest.raises(ValueError, match="kv_cache"):
        DecoderRunner(tiny_gpt2.export, layout, kv_cache="paged")


def test_serve_flag_and_metrics(tiny_gpt2: TinyModel) -> None:
    pytest.importorskip("prometheus_client")
    from prometheus_client import generate_latest

    from ortbatch.cli import build_parser
    from ortbatch.commands.serve import _config
    from ortbatch.serve.metrics import ServerMetrics

    args = build_parser().parse_args(["serve", str(tiny_gpt2.export), "--no-prefix-cache"])
    assert _config(args).generator_kwargs()["prefix_cache"] is False
    assert "prefix_cache" not in _config(build_parser().parse_args(["serve", "x"])).generator_kwargs()
    prefix = random_prompts([BLOCK_TOKENS + 3], seed=3)[0]
    with BatchedGenerator(tiny_gpt2.export, max_batch_size=2) as gen:
        gen.generate(prefix, 2)
        gen.generate([*prefix[:-1], 7], 2)
        text = generate_latest(ServerMetrics(generator_stats=gen.stats).registry).decode()
    assert "ortbatch_generation_prefix_cache_hits_total 1.0" in text
    assert f"ortbatch_generation_prefix_cache_tokens_saved_total {float(BLOCK_TOKENS)}" in text
    assert "ortbatch_generation_prefix_cache_lookups_total 2.0" in text
