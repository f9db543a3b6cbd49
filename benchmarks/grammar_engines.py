"""Grammar engines for constrained decoding, measured on CPU: llguidance, outlines-core, xgrammar.

    pip install llguidance outlines-core xgrammar   # xgrammar pulls torch (see below)
    python benchmarks/grammar_engines.py --vocab 50257 --markdown out/engines.md --json out/engines.json

What ortbatch needs from an engine, per constrained row and decode step: the set of tokens the
grammar allows next (a bitmask over the vocabulary), then advancing it by the sampled token.
This script measures, for each engine installed, on the same byte-level BPE tokenizer and the
same schemas, along the same token sequences (a valid document per schema, tokenized):

- ``import``: whether the engine imports with torch and transformers blocked (ortbatch's
  runtime must not need torch);
- ``tokenizer_s``: building the engine's tokenizer/vocabulary object from ``tokenizer.json``;
- ``compile_s``: compiling each schema (cold; the first compile of a run is excluded as warm-up);
- ``mask_us`` mean / p50 / p99 / max: one mask computation per step along the document;
- ``advance_us``: consuming one token.

The tokenizer is trained here (offline): a byte-level BPE of ``--vocab`` tokens on the Python
standard library's sources (sorted, first 24 MB), saved in ``--workdir`` and reused; pass
``--tokenizer path/tokenizer.json`` to use a real model's. Each engine runs in its own
subprocess, so one engine's import (torch for xgrammar) does not weigh on another's figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ENGINES = ("llguidance", "outlines-core", "xgrammar")
EOS = "<|endoftext|>"

#: (name, schema, a valid document). Documents are compact JSON, which every engine accepts.
SCHEMAS: list[tuple[str, dict[str, Any], Any]] = [
    (
        "flat-object",
        {
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "ok": {"type": "boolean"}},
            "required": ["name", "age", "ok"],
        },
        {"name": "Ada Lovelace", "age": 36, "ok": True},
    ),
    (
        "enum-and-bounds",
        {
            "type": "object",
            "properties": {
                "colour": {"enum": ["red", "green", "blue"]},
                "score": {"type": "number", "minimum": 0, "maximum": 10},
                "count": {"type": "integer", "minimum": 1, "maximum": 99},
            },
            "required": ["colour", "score", "count"],
        },
        {"colour": "green", "score": 7.25, "count": 42},
    ),
    (
        "nested-arrays",
        {
            "type": "object",
            "properties": {
                "matrix": {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}},
                "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
            },
            "required": ["matrix", "tags"],
        },
        {"matrix": [[1, 2, 3], [4, 5, 6], [7, 8, 9]], "tags": ["alpha", "beta", "gamma"]},
    ),
    (
        "refs",
        {
            "$defs": {
                "point": {
                    "type": "object",
                    "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                    "required": ["x", "y"],
                }
            },
            "type": "object",
            "properties": {
                "path": {"type": "array", "items": {"$ref": "#/$defs/point"}},
                "closed": {"type": "boolean"},
            },
            "required": ["path", "closed"],
        },
        {"path": [{"x": 0, "y": 0}, {"x": 1.5, "y": -2}, {"x": 3, "y": 4}], "closed": False},
    ),
    (
        "string-patterns",
        {
            "type": "object",
            "properties": {
                "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
                "code": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{3}$"},
                "note": {"type": "string", "maxLength": 40},
            },
            "required": ["date", "code"],
        },
        {"date": "2026-11-30", "code": "ABC123", "note": "structured output"},
    ),
    (
        "tool-call",
        {
            "type": "object",
            "properties": {
                "name": {"const": "get_weather"},
                "arguments": {
                    "type": "object",
                    "properties": {
                        "city": {"type": "string"},
                        "unit": {"enum": ["celsius", "fahrenheit"]},
                        "days": {"type": "integer", "minimum": 1, "maximum": 14},
                    },
                    "required": ["city", "unit"],
                },
            },
            "required": ["name", "arguments"],
        },
        {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius", "days": 3}},
    ),
    (
        "long-record",
        {
            "type": "object",
            "properties": {
                "id": {"type": "integer"},
                "title": {"type": "string"},
                "authors": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {"first": {"type": "string"}, "last": {"type": "string"}},
                        "required": ["first", "last"],
                    },
                },
                "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
                "abstract": {"type": "string"},
            },
            "required": ["id", "title", "authors", "year", "abstract"],
        },
        {
            "id": 1234,
            "title": "Continuous batching of constrained decoders",
            "authors": [{"first": "Grace", "last": "Hopper"}, {"first": "Alan", "last": "Turing"}],
            "year": 2026,
            "abstract": "We measure how much a grammar mask costs per decode step on a CPU.",
        },
    ),
]


# -- the tokenizer ------------------------------------------------------------------------------
def bench_tokenizer(vocab: int, workdir: Path) -> Path:
    """A byte-level BPE of ``vocab`` tokens trained on the stdlib's sources (once, then reused)."""
    path = workdir / f"bpe-{vocab}" / "tokenizer.json"
    if path.is_file():
        return path
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts: list[str] = []
    size = 0
    for f in sorted(stdlib.rglob("*.py")):
        if size > 24_000_000:
            break
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        texts.append(text)
        size += len(text)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def byte_tokens(tokenizer_json: Path) -> tuple[list[bytes], int]:
    """Every token's bytes (as ortbatch maps them back for OpenAI's logprobs ``bytes``) and the eos id."""
    from tokenizers import Tokenizer

    from ortbatch.generation.requests import ExportTokenizer

    size = Tokenizer.from_file(str(tokenizer_json)).get_vocab_size(with_added_tokens=True)
    tok = ExportTokenizer(tokenizer_json.parent, tokenizer_json.name)
    return tok.token_bytes(range(size)), int(tok.get().token_to_id(EOS))


# -- the engines (each in its own process) ------------------------------------------------------
class Engine:
    """One engine's tokenizer and matchers, behind the four calls measured."""

    def __init__(self, tokenizer_json: Path) -> None:
        raise NotImplementedError

    def compile(self, schema: dict[str, Any]) -> Any:
        raise NotImplementedError

    def matcher(self, compiled: Any) -> Any:
        raise NotImplementedError

    def mask(self, matcher: Any) -> Any:
        raise NotImplementedError

    def allowed(self, mask: Any, token: int) -> bool:
        raise NotImplementedError

    def advance(self, matcher: Any, token: int) -> None:
        raise NotImplementedError


class Llguidance(Engine):
    def __init__(self, tokenizer_json: Path) -> None:
        import llguidance
        import llguidance.numpy as lln
        import numpy as np

        self.ll, self.lln = llguidance, lln
        tok = json.loads(tokenizer_json.read_text())
        eos = next(t["id"] for t in tok["added_tokens"] if t["content"] == EOS)
        self.tok = llguidance.LLTokenizer(tokenizer_json.read_text(), eos_token=eos)
        self.bits = lln.allocate_token_bitmask(1, self.tok.vocab_size)
        self.np = np

    def compile(self, schema: dict[str, Any]) -> Any:
        grammar = self.ll.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        m = self.ll.LLMatcher(self.tok, grammar)  # compiles the grammar (lexer, token trie) here
        if m.is_error():
            raise ValueError(m.get_error())
        return grammar, m

    def matcher(self, compiled: Any) -> Any:
        return compiled[1].deep_copy()

    def mask(self, matcher: Any) -> Any:
        self.lln.fill_next_token_bitmask(matcher, self.bits, 0)
        return self.bits[0]

    def allowed(self, mask: Any, token: int) -> bool:
        return bool((int(mask[token // 32]) >> (token % 32)) & 1)

    def advance(self, matcher: Any, token: int) -> None:
        if not matcher.consume_token(token):
            raise ValueError(matcher.get_error())


class OutlinesCore(Engine):
    def __init__(self, tokenizer_json: Path) -> None:
        import numpy as np
        import outlines_core

        self.oc, self.np = outlines_core, np
        tokens, eos = byte_tokens(tokenizer_json)
        mapping: dict[bytes, list[int]] = {}
        for i, b in enumerate(tokens):
            if i != eos:
                mapping.setdefault(b, []).append(i)
        self.vocab = outlines_core.Vocabulary(eos, mapping)
        self.size = len(tokens)
        self.bits = np.zeros((self.size + 31) // 32, np.int32)

    def compile(self, schema: dict[str, Any]) -> Any:
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema), whitespace_pattern="")
        return self.oc.Index(regex, self.vocab)

    def matcher(self, compiled: Any) -> Any:
        return self.oc.Guide(compiled)

    def mask(self, matcher: Any) -> Any:
        matcher.write_mask_into(self.bits.ctypes.data, self.bits.size, 4)
        return self.bits

    def allowed(self, mask: Any, token: int) -> bool:
        return bool((int(mask[token // 32]) >> (token % 32)) & 1)

    def advance(self, matcher: Any, token: int) -> None:
        matcher.advance(token)


class Xgrammar(Engine):
    def __init__(self, tokenizer_json: Path) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        tok = json.loads(tokenizer_json.read_text())
        vocab = {**tok["model"]["vocab"], **{t["content"]: t["id"] for t in tok["added_tokens"]}}
        encoded = [""] * len(vocab)
        for piece, i in vocab.items():
            encoded[i] = piece
        eos = vocab[EOS]
        self.info = xgr.TokenizerInfo(encoded, xgr.VocabType.BYTE_LEVEL, stop_token_ids=[eos])
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self.bits = xgr.allocate_token_bitmask(1, self.info.vocab_size)

    def compile(self, schema: dict[str, Any]) -> Any:
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def mask(self, matcher: Any) -> Any:
        matcher.fill_next_token_bitmask(self.bits)
        return self.bits[0]

    def allowed(self, mask: Any, token: int) -> bool:
        return bool((int(mask[token // 32]) >> (token % 32)) & 1)

    def advance(self, matcher: Any, token: int) -> None:
        if not matcher.accept_token(token):
            raise ValueError(f"token {token} refused")


def _imports_without_torch(module: str) -> bool:
    code = (
        "import sys, importlib.abc\n"
        "class B(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] in ('torch', 'transformers', 'triton'): raise ImportError(name)\n"
        "sys.meta_path.insert(0, B())\n"
        f"import {module}\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def _percentile(values: Sequence[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]


def measure(engine_name: str, tokenizer_json: Path, repeats: int) -> dict[str, Any]:
    """Run one engine over every schema; the figures as a dict."""
    from tokenizers import Tokenizer

    module = {"llguidance": "llguidance", "outlines-core": "outlines_core", "xgrammar": "xgrammar"}[engine_name]
    result: dict[str, Any] = {"engine": engine_name, "imports_without_torch": _imports_without_torch(module)}
    try:
        from importlib.metadata import version

        result["version"] = version(engine_name)
    except Exception:
        result["version"] = "?"
    cls: Callable[[Path], Engine] = {"llguidance": Llguidance, "outlines-core": OutlinesCore, "xgrammar": Xgrammar}[
        engine_name
    ]
    t0 = time.perf_counter()
    engine = cls(tokenizer_json)
    result["tokenizer_s"] = time.perf_counter() - t0
    hf = Tokenizer.from_file(str(tokenizer_json))
    engine.compile(SCHEMAS[0][1])  # warm-up: first-call costs are not a schema's
    masks: list[float] = []
    advances: list[float] = []
    per_schema = []
    for name, schema, doc in SCHEMAS:
        t0 = time.perf_counter()
        compiled = engine.compile(schema)
        compile_s = time.perf_counter() - t0
        ids = hf.encode(json.dumps(doc, separators=(",", ":")), add_special_tokens=False).ids
        steps: list[float] = []
        for _ in range(repeats):
            m = engine.matcher(compiled)
            for token in ids:
                t0 = time.perf_counter()
                mask = engine.mask(m)
                steps.append(time.perf_counter() - t0)
                if not engine.allowed(mask, token):
                    raise AssertionError(f"{engine_name}: {name}: token {token} masked out")
                t0 = time.perf_counter()
                engine.advance(m, token)
                advances.append(time.perf_counter() - t0)
        masks += steps
        per_schema.append(
            {"schema": name, "compile_s": compile_s, "tokens": len(ids), "mask_us_mean": 1e6 * statistics.mean(steps)}
        )
    result.update(
        mask_us_mean=1e6 * statistics.mean(masks),
        mask_us_p50=1e6 * _percentile(masks, 50),
        mask_us_p99=1e6 * _percentile(masks, 99),
        mask_us_max=1e6 * max(masks),
        advance_us_mean=1e6 * statistics.mean(advances),
        compile_s_mean=statistics.mean(s["compile_s"] for s in per_schema),
        compile_s_max=max(s["compile_s"] for s in per_schema),
        schemas=per_schema,
    )
    return result


def markdown(results: list[dict[str, Any]], header: str) -> str:
    lines = [
        header,
        "",
        "| engine | version | imports without torch | tokenizer (s) | compile mean / max (ms) "
        "| mask mean / p50 / p99 / max (us) | advance mean (us) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['engine']} | | | | | {r['error']} | |")
            continue
        lines.append(
            f"| {r['engine']} | {r['version']} | {'yes' if r['imports_without_torch'] else 'no'} "
            f"| {r['tokenizer_s']:.2f} | {1e3 * r['compile_s_mean']:.1f} / {1e3 * r['compile_s_max']:.1f} "
            f"| {r['mask_us_mean']:.0f} / {r['mask_us_p50']:.0f} / {r['mask_us_p99']:.0f} / {r['mask_us_max']:.0f} "
            f"| {r['advance_us_mean']:.0f} |"
        )
    lines += ["", "Per schema (compile ms, mask mean us):", ""]
    names = [s[0] for s in SCHEMAS]
    lines.append("| schema | tokens | " + " | ".join(r["engine"] for r in results if "error" not in r) + " |")
    lines.append("|---|---|" + "---|" * sum(1 for r in results if "error" not in r))
    for i, name in enumerate(names):
        row = [name, str(next((r["schemas"][i]["tokens"] for r in results if "error" not in r), ""))]
        for r in results:
            if "error" not in r:
                s = r["schemas"][i]
                row.append(f"{1e3 * s['compile_s']:.1f} / {s['mask_us_mean']:.0f}")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--tokenizer", type=Path, help="a tokenizer.json to use instead of the trained one")
    p.add_argument("--workdir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "ortbatch-bench")
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--repeats", type=int, default=5, help="passes over each document")
    p.add_argument("--json", type=Path)
    p.add_argument("--markdown", type=Path)
    p.add_argument("--one", help=argparse.SUPPRESS)  # run one engine in this process, print JSON
    args = p.parse_args(argv)
    tokenizer = args.tokenizer or bench_tokenizer(args.vocab, args.workdir)
    if args.one:
        print(json.dumps(measure(args.one, tokenizer, args.repeats)))
        return 0
    results = []
    for name in args.engines.split(","):
        cmd = [sys.executable, __file__, "--one", name, "--tokenizer", str(tokenizer), "--repeats", str(args.repeats)]
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0:
            results.append({"engine": name, "error": run.stderr.strip().splitlines()[-1] if run.stderr else "failed"})
        else:
            results.append(json.loads(run.stdout.strip().splitlines()[-1]))
        print(json.dumps(results[-1])[:300], file=sys.stderr)
    load = os.getloadavg()
    from tokenizers import Tokenizer

    size = Tokenizer.from_file(str(tokenizer)).get_vocab_size(with_added_tokens=True)
    header = (
        f"Grammar engines on {platform.machine()} ({os.cpu_count()} cores), Python {platform.python_version()}, "
        f"tokenizer {tokenizer.name} ({size} tokens), load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}"
    )
    write_report(markdown(results, header), {"header": header, "results": results}, args.markdown, args.json)
    return 0


def write_report(text: str, record: dict[str, Any], markdown: Path | None, json_path: Path | None) -> None:
    """Print the markdown ``text``; write it and the JSON ``record`` where asked."""
    print(text)
    for path, content in ((markdown, text), (json_path, json.dumps(record, indent=2))):
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(content)


if __name__ == "__main__":
    raise SystemExit(main())
