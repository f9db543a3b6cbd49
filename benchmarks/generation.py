"""Generation benchmark: sequential vs static batching vs onnxruntime-genai vs BatchedGenerator.

    python benchmarks/generation.py --preset gpt2-mini --requests 48 --json out.json --markdown out.md

All modes serve the same requests (random token-id prompts, mixed prompt lengths and
mixed new-token counts, greedy), all arriving at t=0, on the same machine in one run:

- ``sequential``: one request at a time through a plain ORT decode loop (batch 1).
- ``static``: the replaced library's approach: take up to ``--max-batch-size`` requests
  in arrival order, left-pad them, run the batch until its longest request is done
  (finished rows ride along), then the next batch.
- ``genai``: onnxruntime-genai's ``Engine`` (Llama-architecture presets only: its model
  builder does not support GPT-2), on the model its builder makes from the same weights.
- ``continuous``: :class:`ortbatch.BatchedGenerator` with ``--max-batch-size``.
- ``continuous-logprobs`` (opt-in): the same with ``logprobs=5`` on every row (each token's
  logprob and top 5, issue 28's acceptance 4: at most 15% fewer tokens/s than ``continuous``).
  It must still produce the sequential run's tokens.
- ``continuous-export-graph`` (opt-in): the same with both graph rewrites off
  (``last_position_logits=False, attention_rewrite=False``), i.e. on the unmodified graph
  the baselines run, to separate scheduling from the rewrites.
- ``continuous-concat`` (opt-in): the same on the export's own concatenating KV cache
  (``kv_cache="concat"``) instead of the in-place one, in the same process.
- ``continuous-no-prefix-cache`` (opt-in): the same with ``prefix_cache=False``.

``--shared-prefix N`` puts the same N random tokens before every prompt (a system prompt);
``--prompt-lengths`` then sizes each request's own part. Run against older code (e.g. a
worktree of main on ``PYTHONPATH``), ``continuous`` runs that code's defaults; options it
does not know are not passed.

By default the baselines run the graph :class:`BatchedGenerator` runs
(:func:`ortbatch.generation.rewrites.rewrite_decoder`), so the ratios measure batching alone;
``--baseline-graph export`` runs them on the export as it is (what a plain ORT loop has).

Reported per mode: generated tokens/s (wall clock), time to first token mean/p50/p99 and
request latency p50/p99 (from t=0), the peak resident memory while serving (the process's
high-water mark, reset after the model is loaded, where Linux allows), and how many requests
produced exactly the tokens the sequential run produced (``outputs_sha256`` in the JSON
compares runs of separate processes). Models are random (built from a transformers config),
exported once into ``--workdir`` and reused.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

PRESETS: dict[str, dict[str, Any]] = {
    # GPT-2 small: 124M parameters.
    "gpt2-small": {"arch": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257},
    # Half the depth and width of GPT-2 small, same vocabulary and head size (~30M).
    "gpt2-mini": {"arch": "gpt2", "n_layer": 6, "n_embd": 384, "n_head": 6, "vocab_size": 50257},
    # Llama-architecture counterpart of gpt2-mini, which onnxruntime-genai can build.
    "llama-mini": {
        "arch": "llama",
        "num_hidden_layers": 6,
        "hidden_size": 384,
        "num_attention_heads": 6,
        "num_key_value_heads": 6,
        "intermediate_size": 1536,
        "vocab_size": 50257,
    },
    # Tiny, for smoke tests of this script.
    "llama-tiny": {
        "arch": "llama",
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 1000,
    },
    "gpt2-tiny": {"arch": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 1000},
}
CONTEXT = 1024


@dataclass
class Workload:
    prompts: list[list[int]]
    max_new: list[int]

    @classmethod
    def make(
        cls,
        n: int,
        vocab: int,
        prompt_lengths: tuple[int, int],
        new_tokens: tuple[int, int],
        seed: int,
        shared_prefix: int = 0,
    ) -> Workload:
        rs = np.random.RandomState(seed)
        lens = rs.randint(prompt_lengths[0], prompt_lengths[1] + 1, size=n)
        news = rs.randint(new_tokens[0], new_tokens[1] + 1, size=n)
        # Avoid the lowest/highest ids, where special tokens usually sit.
        prompts = [rs.randint(10, vocab - 10, size=int(k)).tolist() for k in lens]
        prefix = np.random.RandomState(seed + 1).randint(10, vocab - 10, size=shared_prefix).tolist()
        return cls([prefix + p for p in prompts], [int(x) for x in news])


@dataclass
class ModeResult:
    mode: str
    wall_s: float
    tokens: int
    tokens_per_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    latency_p50_s: float
    latency_p99_s: float
    ttft_mean_s: float = 0.0
    same_as_sequential: int | None = None
    cpu_s: float = 0.0  # this process's CPU time during the mode (all its threads)
    peak_rss_mb: float | None = None  # high-water mark while serving (None: not measurable here)
    load_peak_rss_mb: float | None = None  # high-water mark before serving (loading the model, for continuous modes)
    serve_cpu_s: float = 0.0  # this process's CPU time while serving only (no model loading)
    kv_cache: str = ""
    # the generator's own counters (continuous modes): steps, live rows and the time in graph runs
    decode_steps: int = 0
    mean_decode_rows: float = 0.0
    decode_time_s: float = 0.0
    prefill_time_s: float = 0.0
    note: str = ""
    outputs_sha256: str = ""
    outputs: list[list[int]] = field(default_factory=list, repr=False)


def outputs_sha256(outputs: list[list[int]]) -> str:
    """The digest of every request's generated token ids, in request order: equal digests, equal tokens.
    benchmarks/vllm_cpu.py reports vLLM's with this same function, so the two compare."""
    return hashlib.sha256(json.dumps(outputs).encode()).hexdigest()


def _summarise(
    mode: str, wall: float, outputs: list[list[int]], ttft: list[float], done: list[float], note: str = ""
) -> ModeResult:
    tokens = sum(len(o) for o in outputs)
    return ModeResult(
        mode=mode,
        wall_s=wall,
        tokens=tokens,
        tokens_per_s=tokens / wall,
        ttft_mean_s=float(np.mean(ttft)),
        outputs_sha256=outputs_sha256(outputs),
        ttft_p50_s=float(np.percentile(ttft, 50)),
        ttft_p99_s=float(np.percentile(ttft, 99)),
        latency_p50_s=float(np.percentile(done, 50)),
        latency_p99_s=float(np.percentile(done, 99)),
        note=note,
        outputs=outputs,
    )


def reset_peak_rss() -> bool:
    """Reset this process's resident-memory high-water mark (Linux: ``/proc/self/clear_refs``)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def peak_rss_mb() -> float | None:
    """This process's resident-memory high-water mark (``VmHWM``), in MiB."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


# -- models -----------------------------------------------------------------------------------
def build_model(preset: str, workdir: Path) -> Path:
    """Random model from ``preset`` → ``workdir/preset/{src,onnx}``; returns the export dir."""
    spec = dict(PRESETS[preset])
    arch = spec.pop("arch")
    root = workdir / preset
    export = root / "onnx"
    if (export / "model.onnx").is_file():
        return export
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from optimum.exporters.onnx import main_export
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    vocab = spec["vocab_size"]
    # eos is the last id: prompts avoid it and a random model rarely picks it.
    ids = {"bos_token_id": vocab - 1, "eos_token_id": vocab - 1, "pad_token_id": vocab - 1}
    if arch == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(n_positions=CONTEXT, initializer_range=0.2, **ids, **spec))
    else:
        # rope_scaling spelled out: onnxruntime-genai's builder iterates over it.
        model = LlamaForCausalLM(
            LlamaConfig(
                max_position_embeddings=CONTEXT,
                initializer_range=0.2,
                rope_scaling={"rope_type": "default"},
                **ids,
                **spec,
            )
        )
    src = root / "src"
    model.save_pretrained(src)
    _save_tokenizer(src)
    main_export(str(src), output=str(export), task="text-generation-with-past", do_validation=False)
    return export


def _save_tokenizer(directory: Path) -> None:
    """A small byte-level BPE trained offline (no hub); prompts are token ids anyway,
    but exporters and onnxruntime-genai's builder expect tokenizer files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(["Once upon a time, a benchmark generated some tokens."] * 4, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(directory)


def build_genai(preset: str, workdir: Path) -> Path:
    """onnxruntime-genai's model builder on the same weights → ``workdir/preset/genai``.

    The builder of onnxruntime-genai 0.18 imports at module level model classes that only
    transformers >= 5 has (Qwen3.5, Qwen3-VL); ortbatch pins transformers < 4.58. Those
    classes are not used for Llama, so a patched copy of the builder package is run.
    """
    out = workdir / preset / "genai"
    if (out / "genai_config.json").is_file():
        return out
    import onnxruntime_genai

    pkg = Path(onnxruntime_genai.__file__).parent / "models"
    patched = workdir / "genai-builder"
    if not patched.exists():
        shutil.copytree(pkg, patched)
        base = patched / "builders" / "base.py"
        text = base.read_text()
        missing = (
            "Qwen3_5ForConditionalGeneration",
            "Qwen3_5MoeForConditionalGeneration",
            "Qwen3VLForConditionalGeneration",
        )
        for name in missing:
            text = text.replace(f"    {name},\n", "", 1)
        text = text.replace("from tqdm import tqdm\n", "from tqdm import tqdm\n" + " = ".join(missing) + " = None\n", 1)
        base.write_text(text)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "ORTGENAI_LOG_ORT_LIB": "1"}
    subprocess.run(
        [sys.executable, "builder.py", "-i", str(workdir / preset / "src"), "-o", str(out), "-p", "fp32", "-e", "cpu"],
        cwd=patched,
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return out


def provider_chain(providers: str, options: Sequence[str] = ()) -> Any:
    """``--providers`` as given, or with ``KEY=VALUE`` options laid over its first provider's
    (ONNX Runtime's ``[(name, {options}), ...]``, which every mode takes)."""
    if not options:
        return providers
    from ortbatch._ort import resolve_providers

    extra = {}
    for option in options:
        key, sep, value = option.partition("=")
        if not sep or not key:
            raise ValueError(f"--provider-option takes KEY=VALUE, got {option!r}")
        extra[key] = value
    chain = resolve_providers(providers)
    return [(name, {**opts, **extra}) if i == 0 else (name, opts) for i, (name, opts) in enumerate(chain)]


# -- baselines: a plain ORT decode loop -----------------------------------------------------
class DirectLoop:
    """Left-padded batch generation with a plain InferenceSession (no scheduler)."""

    def __init__(
        self, export: Path, threads: int | None = None, rewritten: bool = False, providers: Any = "cpu"
    ) -> None:
        import onnxruntime as ort

        from ortbatch._ort import build_session
        from ortbatch.generation.layout import GenerationLayout, generation_section
        from ortbatch.generation.rewrites import rewrite_decoder
        from ortbatch.generation.runner import generation_providers

        self.layout = GenerationLayout.from_dict(generation_section(export))
        so = ort.SessionOptions()
        if threads:
            so.intra_op_num_threads = threads
        model: str | bytes = str(export / self.layout.model)
        #: the graph rewrites the baselines run with (none: the export as it is)
        self.rewrites: dict[str, int] = {}
        if rewritten:
            graph = rewrite_decoder(model, logits=self.layout.logits)
            if graph is not None:
                model, self.rewrites = graph.model, graph.rewrites
        # numpy feeds every step: on a GPU the cache goes through the host (a plain loop's cost);
        # on the provider chain BatchedGenerator runs (TF32 off on CUDA unless asked), so tokens compare
        self.session = build_session(model, generation_providers(providers), session_options=so)
        lay = self.layout
        self.past = [n for kv in zip(lay.past_keys, lay.past_values, strict=True) for n in kv]
        self.outputs = [lay.logits] + [n for kv in zip(lay.present_keys, lay.present_values, strict=True) for n in kv]
        self.eos = set(lay.eos_token_ids)
        dtype = {"tensor(float16)": np.float16}.get(
            next(i.type for i in self.session.get_inputs() if i.name == lay.past_keys[0]), np.float32
        )
        self.cache_dtype = dtype

    def run_batch(
        self, prompts: Sequence[list[int]], news: Sequence[int], t0: float, ttft: list[float], done: list[float]
    ) -> list[list[int]]:
        """Generate for one static batch; appends each row's first-token and done times."""
        lay = self.layout
        n = len(prompts)
        lens = np.array([len(p) for p in prompts])
        longest = int(lens.max())
        ids = np.full((n, longest), lay.pad_token_id, np.int64)
        mask = np.zeros((n, longest), np.int64)
        for i, p in enumerate(prompts):
            ids[i, longest - len(p) :] = p
            mask[i, longest - len(p) :] = 1
        past = [np.zeros((n, lay.num_kv_heads, 0, lay.head_dim), self.cache_dtype) for _ in self.past]
        out: list[list[int]] = [[] for _ in prompts]
        finished = [False] * n
        first = [0.0] * n
        end = [0.0] * n
        new = ids
        for _step in range(max(news)):
            positions = np.where(mask == 0, 1, np.cumsum(mask, axis=1) - 1)[:, -new.shape[1] :]
            feed = {lay.input_ids: new, lay.attention_mask: mask, **dict(zip(self.past, past, strict=True))}
            if lay.position_ids:
                feed[lay.position_ids] = positions
            logits, *past = self.session.run(self.outputs, feed)
            tokens = logits[:, -1].argmax(-1)
            now = time.perf_counter() - t0
            for i in range(n):
                if finished[i]:
                    continue
                if not out[i]:
                    first[i] = now
                out[i].append(int(tokens[i]))
                if len(out[i]) >= news[i] or int(tokens[i]) in self.eos:
                    finished[i] = True
                    end[i] = now
            if all(finished):
                break
            new = tokens[:, None].astype(np.int64)
            mask = np.concatenate([mask, np.ones((n, 1), np.int64)], axis=1)
        ttft.extend(first)
        # A static batch answers all its callers when the whole batch is done.
        done.extend([max(end)] * n)
        return out


def run_sequential(loop: DirectLoop, work: Workload) -> ModeResult:
    ttft: list[float] = []
    done: list[float] = []
    outs = []
    t0 = time.perf_counter()
    for p, n in zip(work.prompts, work.max_new, strict=True):
        outs += loop.run_batch([p], [n], t0, ttft, done)
    return _summarise("sequential", time.perf_counter() - t0, outs, ttft, done, note=_graph_note(loop.rewrites))


def run_static(loop: DirectLoop, work: Workload, batch: int) -> ModeResult:
    ttft: list[float] = []
    done: list[float] = []
    outs = []
    t0 = time.perf_counter()
    for i in range(0, len(work.prompts), batch):
        outs += loop.run_batch(work.prompts[i : i + batch], work.max_new[i : i + batch], t0, ttft, done)
    return _summarise(
        "static", time.perf_counter() - t0, outs, ttft, done, note=f"batches of {batch}; {_graph_note(loop.rewrites)}"
    )


CONTINUOUS_MODES: dict[str, dict[str, Any]] = {
    "continuous": {},
    "continuous-logprobs": {},
    "continuous-export-graph": {"last_position_logits": False, "attention_rewrite": False},
    "continuous-concat": {"kv_cache": "concat"},
    "continuous-no-prefix-cache": {"prefix_cache": False},
}


def run_continuous(
    export: Path,
    work: Workload,
    batch: int,
    threads: int | None = None,
    providers: Any = "cpu",
    mode: str = "continuous",
) -> ModeResult:
    import onnxruntime as ort

    from ortbatch import BatchedGenerator
    from ortbatch.generation import SamplingParams

    so = None
    if threads:
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
    options = CONTINUOUS_MODES[mode]
    known = inspect.signature(BatchedGenerator).parameters
    if any(k not in known for k in options):  # older code on PYTHONPATH
        raise RuntimeError(f"this ortbatch's BatchedGenerator has no {sorted(set(options) - set(known))}")
    logprobs = 5 if mode == "continuous-logprobs" else None
    with BatchedGenerator(export, max_batch_size=batch, providers=providers, session_options=so, **options) as gen:
        gen.generate(work.prompts[0][:4], 2)  # warm-up, as the baselines' first run is
        load_peak = peak_rss_mb()
        measured = reset_peak_rss()
        cpu0 = time.process_time()
        t0 = time.perf_counter()
        futs = [
            gen.submit(p, params=SamplingParams(max_new_tokens=n, logprobs=logprobs))
            for p, n in zip(work.prompts, work.max_new, strict=True)
        ]
        results = [f.result() for f in futs]
        wall = time.perf_counter() - t0
        serve_cpu = time.process_time() - cpu0
        peak = peak_rss_mb() if measured else None
        stats = gen.stats()
    ttft = [r.time_to_first_token_s for r in results]
    done = [r.total_time_s for r in results]
    kv_cache = getattr(stats, "kv_cache", "concat")
    note = (
        f"max_batch_size {batch}; kv cache {kv_cache}; mean decode rows {stats.mean_decode_rows:.1f}, "
        f"{stats.prefill_runs} prefills, padding {stats.cache_padding_fraction:.0%}, "
        f"{stats.cache_copies} cache copies, {stats.slot_reuses} joins in place"
    )
    if getattr(stats, "row_moves", 0):
        note += f", {stats.row_moves} rows moved"
    if getattr(stats, "prefix_cache_lookups", 0):
        note += f"; prefix cache {stats.prefix_cache_hits} hits, {stats.prefix_cache_tokens_saved} tokens saved"
    note += "; " + _graph_note(gen.graph_rewrites)
    if logprobs is not None:
        assert all(r.logprobs is not None and len(r.logprobs) == len(r.token_ids) for r in results)
        note = f"logprobs={logprobs} on every row; " + note
    result = _summarise(mode, wall, [list(r.token_ids) for r in results], ttft, done, note=note)
    result.peak_rss_mb, result.load_peak_rss_mb, result.kv_cache = peak, load_peak, kv_cache
    result.serve_cpu_s = serve_cpu
    result.decode_steps, result.mean_decode_rows = stats.decode_steps, stats.mean_decode_rows
    result.decode_time_s, result.prefill_time_s = stats.decode_time_s, stats.prefill_time_s
    return result


def _graph_note(rewrites: dict[str, int]) -> str:
    return "graph rewrites: " + (", ".join(sorted(rewrites)) if rewrites else "none")


def run_genai(genai_dir: Path, work: Workload) -> ModeResult:
    os.environ.setdefault("ORTGENAI_LOG_ORT_LIB", "1")  # without it the ORT library lookup is flaky here
    import onnxruntime_genai as og

    model = og.Model(str(genai_dir))
    engine = og.Engine(model)
    caps = engine.get_capabilities()
    # warm-up
    warm = engine.create_request()
    opts = og.TurnOptions(warm)
    opts.set_max_generated_tokens(2)
    opts.set_do_sample(False)
    warm.begin_turn(np.array(work.prompts[0][:4], np.int32), opts)
    buf = engine.create_event_buffer(1024)
    while engine.has_pending_requests():
        engine.run(buf)
    n = len(work.prompts)
    outs: list[list[int]] = [[] for _ in range(n)]
    ttft = [0.0] * n
    done = [0.0] * n
    index: dict[int, int] = {}
    requests = []
    failures: list[str] = []
    t0 = time.perf_counter()
    for i, (p, k) in enumerate(zip(work.prompts, work.max_new, strict=True)):
        req = engine.create_request()
        opts = og.TurnOptions(req)
        opts.set_max_generated_tokens(k)
        opts.set_do_sample(False)
        req.begin_turn(np.array(p, np.int32), opts)
        requests.append(req)
        index[id(req)] = i
    while engine.has_pending_requests():
        for ev in engine.run(buf):
            i = index.get(id(ev.request), -1)
            if i < 0:
                continue
            now = time.perf_counter() - t0
            if ev.token is not None:
                if not outs[i]:
                    ttft[i] = now
                outs[i].append(int(ev.token))
            if ev.finish_reason is not None:
                done[i] = now
                if "FAIL" in str(ev.finish_reason).upper():
                    failures.append(f"request {i}: {ev.finish_reason} {ev.error_code}")
    wall = time.perf_counter() - t0
    if failures:
        raise RuntimeError("onnxruntime-genai failed: " + "; ".join(failures[:3]))
    note = f"Engine, configured_max_batch_size {caps.configured_max_batch_size}"
    return _summarise("genai", wall, outs, ttft, done, note=note)


# -- report -----------------------------------------------------------------------------------
def markdown(results: list[ModeResult], header: str) -> str:
    seq = next((r for r in results if r.mode == "sequential"), None)
    static = next((r for r in results if r.mode == "static"), None)
    lines = [
        header,
        "",
        "| mode | tokens/s | vs sequential | vs static | tokens per serving CPU-s | TTFT mean / p50 / p99 (s) "
        "| latency p50 / p99 (s) | peak RSS serving / loading (MiB) | same tokens as sequential | notes |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        vs_seq = f"{r.tokens_per_s / seq.tokens_per_s:.2f}x" if seq else "-"
        vs_static = f"{r.tokens_per_s / static.tokens_per_s:.2f}x" if static else "-"
        same = "-" if r.same_as_sequential is None else f"{r.same_as_sequential}/{len(r.outputs)}"
        rss = "-" if r.peak_rss_mb is None else f"{r.peak_rss_mb:.0f}"
        if r.load_peak_rss_mb is not None:
            rss += f" / {r.load_peak_rss_mb:.0f}"
        lines.append(
            f"| {r.mode} | {r.tokens_per_s:.1f} | {vs_seq} | {vs_static} | {r.tokens / r.serve_cpu_s:.1f} | "
            f"{r.ttft_mean_s:.2f} / {r.ttft_p50_s:.2f} / {r.ttft_p99_s:.2f} | "
            f"{r.latency_p50_s:.2f} / {r.latency_p99_s:.2f} | {rss} | {same} | {r.note} |"
        )
    plain = next((r for r in results if r.mode == "continuous"), None)
    for other in ("continuous-concat", "continuous-no-prefix-cache"):
        base = next((r for r in results if r.mode == other), None)
        if plain and base:
            lines += [
                "",
                f"continuous / {other}: tokens/s {plain.tokens_per_s / base.tokens_per_s:.2f}x, mean TTFT "
                f"{base.ttft_mean_s / max(plain.ttft_mean_s, 1e-9):.2f}x lower, same tokens "
                f"{sum(a == b for a, b in zip(plain.outputs, base.outputs, strict=True))}/{len(plain.outputs)}",
            ]
    scored = next((r for r in results if r.mode == "continuous-logprobs"), None)
    if plain and scored:  # issue 28's acceptance 4: logprobs on every row cost at most 15%
        ratio = scored.tokens_per_s / plain.tokens_per_s
        lines += ["", f"continuous-logprobs / continuous tokens/s: {ratio:.3f} (at most 15% slower: >= 0.85)"]
    return "\n".join(lines) + "\n"


def _range(text: str) -> tuple[int, int]:
    a, _, b = text.partition("-")
    lo, hi = int(a), int(b or a)
    if lo < 1 or hi < lo:
        raise argparse.ArgumentTypeError(f"expected A-B with 1 <= A <= B, got {text!r}")
    return lo, hi


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="gpt2-mini")
    p.add_argument("--model", type=Path, help="an existing text-generation-with-past export (overrides --preset)")
    p.add_argument("--workdir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "ortbatch-bench")
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--prompt-lengths", type=_range, default=(16, 64))
    p.add_argument(
        "--shared-prefix", type=int, default=0, help="tokens of a prefix every prompt starts with (a system prompt)"
    )
    p.add_argument("--new-tokens", type=_range, default=(8, 96))
    p.add_argument("--max-batch-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=None, help="intra-op threads for every mode (default ORT's)")
    p.add_argument("--modes", default="sequential,static,genai,continuous")
    p.add_argument(
        "--baseline-graph",
        choices=("export", "rewritten"),
        default="rewritten",
        help="the graph sequential and static run: BatchedGenerator's rewritten graph (default: the ratios "
        "then measure batching alone), or the export as it is (what a plain ORT loop has)",
    )
    p.add_argument("--providers", default="cpu", help="cpu, cuda, ... for every mode (default cpu)")
    p.add_argument(
        "--provider-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an option of the first provider, for every mode (repeatable; e.g. use_tf32=1 with --providers cuda: "
        "every mode runs CUDA without TF32 unless asked, as BatchedGenerator does)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path)
    p.add_argument(
        "--save-outputs", action="store_true", help="each mode's generated token ids in the JSON (to compare peers)"
    )
    p.add_argument("--markdown", type=Path)
    args = p.parse_args(argv)

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    try:
        providers = provider_chain(args.providers, args.provider_option)
    except ValueError as exc:
        p.error(str(exc))
    export = args.model or build_model(args.preset, args.workdir)
    loop = DirectLoop(export, args.threads, rewritten=args.baseline_graph == "rewritten", providers=providers)
    work = Workload.make(
        args.requests, loop.layout.vocab_size, args.prompt_lengths, args.new_tokens, args.seed, args.shared_prefix
    )
    # Warm-up, so no mode pays for first-run allocations.
    loop.run_batch([work.prompts[0][:4]], [2], time.perf_counter(), [], [])

    results: list[ModeResult] = []
    skipped: dict[str, str] = {}
    for mode in modes:
        print(f"running {mode} ...", file=sys.stderr, flush=True)
        cpu0 = time.process_time()
        measured = reset_peak_rss()
        if mode == "sequential":
            results.append(run_sequential(loop, work))
        elif mode == "static":
            results.append(run_static(loop, work, args.max_batch_size))
        elif mode in CONTINUOUS_MODES:
            try:
                results.append(run_continuous(export, work, args.max_batch_size, args.threads, providers, mode))
            except RuntimeError as exc:  # an option older code does not have: said, not dropped
                skipped[mode] = str(exc)
        elif mode == "genai":
            if args.model:
                skipped[mode] = (
                    "onnxruntime-genai builds its own model from the transformers checkpoint: "
                    "use a llama-* preset rather than --model"
                )
                continue
            if PRESETS[args.preset]["arch"] != "llama":
                skipped[mode] = (
                    "onnxruntime-genai's model builder does not support GPT2LMHeadModel "
                    "(NotImplementedError: 'The GPT2LMHeadModel model is not currently supported'); "
                    "run a llama-* preset for this comparison"
                )
                continue
            try:
                genai_dir = build_genai(args.preset, args.workdir)
                results.append(run_genai(genai_dir, work))
            except Exception as exc:  # report, don't hide: the reason goes in the output
                skipped[mode] = f"{type(exc).__name__}: {exc}"
        else:
            p.error(f"unknown mode {mode!r}")
        if results and results[-1].mode == mode:
            results[-1].cpu_s = time.process_time() - cpu0
            results[-1].serve_cpu_s = results[-1].serve_cpu_s or results[-1].cpu_s
            if results[-1].peak_rss_mb is None and measured:
                results[-1].peak_rss_mb = peak_rss_mb()
            print(f"  {mode}: {results[-1].tokens_per_s:.1f} tokens/s", file=sys.stderr)
    seq = next((r for r in results if r.mode == "sequential"), None)
    if seq:
        for r in results:
            r.same_as_sequential = sum(a == b for a, b in zip(r.outputs, seq.outputs, strict=True))

    import onnxruntime

    lay = loop.layout
    token_bytes = 2 * lay.num_layers * lay.num_kv_heads * lay.head_dim * np.dtype(loop.cache_dtype).itemsize
    shared = f"a shared {args.shared_prefix}-token prefix then " if args.shared_prefix else ""
    header = (
        f"Model: {args.model or args.preset} (random weights), {args.requests} requests, prompts of "
        f"{shared}{args.prompt_lengths[0]}-{args.prompt_lengths[1]} tokens, new tokens {args.new_tokens[0]}-"
        f"{args.new_tokens[1]}, greedy, all arriving at t=0; KV cache {token_bytes} bytes per token; "
        f"onnxruntime {onnxruntime.__version__}, providers {providers}, {os.cpu_count()} CPUs "
        f"({platform.machine()}); load average "
        f"{' '.join(f'{x:.1f}' for x in os.getloadavg())} at the end."
    )
    text = markdown(results, header)
    for mode, why in skipped.items():
        text += f"\n{mode}: not run: {why}\n"
    print(text)
    if args.markdown:
        args.markdown.write_text(text)
    if args.json:
        payload = {
            "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "results": [{k: v for k, v in asdict(r).items() if k != "outputs" or args.save_outputs} for r in results],
            "skipped": skipped,
        }
        args.json.write_text(json.dumps(payload, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
