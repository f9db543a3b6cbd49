"""Image embeddings, one run, same weights and images: ortbatch in process (ImageEmbedder,
preprocessing included) at 1, 16 and 64 concurrent clients, against transformers
(``get_image_features`` in batches of 32, its own image processor) and
``SentenceTransformer.encode(images, batch_size=32)``; Infinity's image engine when
``infinity_emb`` imports.

    python benchmarks/vision.py [--model ST_CLIP_DIR] [--random-weights tiny|base]
                                [--images 256] [--clients 1,16,64] [--work DIR]

Every contender starts from the same encoded files (JPEG and PNG bytes of generated pictures,
mixed sizes from 64x48 to 1024x768), so decoding and preprocessing are timed on every side.
``--model`` is a sentence-transformers CLIP checkpoint (clip-ViT-B-32 layout); without it,
``--random-weights`` builds one of that shape with random weights (``base``: ViT-B/32's
shape; ``tiny``: 2 layers, for a rehearsal). Images/s after a warm-up; the load average is
printed before each measurement, since the timings mean something only on an idle machine.

Infinity (infinity-emb 0.0.78, its torch image engine) is not installed by the dev extra: it
pins torch 2.8, sentence-transformers 3.4 and numpy 1.26, which would replace this
environment's; install it in a venv of its own to add it to the run.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def pictures(n: int, seed: int = 0) -> list[bytes]:
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    sizes = [(64, 48), (224, 224), (640, 480), (480, 640), (1024, 768), (300, 120)]
    out = []
    for i in range(n):
        w, h = sizes[i % len(sizes)]
        arr = rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)
        img = Image.fromarray(arr, "RGB")
        draw = ImageDraw.Draw(img)
        draw.rectangle([w // 4, h // 4, w // 2, h // 2], fill=(255, 0, 0))
        draw.text((5, 5), f"image {i}", fill=(255, 255, 255))
        buf = io.BytesIO()
        img.save(buf, "JPEG" if i % 3 else "PNG", quality=90)
        out.append(buf.getvalue())
    return out


def build_random(kind: str, work: Path) -> Path:
    """A sentence-transformers CLIP layout with random weights of ViT-B/32's shape (or tiny)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import torch
    from sentence_transformers import SentenceTransformer
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPTokenizerFast

    from tests.vision.models import _clip_tokenizer

    base = work / f"clip-{kind}-base"
    target = work / f"clip-{kind}"
    if (target / "modules.json").is_file():
        return target
    base.mkdir(parents=True, exist_ok=True)
    _clip_tokenizer(base)
    vocab = len(CLIPTokenizerFast.from_pretrained(base))
    torch.manual_seed(0)
    if kind == "base":
        text = {"hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 12, "num_attention_heads": 8}
        vision = {
            "hidden_size": 768,
            "intermediate_size": 3072,
            "num_hidden_layers": 12,
            "num_attention_heads": 12,
            "image_size": 224,
            "patch_size": 32,
        }
        proj = 512
        proc = CLIPImageProcessor()
    else:
        text = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
        vision = {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "image_size": 64,
            "patch_size": 16,
        }
        proj = 32
        proc = CLIPImageProcessor(size={"shortest_edge": 64}, crop_size={"height": 64, "width": 64})
    config = CLIPConfig(text_config={"vocab_size": vocab, **text}, vision_config=vision, projection_dim=proj)
    CLIPModel(config).eval().save_pretrained(base)
    proc.save_pretrained(base)
    try:
        from sentence_transformers.sentence_transformer.modules import CLIPModel as STCLIP
    except ImportError:
        from sentence_transformers.models import CLIPModel as STCLIP
    SentenceTransformer(modules=[STCLIP(str(base))]).save(str(target))
    return target


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def ortbatch_run(export: Path, images: list[bytes], clients: int) -> float:
    from ortbatch.vision import ImageEmbedder

    with ImageEmbedder(export) as emb:
        emb.embed_images(images[:8])  # warm-up
        it = iter(range(len(images)))
        lock = threading.Lock()

        def client() -> None:
            while True:
                with lock:
                    i = next(it, None)
                if i is None:
                    return
                emb.embed_images([images[i]])

        threads = [threading.Thread(target=client) for _ in range(clients)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return len(images) / (time.perf_counter() - t0)


def transformers_run(model_dir: Path, images: list[bytes]) -> float:
    import torch
    from PIL import Image
    from transformers import AutoImageProcessor, CLIPModel

    model = CLIPModel.from_pretrained(model_dir).eval()
    proc = AutoImageProcessor.from_pretrained(model_dir, use_fast=False)

    def run(batch: list[bytes]) -> None:
        pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in batch]
        with torch.inference_mode():
            model.get_image_features(**proc(pil, return_tensors="pt"))

    run(images[:8])
    t0 = time.perf_counter()
    for s in range(0, len(images), 32):
        run(images[s : s + 32])
    return len(images) / (time.perf_counter() - t0)


def st_run(st_dir: Path, images: list[bytes]) -> float:
    from PIL import Image
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(st_dir), device="cpu")
    model.encode([Image.open(io.BytesIO(b)).convert("RGB") for b in images[:8]])
    t0 = time.perf_counter()
    model.encode([Image.open(io.BytesIO(b)).convert("RGB") for b in images], batch_size=32)
    return len(images) / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, help="a sentence-transformers CLIP checkpoint")
    ap.add_argument("--random-weights", choices=["tiny", "base"], default="base")
    ap.add_argument("--images", type=int, default=256)
    ap.add_argument("--clients", default="1,16,64")
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "ortbatch-bench-vision")
    args = ap.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    st_dir = args.model or build_random(args.random_weights, args.work)
    export = args.work / f"export-{st_dir.name}"
    if not (export / "ortbatch.json").is_file():
        from ortbatch.export import export_model

        export_model(str(st_dir), export, progress=print)
    images = pictures(args.images)
    results: dict[str, float] = {}
    for c in (int(x) for x in args.clients.split(",")):
        print(f"load {load()}: ortbatch in process, {c} clients ...", flush=True)
        results[f"ortbatch in process, {c} clients"] = ortbatch_run(export, images, c)
    print(f"load {load()}: transformers get_image_features, batches of 32 ...", flush=True)
    results["transformers get_image_features (batch 32)"] = transformers_run(st_dir, images)
    print(f"load {load()}: SentenceTransformer.encode(batch_size=32) ...", flush=True)
    results["SentenceTransformer.encode (batch 32)"] = st_run(st_dir, images)
    try:
        import infinity_emb  # noqa: F401
    except ImportError:
        print("Infinity: infinity_emb is not installed here (see the module docstring); not measured")
    print(f"\n{len(images)} images, mixed sizes, decoding and preprocessing included (images/s):")
    base = results["SentenceTransformer.encode (batch 32)"]
    for name, rate in results.items():
        print(f"  {name:48s} {rate:9.1f}  ({rate / base:.2f}x encode)")
    print(f"median of the ortbatch runs: {statistics.median(v for k, v in results.items() if 'ortbatch' in k):.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
