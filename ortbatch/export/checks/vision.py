"""The built-in checks for image exports, on pictures made here with Pillow and numpy.

Same four checks and report as the text exports (:mod:`.suite`), with images:

1. ``reference_parity``: pictures of several sizes and aspect ratios (shapes, text, noise)
   through ortbatch's path (:func:`ortbatch.vision.load_image`, :class:`~ortbatch.vision.ImageProcessor`,
   the ONNX graph) against the user's library end to end (transformers' own image processor and
   model: ``get_image_features`` / ``get_text_features``, ``AutoModelForImageClassification``;
   ``SentenceTransformer.encode`` for a sentence-transformers CLIP checkpoint), batched; the
   text tower on the samples the same way (its tokenizer, truncation and padding).
2. ``shape_generalisation``: random pixel values at batch sizes 1, 3 and 8 (and texts at several
   lengths) against the PyTorch model on the same tensors.
3. ``batching_invariance``: each picture (and text) alone vs in a batch with the others.
4. ``provider_parity``: a GPU provider against CPU.

Plus ``finite_weights``. Embeddings are judged by cosine, logits by argmax agreement, with the
dtype's elementwise tolerances too (:func:`.agreement.compare`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..._ort import CPU, arithmetic, parity_tolerances, parse_provider_names
from ...manifest import Manifest
from ..recipes import DEFAULT_SAMPLES, tolerances_for
from .agreement import compare
from .onnx_model import not_here, open_sessions
from .results import NOT_RUN, Case, CheckResult, Comparison, ValidationReport, shorten
from .suite import CHECKS, finite_weights, status_of

__all__ = ["is_image_export", "sample_pictures", "validate_vision"]

#: (width, height) of the check pictures: square, landscape, portrait, thin strips, tiny, large
PICTURE_SIZES = ((224, 224), (640, 480), (480, 640), (97, 31), (31, 97), (1000, 200), (12, 12), (301, 300))


def is_image_export(directory: str | os.PathLike[str]) -> bool:
    from ..vision import is_vision_export

    try:
        return is_vision_export(Manifest.load(directory))
    except Exception:  # not an export: validate's own loading reports it
        return False


def sample_pictures(seed: int = 0) -> list[Any]:
    """RGB pictures at :data:`PICTURE_SIZES`: a noisy gradient, filled shapes and a line of text."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    out = []
    for i, (w, h) in enumerate(PICTURE_SIZES):
        yy, xx = np.mgrid[0:h, 0:w]
        base = np.stack([xx * 255 // max(1, w - 1), yy * 255 // max(1, h - 1), np.full_like(xx, 40 * i % 256)], -1)
        noise = rng.integers(-30, 30, size=(h, w, 3))
        img = Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8), "RGB")
        draw = ImageDraw.Draw(img)
        for _ in range(3):
            x0, x1 = sorted(int(v) for v in rng.integers(0, w, 2))
            y0, y1 = sorted(int(v) for v in rng.integers(0, h, 2))
            color = tuple(int(c) for c in rng.integers(0, 256, 3))
            (draw.rectangle if rng.random() < 0.5 else draw.ellipse)([x0, y0, x1, y1], fill=color)
        draw.text((w // 10, h // 3), f"picture {i}", fill=(255, 255, 255))
        out.append(img)
    return out


class _Reference:
    """The user's library on the export's source checkpoint."""

    def __init__(self, manifest: Manifest, model: Any = None) -> None:
        from transformers import AutoImageProcessor

        from ..vision import VisionCheckpoint, load_torch_model

        src = manifest.source
        self.vision = manifest.extra["vision"]
        self.task = str(src["task"])
        if model is None:
            from transformers import AutoConfig

            ckpt = VisionCheckpoint(
                str(src["model"]), str(src["model_type"]), self.task, AutoConfig.from_pretrained(src["model"])
            )
            model = load_torch_model(ckpt)
        self.model = model.eval()
        self.processor = AutoImageProcessor.from_pretrained(str(src["model"]), use_fast=False)
        self.st: Any = None
        self.by = "transformers"
        st_root = src.get("embedding_checkpoint")
        if st_root:
            try:
                from sentence_transformers import SentenceTransformer
            except ImportError:
                self.st = None
            else:
                self.st = SentenceTransformer(str(st_root), device="cpu")
                self.by = "SentenceTransformer.encode"

    def pixels(self, images: Sequence[Any]) -> np.ndarray:
        return np.asarray(self.processor(list(images), return_tensors="np")["pixel_values"], dtype=np.float32)

    def run_pixels(self, pixels: np.ndarray) -> dict[str, np.ndarray]:
        import torch

        x = torch.from_numpy(np.ascontiguousarray(pixels))
        with torch.inference_mode():
            if self.task == "zero-shot-image-classification":
                out = self.model.get_image_features(pixel_values=x)
                out = out if isinstance(out, torch.Tensor) else out.pooler_output
                return {"image_embeds": out.float().numpy()}
            res = self.model(pixel_values=x)
        if self.task == "image-classification":
            return {"logits": res.logits.float().numpy()}
        found = {"last_hidden_state": res.last_hidden_state.float().numpy()}
        if getattr(res, "pooler_output", None) is not None:
            found["pooler_output"] = res.pooler_output.float().numpy()
        return found

    def images(self, images: Sequence[Any]) -> dict[str, np.ndarray]:
        """The whole of the user's path: its processor and model (or encode)."""
        if self.st is not None:
            return {"image_embeds": np.asarray(self.st.encode(list(images), convert_to_numpy=True))}
        return self.run_pixels(self.pixels(images))

    def run_text(self, feed: Mapping[str, np.ndarray]) -> np.ndarray:
        import torch

        args = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in feed.items()}
        with torch.inference_mode():
            out = self.model.get_text_features(**args)
        out = out if isinstance(out, torch.Tensor) else out.pooler_output
        return np.asarray(out.float().numpy())

    def texts(self, texts: Sequence[str], tokenizer: Any) -> np.ndarray:
        if self.st is not None:
            return np.asarray(self.st.encode(list(texts), convert_to_numpy=True))
        t = self.vision["towers"]["text"]
        if t["pad_to"]:
            enc = tokenizer(
                list(texts), padding="max_length", max_length=t["pad_to"], truncation=True, return_tensors="np"
            )
            return self.run_text({"input_ids": enc["input_ids"].astype(np.int64)})
        enc = tokenizer(list(texts), padding=True, truncation=True, max_length=t["max_length"], return_tensors="np")
        return self.run_text(
            {"input_ids": enc["input_ids"].astype(np.int64), "attention_mask": enc["attention_mask"].astype(np.int64)}
        )


class _Ours:
    """ortbatch's path on one provider: its decoding, processor, tokenizer and the graphs."""

    def __init__(self, manifest: Manifest, sessions: dict[str, Any], tokenizer: Any) -> None:
        from ...vision.processor import ImageProcessor

        self.vision = manifest.extra["vision"]
        self.processor = ImageProcessor.from_dict(self.vision["processor"])
        self.sessions = sessions
        self.tokenizer = tokenizer
        self.two_towers = "towers" in self.vision
        self.image_comp = "image" if self.two_towers else "model"
        if self.two_towers:
            from ...vision.text import TextTower

            self.tower = TextTower(manifest.directory or ".", self.vision["towers"]["text"])

    def run(self, comp: str, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        sess = self.sessions[comp]
        outs = sess.run(None, {i.name: feed[i.name] for i in sess.get_inputs()})
        return {o.name: v for o, v in zip(sess.get_outputs(), outs, strict=True)}

    def pixels(self, images: Sequence[Any]) -> np.ndarray:
        from ...vision.images import load_image

        return self.processor([load_image(im) for im in images])

    def images(self, images: Sequence[Any]) -> dict[str, np.ndarray]:
        out = self.run(self.image_comp, {"pixel_values": self.pixels(images)})
        return self._finish(out)

    def _finish(self, out: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self.vision.get("normalize"):
            from ...vision.embedder import normalize

            return {k: normalize(v) for k, v in out.items()}
        return out

    def text_rows(self, texts: Sequence[str]) -> list[list[int]]:
        """The samples tokenized as the export serves them: its tokenizer.json (the
        checkpoint's own tokenizer when it has no fast version, which ortbatch cannot serve)."""
        if (self.tower.directory / "tokenizer.json").is_file():
            return self.tower.ids(texts)
        enc = self.tokenizer(list(texts), truncation=True, max_length=self.tower.max_length)
        return [list(r) for r in enc["input_ids"]]

    def text_feed(self, rows: Sequence[Sequence[int]]) -> dict[str, np.ndarray]:
        return self.tower.feed(rows)

    def texts(self, rows: Sequence[Sequence[int]]) -> np.ndarray:
        return self._finish(self.run("text", self.text_feed(rows)))["text_embeds"]


def _case(label: str, fn: Callable[[Case], None]) -> Case:
    case = Case(label)
    try:
        fn(case)
    except Exception as exc:  # a failing run is the finding, recorded per case
        text = str(exc).strip()
        case.error = f"{type(exc).__name__}: {shorten(text.splitlines()[0] if text else '', 300)}"
    return case


def _compare_all(
    case: Case, got: Mapping[str, np.ndarray], want: Mapping[str, np.ndarray], tol: Mapping[str, float]
) -> None:
    for name, value in got.items():
        if name not in want:
            case.comparisons.append(
                Comparison(name, list(value.shape), True, message="not compared: no such reference output")
            )
            continue
        case.comparisons.append(compare(name, value, want[name], tol))


def _sizes(pictures: Sequence[Any]) -> str:
    return ", ".join(f"{p.width}x{p.height}" for p in pictures)


def _reference_parity(
    ours: _Ours, ref: _Reference, tol: Mapping[str, float], pictures: list[Any], texts: list[str]
) -> list[Case]:
    cases = [
        _case(
            f"{len(pictures)} pictures ({_sizes(pictures)}) vs {ref.by}, batched",
            lambda case: _compare_all(case, ours.images(pictures), ref.images(pictures), tol),
        )
    ]

    def pixel_values(case: Case) -> None:
        got, want = ours.pixels(pictures), ref.pixels(pictures)
        worst = float(np.abs(got.astype(np.float64) - want).max()) if got.shape == want.shape else float("inf")
        case.comparisons.append(
            Comparison(
                "pixel_values",
                list(got.shape),
                passed=worst <= 1e-5,
                max_abs_err=worst,
                message="" if worst <= 1e-5 else f"ortbatch's preprocessing differs from transformers' by {worst:.3g}",
            )
        )

    cases.append(_case("pixel values vs transformers' image processor", pixel_values))
    if ours.two_towers:

        def run_texts(case: Case) -> None:
            got = ours.texts(ours.text_rows(texts))
            want = ref.texts(texts, ours.tokenizer)
            case.comparisons.append(compare("text_embeds", got, want, tol))

        cases.append(_case(f"{len(texts)} texts vs {ref.by}, batched", run_texts))
    return cases


def _shape_generalisation(
    ours: _Ours, ref: _Reference | None, tol: Mapping[str, float], rng: np.random.Generator
) -> list[Case]:
    h, w = ours.processor.fixed_size or (224, 224)
    cases = []
    for batch in (1, 3, 8):
        pixels = rng.standard_normal((batch, 3, h, w)).astype(np.float32)

        def run(case: Case, pixels: np.ndarray = pixels) -> None:
            got = ours.run(ours.image_comp, {"pixel_values": pixels})
            if ref is not None:
                want = ref.run_pixels(pixels)
            else:
                singles = [ours.run(ours.image_comp, {"pixel_values": pixels[i : i + 1]}) for i in range(len(pixels))]
                want = {k: np.concatenate([s[k] for s in singles]) for k in got}
            for name, value in got.items():
                if value.shape[0] != len(pixels):
                    case.comparisons.append(Comparison(name, list(value.shape), False, message="batch axis lost"))
            _compare_all(case, got, want, tol)

        cases.append(_case(f"pixel_values batch={batch} {h}x{w}", run))
    if ours.two_towers:
        t = ours.vision["towers"]["text"]
        vocab = min(len(ours.tokenizer), int(t.get("vocab_size") or len(ours.tokenizer)))
        for batch, length in ((1, 2), (3, 9), (2, int(t["max_length"]))):
            ids = rng.integers(min(5, vocab - 1), vocab, size=(batch, min(length, int(t["max_length"])))).astype(
                np.int64
            )

            def run_text(case: Case, ids: np.ndarray = ids) -> None:
                feed = ours.text_feed([list(r) for r in ids])
                got = ours.run("text", feed)["text_embeds"]
                if ref is not None:
                    want = ref.run_text(feed)
                else:
                    want = np.concatenate([ours.run("text", ours.text_feed([list(r)]))["text_embeds"] for r in ids])
                case.comparisons.append(compare("text_embeds", got, want, tol))

            cases.append(_case(f"text batch={batch} len={ids.shape[1]}", run_text))
    return cases


def _batching_invariance(ours: _Ours, tol: Mapping[str, float], pictures: list[Any], texts: list[str]) -> list[Case]:
    def run(case: Case) -> None:
        batched = ours.images(pictures)
        alone = [ours.images([p]) for p in pictures]
        for name, value in batched.items():
            want = np.concatenate([a[name] for a in alone])
            comp = compare(name, value, want, tol, metric=None)
            if not comp.passed:
                comp.message = f"changes in a batch of {len(pictures)}: {comp.message}"
            case.comparisons.append(comp)

    cases = [_case(f"{len(pictures)} pictures alone vs batched", run)]
    if ours.two_towers:

        def run_texts(case: Case) -> None:
            rows = ours.text_rows(texts)
            batched = ours.texts(rows)
            alone = np.concatenate([ours.texts([r]) for r in rows])
            comp = compare("text_embeds", batched, alone, tol, metric=None)
            if not comp.passed:
                comp.message = f"changes when padded into a batch of {len(rows)}: {comp.message}"
            case.comparisons.append(comp)

        cases.append(_case(f"{len(texts)} texts alone vs batched (right padding)", run_texts))
    return cases


def _provider_parity(
    ours: _Ours, cpu: _Ours, tol: Mapping[str, float], pictures: list[Any], texts: list[str]
) -> list[Case]:
    def run(case: Case) -> None:
        _compare_all(case, ours.images(pictures), cpu.images(pictures), tol)
        if ours.two_towers:
            rows = ours.text_rows(texts)
            case.comparisons.append(compare("text_embeds", ours.texts(rows), cpu.texts(rows), tol))

    return [_case(f"{len(pictures)} pictures vs CPU", run)]


def _tokenizer(manifest: Manifest) -> Any:
    if "towers" not in manifest.extra["vision"]:
        return None
    from transformers import AutoTokenizer

    from ...errors import ModelIntegrityError

    try:
        return AutoTokenizer.from_pretrained(os.fspath(manifest.directory or "."))
    except Exception as exc:
        raise ModelIntegrityError(
            f"{manifest.directory}: the export's tokenizer does not load ({type(exc).__name__}: {exc}); the text "
            "tower's checks tokenize their samples with it. Re-export it",
            path=manifest.directory,
        ) from exc


def validate_vision(
    directory: str | os.PathLike[str],
    providers: Sequence[str] | str | None = None,
    *,
    samples: Sequence[str] | None = None,
    reference: Any = None,
    use_reference: bool = True,
    tolerances: Mapping[str, float] | None = None,
    save: bool = True,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> ValidationReport:
    """:func:`ortbatch.validate` for an image export (the same arguments and report)."""
    say = progress or (lambda msg: None)
    t0 = time.perf_counter()
    manifest = Manifest.load(directory).verify(warn=False)
    assert manifest.directory is not None
    wanted = providers if providers is not None else (manifest.validation.get("providers") or [CPU])
    names = list(dict.fromkeys([CPU, *parse_provider_names(wanted)]))
    dtype = str(manifest.source.get("dtype", "fp32"))
    quantization = manifest.source.get("quantization")
    variant = str(quantization.get("mode", "int8")) if isinstance(quantization, dict) else None
    stored = manifest.validation.get("tolerances") or (
        tolerances_for("int8", None, None, "feature-extraction") if variant else tolerances_for(dtype)
    )
    base_tol = {**stored, **(tolerances or {})}
    fp16_tol = {**(manifest.validation.get("tolerances_fp16") or tolerances_for("fp16")), **(tolerances or {})}
    texts = list(samples or manifest.validation.get("samples") or DEFAULT_SAMPLES)
    tokenizer = _tokenizer(manifest)
    pictures = sample_pictures(seed)
    ref: _Reference | None = None
    reason = "not requested (--no-reference / use_reference=False)"
    if use_reference:
        say("loading the PyTorch reference")
        try:
            ref = _Reference(manifest, reference)
            reason = ""
        except Exception as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            ref, reason = None, f"could not load {manifest.source.get('model')} ({type(exc).__name__}: {first[:300]})"
    report = ValidationReport(
        directory=os.fspath(manifest.directory),
        task=str(manifest.source.get("task", "")),
        dtype=dtype,
        providers=names,
        reference={"available": ref is not None, "reason": reason},
        tolerances=dict(base_tol),
        variant=variant,
    )
    cpu: _Ours | None = None
    rng = np.random.default_rng(seed)
    for provider in names:
        absent = not_here(provider)
        if absent is not None:
            report.checks += [CheckResult(n, provider, NOT_RUN, note=f"not run: {absent}") for n in CHECKS[:4]]
            continue
        sessions, why, opts = open_sessions(manifest, provider, dtype)
        if sessions is None:
            report.checks.append(CheckResult("provider_parity", provider, "failed", note=why))
            continue
        ours = _Ours(manifest, sessions, tokenizer)
        tol = parity_tolerances(arithmetic(provider, opts, dtype), base_tol, fp16_tol)
        if variant is not None:  # random pixels are far from pictures: int8 has its own floors there
            shape_tol = {
                **tol,
                "cosine": tol.get("random_cosine", tol["cosine"]),
                "argmax": tol.get("random_argmax", tol["argmax"]),
            }
        else:
            shape_tol = tol
        short = provider.replace("ExecutionProvider", "")
        if ref is not None:
            say(f"[{short}] reference parity")
            cases = _reference_parity(ours, ref, tol, pictures, texts)
            report.checks.append(CheckResult("reference_parity", provider, status_of(cases), cases))
        else:
            report.checks.append(
                CheckResult("reference_parity", provider, "skipped", note=f"no PyTorch reference: {reason}")
            )
        say(f"[{short}] shape generalisation")
        cases = _shape_generalisation(ours, ref, shape_tol, rng)
        report.checks.append(CheckResult("shape_generalisation", provider, status_of(cases), cases))
        say(f"[{short}] batching invariance")
        cases = _batching_invariance(ours, tol, pictures, texts)
        report.checks.append(CheckResult("batching_invariance", provider, status_of(cases), cases))
        if provider == CPU:
            cpu = ours
        elif cpu is not None:
            say(f"[{short}] provider parity")
            cases = _provider_parity(ours, cpu, tol, pictures, texts)
            report.checks.append(CheckResult("provider_parity", provider, status_of(cases), cases))
    say("finite weights")
    report.checks.append(finite_weights(manifest))
    report.seconds = time.perf_counter() - t0
    if save:
        report.save(Path(manifest.directory) / "validation.json")
        manifest.validation = {
            **manifest.validation,
            "passed": report.passed,
            "report": "validation.json",
            "not_run": report.not_run(),
            "reference_parity": "ran" if ref is not None else "skipped",
        }
        manifest.save()
    return report
