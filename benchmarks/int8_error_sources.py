"""Where dynamic int8 loses accuracy on all-MiniLM-L6-v2, and what each fix buys.

For each quantization of an fp32 export: the worst per-sentence cosine of the sentence
embedding to the fp32 model's (each text run alone) on the recipe's 10 samples (batched
together, right-padded, and each alone) and on 60 texts of the built-in corpus (batched
20 at a time), plus one-thread speed on one batch of 32 corpus texts (median of
interleaved runs). Also a sensitivity scan: each group of six MatMuls (Q, K, V, attention
output, FFN in, FFN out) kept float, or alone quantized.

    python benchmarks/int8_error_sources.py FP32_EXPORT_DIR [--scan]

FP32_EXPORT_DIR: ``ortbatch export --recipe export/minilm.toml -o DIR``.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("export_dir")
    ap.add_argument("--scan", action="store_true", help="also the per-group sensitivity scan")
    args = ap.parse_args()
    import onnx
    import onnxruntime as ort
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from transformers import AutoTokenizer

    from ortbatch.bench.texts import TEXTS
    from ortbatch.export.outliers import prepare_int8
    from ortbatch.export.recipes import load_recipe

    logging.getLogger().setLevel(logging.ERROR)  # quantize_dynamic's pre-processing hint
    root = Path(args.export_dir)
    fp32 = root / "model.onnx"
    tok = AutoTokenizer.from_pretrained(root)
    samples = list(load_recipe(Path(__file__).resolve().parents[1] / "export" / "minilm.toml").samples)
    dev = list(TEXTS[:60])

    def feed(texts: list[str]) -> dict[str, np.ndarray]:
        e = tok(texts, return_tensors="np", padding=True, truncation=True, max_length=128)
        return {k: e[k].astype(np.int64) for k in ("input_ids", "attention_mask")}

    def session(path: Path, threads: int = 1) -> ort.InferenceSession:
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.log_severity_level = 3
        return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])

    def emb(s: ort.InferenceSession, texts: list[str], alone: bool = False, chunk: int = 20) -> np.ndarray:
        if alone:
            return np.concatenate([s.run(["sentence_embedding"], feed([t]))[0] for t in texts])
        return np.concatenate(
            [s.run(["sentence_embedding"], feed(texts[i : i + chunk]))[0] for i in range(0, len(texts), chunk)]
        )

    def cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)

    ref_s, ref_d = emb(session(fp32), samples, alone=True), emb(session(fp32), dev, alone=True)

    def accuracy(path: Path) -> str:
        s = session(path)
        b = cos(emb(s, samples), ref_s).min()
        a = cos(emb(s, samples, alone=True), ref_s).min()
        d = cos(emb(s, dev), ref_d).min()
        return f"{b:.4f} | {a:.4f} | {d:.4f}"

    tmp = Path(tempfile.mkdtemp(prefix="int8-sources-"))
    matmuls = [
        n.name
        for n in onnx.load(str(fp32), load_external_data=False).graph.node
        if n.op_type == "MatMul" and any(k in n.name for k in ("query", "key", "value", "dense"))
    ]

    def quantize(name: str, src: Path = fp32, exclude: list[str] | None = None, **kw: object) -> Path:
        out = tmp / f"{name}.onnx"
        quantize_dynamic(
            src,
            out,
            op_types_to_quantize=["MatMul"],
            per_channel=bool(kw.get("per_channel", True)),
            reduce_range=bool(kw.get("reduce_range", False)),
            weight_type=QuantType.QUInt8 if kw.get("u8") else QuantType.QInt8,
            nodes_to_exclude=exclude or [],
            extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT},
        )
        return out

    def rewritten(name: str, ratio: float | None, mask: bool, **kw: object) -> Path:
        model = onnx.load(str(fp32))
        calib = [feed([t]) for t in samples + list(TEXTS)]
        prep = prepare_int8(model, feeds=calib, outlier_ratio=ratio, mask_padding=mask)
        src = tmp / f"{name}-prep.onnx"
        onnx.save(model, str(src))
        print(f"  ({name}: {prep.outlier_channels} outlier channels in {prep.split_inputs} inputs)", file=sys.stderr)
        return quantize(name, src, prep.float_nodes, **kw)

    variants = {
        "int8 per-channel (u8 activations, s8 weights)": quantize("pc"),
        "int8 per-tensor weights": quantize("pt", per_channel=False),
        "int8 reduce_range (7-bit weights)": quantize("rr", reduce_range=True),
        "int8 u8 weights": quantize("u8", u8=True),
        "padding masked": rewritten("pm", None, True),
        "outliers (ratio 4) in float": rewritten("o4", 4.0, False),
        "outliers 4 + padding masked": rewritten("o4pm", 4.0, True),
        "outliers 4 + padding masked + reduce_range": rewritten("o4pmrr", 4.0, True, reduce_range=True),
        "outliers 6 + padding masked + reduce_range": rewritten("o6pmrr", 6.0, True, reduce_range=True),
        "outliers 3 + padding masked + reduce_range": rewritten("o3pmrr", 3.0, True, reduce_range=True),
    }
    f = feed(list(TEXTS[:32]))
    sessions = {"fp32": session(fp32)} | {k: session(p) for k, p in variants.items()}
    times: dict[str, list[float]] = {k: [] for k in sessions}
    for s in sessions.values():
        s.run(None, f)
    for _ in range(7):
        for k, s in sessions.items():
            t = time.perf_counter()
            s.run(None, f)
            times[k].append(time.perf_counter() - t)
    base = float(np.median(times["fp32"]))
    print("| variant | samples batched | samples alone | 60 corpus texts | 1-thread speed vs fp32 |")
    print("|---|---|---|---|---|")
    for k, p in variants.items():
        print(f"| {k} | {accuracy(p)} | {base / float(np.median(times[k])):.2f}x |", flush=True)
    if args.scan:
        groups = {
            "Q": "query",
            "K": "key",
            "V": "value",
            "attention output": "attention/output",
            "FFN in": "intermediate",
            "FFN out": "/output/dense",
        }
        print("\n| MatMul group (x6 layers) | that group float, rest int8 | only that group int8 |")
        print("|---|---|---|")
        for label, part in groups.items():
            nodes = [m for m in matmuls if part in m and (label != "FFN out" or "attention" not in m)]
            a = accuracy(quantize("xf", exclude=nodes)).split(" | ")[0]
            b = accuracy(quantize("xo", exclude=[m for m in matmuls if m not in nodes])).split(" | ")[0]
            print(f"| {label} | {a} | {b} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
