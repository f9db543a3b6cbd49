"""Build a BERT-base-sized encoder from its config (random weights, no hub) and export it to ONNX.

    python benchmarks/make_bert_base.py --out DIR [--tiny] [--trt-cache DIR]

Writes ``DIR/model.onnx`` and ``DIR/ortbatch.json`` (inputs input_ids/attention_mask with a
ragged ``sequence`` axis, outputs last_hidden_state (ragged) and pooler_output). With
``--trt-cache`` the manifest also carries TensorRT provider options — fp16, an engine cache,
and one optimisation profile covering batch 1..64 x length 1..128 — which ``--providers
tensorrt`` then picks up in both the baseline session and BatchedSession. ``--tiny`` makes a
2-layer, 64-wide model for checking this script on a CPU. Used by scripts/gpu-check.sh.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ortbatch.manifest import InputSpec, Manifest, OutputSpec  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--trt-cache", type=Path, default=None)
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--max-length", type=int, default=128)
    args = p.parse_args()

    import torch
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    if args.tiny:
        config = BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
    else:
        config = BertConfig()  # the defaults are BERT-base: 12 layers, 768 wide, 12 heads, 3072 FFN
    model = BertModel(config).eval()

    class Wrapped(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert = model

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
            out = self.bert(input_ids=input_ids, attention_mask=attention_mask, return_dict=True)
            return out.last_hidden_state, out.pooler_output

    args.out.mkdir(parents=True, exist_ok=True)
    ids = torch.randint(1000, 2000, (2, 16))
    mask = torch.ones_like(ids)
    path = args.out / "model.onnx"
    axes = {0: "batch", 1: "sequence"}
    export_args = dict(
        input_names=["input_ids", "attention_mask"],
        output_names=["last_hidden_state", "pooler_output"],
        opset_version=17,
        dynamic_axes={
            "input_ids": axes,
            "attention_mask": axes,
            "last_hidden_state": axes,
            "pooler_output": {0: "batch"},
        },
    )
    with torch.no_grad():
        try:
            torch.onnx.export(Wrapped(), (ids, mask), str(path), dynamo=False, **export_args)
        except TypeError:  # an older torch without the dynamo argument
            torch.onnx.export(Wrapped(), (ids, mask), str(path), **export_args)
    providers = []
    if args.trt_cache is not None:
        args.trt_cache.mkdir(parents=True, exist_ok=True)
        b, n = args.max_batch, args.max_length
        providers.append(
            {
                "name": "TensorrtExecutionProvider",
                "options": {
                    "trt_fp16_enable": True,
                    "trt_engine_cache_enable": True,
                    "trt_engine_cache_path": str(args.trt_cache),
                    "trt_profile_min_shapes": "input_ids:1x1,attention_mask:1x1",
                    "trt_profile_opt_shapes": "input_ids:32x32,attention_mask:32x32",
                    "trt_profile_max_shapes": f"input_ids:{b}x{n},attention_mask:{b}x{n}",
                },
            }
        )
    seq = ("batch", "sequence")
    Manifest(
        model="model.onnx",
        source={
            "model": "bert-base (random weights from BertConfig)" if not args.tiny else "bert-tiny (random)",
            "task": "feature-extraction",
        },
        inputs={"input_ids": InputSpec("int64", seq, 0), "attention_mask": InputSpec("int64", seq, 0)},
        outputs={
            "last_hidden_state": OutputSpec(("batch", "sequence", None)),
            "pooler_output": OutputSpec(("batch", None)),
        },
        limits={"max_batch_size": args.max_batch, "max_sequence_length": args.max_length},
        providers=providers,
    ).save(args.out)
    (args.out / "config.json").write_text(config.to_json_string())
    print(f"wrote {path} ({path.stat().st_size / 1e6:.0f} MB) and {args.out / 'ortbatch.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
