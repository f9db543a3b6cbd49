"""Image checkpoints -> ONNX: classifiers, image backbones, and CLIP / SigLIP as two towers.

What is exported, each through torch.onnx (the TorchScript exporter, as optimum-onnx runs it)
on a small wrapper module, with a dynamic batch axis and the image size the checkpoint's image
processor produces:

* ``image-classification`` (ViT, DeiT, BEiT, ConvNeXt, Swin, DINOv2 with a head):
  ``pixel_values -> logits`` in ``model.onnx``; the label names stay in ``config.json``.
* ``image-feature-extraction`` (DINOv2, ViT and the others without a head):
  ``pixel_values -> last_hidden_state, pooler_output`` in ``model.onnx``.
* ``zero-shot-image-classification`` (CLIP, SigLIP; also the sentence-transformers CLIP layout,
  a ``modules.json`` whose module is a ``CLIPModel``): **two graphs**, so a request carries only
  what it embeds (optimum's one CLIP graph needs images and texts at once):
  ``image_model.onnx``: ``pixel_values -> image_embeds`` (``get_image_features``: the vision
  tower through its projection) and ``text_model.onnx``: ``input_ids[, attention_mask] ->
  text_embeds`` (``get_text_features``, through the text projection). SigLIP's text tower pools
  its last position and was trained on texts padded to ``max_length``: its graph takes
  ``input_ids`` of that fixed length and no mask (ortbatch pads every text there).

``ortbatch.json`` says which tower is which (``components.image`` / ``components.text``, and the
``vision`` section: each tower's file, inputs and output, the text length and padding), and what
the preprocessing is (``vision.processor``: :class:`ortbatch.vision.ImageProcessor`'s values),
so the runtime needs neither torch nor transformers.
"""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._ort.providers import CPU
from ..errors import ExportError, OrtBatchError, UnsupportedError, UnsupportedModelError

__all__ = [
    "TWO_TOWER_TYPES",
    "VISION_KEY",
    "VISION_MODEL_TYPES",
    "VISION_TASKS",
    "VisionCheckpoint",
    "build_vision",
    "detect",
    "is_vision_export",
    "load_torch_model",
]

Progress = Callable[[str], None]

VISION_TASKS = ("image-classification", "image-feature-extraction", "zero-shot-image-classification")
TWO_TOWER_TYPES = ("clip", "siglip")
VISION_MODEL_TYPES = (*TWO_TOWER_TYPES, "vit", "deit", "beit", "convnext", "swin", "dinov2")
#: the manifest's section for images
VISION_KEY = "vision"
_TASK_SYNONYMS = {
    "feature-extraction": None,  # the two towers for CLIP/SigLIP, the backbone otherwise
    "image-feature-extraction": "image-feature-extraction",
    "image-classification": "image-classification",
    "zero-shot-image-classification": "zero-shot-image-classification",
}


@dataclass(frozen=True)
class VisionCheckpoint:
    """A checkpoint the image exporter takes: where transformers loads it from, the
    sentence-transformers root around it (if any), its type and the task."""

    model: str  # the transformers checkpoint's folder (or hub id)
    model_type: str
    task: str
    config: Any
    st_root: str | None = None
    normalize: bool = False  # a sentence-transformers Normalize module follows the CLIPModel

    @property
    def two_towers(self) -> bool:
        return self.task == "zero-shot-image-classification"


def _st_clip(root: Path) -> tuple[Path, bool] | None:
    """(the CLIP folder, whether a Normalize module follows) for a sentence-transformers
    checkpoint whose first module is a CLIPModel, else None."""
    try:
        modules = json.loads((root / "modules.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(modules, list) or not modules or not isinstance(modules[0], dict):
        return None
    kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules if isinstance(m, dict)]
    first = kinds[0]
    folder = root / str(modules[0].get("path") or "")
    if first == "Transformer":
        try:  # sentence-transformers 5.4+ saves CLIP as a multimodal Transformer
            model_type = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("model_type")
        except (OSError, ValueError):
            return None
        if model_type not in TWO_TOWER_TYPES:
            return None
    elif first != "CLIPModel":
        return None
    unknown = [k for k in kinds[1:] if k != "Normalize"]
    if unknown:
        raise UnsupportedModelError(
            f"{root}/modules.json: a CLIP checkpoint followed by {unknown}: ortbatch exports CLIPModel "
            "(optionally followed by Normalize)"
        )
    return folder, "Normalize" in kinds[1:]


def detect(model_ref: str, task: str = "auto", *, trust_remote_code: bool = False) -> VisionCheckpoint | None:
    """The image checkpoint ``model_ref`` is, or None when it is not one (a text model:
    the text exporter takes it). A vision checkpoint asked for a text task, or a task its
    architecture lacks, is :class:`UnsupportedModelError` naming the tasks it has."""
    root = Path(model_ref)
    st_root = None
    normalize = False
    if not root.is_dir():
        config = _config(model_ref, trust_remote_code)
        if config is None or str(getattr(config, "model_type", "")).replace("_", "-") not in VISION_MODEL_TYPES:
            if task in VISION_TASKS:
                _refuse_text_model(model_ref, task, config)
            return None
        # a hub id of an image checkpoint: its files (preprocessor_config.json, modules.json) are read locally
        return detect(_snapshot(model_ref), task, trust_remote_code=trust_remote_code)
    if (root / "modules.json").is_file():
        found = _st_clip(root)
        if found is None:
            return None
        st_root, (folder, normalize) = str(root), found
        model_ref = str(folder)
    config = _config(model_ref, trust_remote_code)
    if config is None:
        return None
    model_type = str(getattr(config, "model_type", "")).replace("_", "-")
    if model_type not in VISION_MODEL_TYPES:
        if task in VISION_TASKS:
            raise UnsupportedModelError(
                f"task {task!r} is for image checkpoints ({', '.join(VISION_MODEL_TYPES)}); "
                f"{model_ref} is a {model_type!r} model"
            )
        return None
    has_head = any(str(a).endswith("ForImageClassification") for a in (config.architectures or []))
    tasks: tuple[str, ...]
    if model_type in TWO_TOWER_TYPES:
        tasks = ("zero-shot-image-classification",)
    else:
        tasks = ("image-classification", "image-feature-extraction") if has_head else ("image-feature-extraction",)
    if task == "auto":
        chosen = tasks[0]
    elif task in _TASK_SYNONYMS:
        chosen = _TASK_SYNONYMS[task] or tasks[-1]
    else:
        raise UnsupportedModelError(
            f"{model_ref} is an image checkpoint ({model_type}); task {task!r} is not one of its tasks: "
            f"{', '.join(tasks)}"
        )
    if chosen not in tasks:
        raise UnsupportedModelError(
            f"{model_ref} ({model_type}) cannot be exported for {chosen!r}; its tasks: {', '.join(tasks)}"
            + ("" if has_head or chosen != "image-classification" else " (the checkpoint has no classification head)")
        )
    return VisionCheckpoint(model_ref, model_type, chosen, config, st_root, normalize)


def _refuse_text_model(model_ref: str, task: str, config: Any) -> None:
    """A vision task asked of a checkpoint that is not an image one: refused by name."""
    kind = str(getattr(config, "model_type", "unknown")) if config is not None else "unreadable"
    raise UnsupportedModelError(
        f"task {task!r} is for image checkpoints ({', '.join(VISION_MODEL_TYPES)}); {model_ref} is a {kind!r} model"
    )


def _snapshot(model_ref: str) -> str:
    try:
        from huggingface_hub import snapshot_download

        return str(snapshot_download(model_ref))
    except Exception as exc:
        raise ExportError(f"cannot fetch {model_ref}'s files: {type(exc).__name__}: {exc}") from exc


def _config(model_ref: str, trust_remote_code: bool) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model_ref, trust_remote_code=trust_remote_code)
    except Exception:  # not a checkpoint transformers reads: the text path says why
        return None


# -- the wrappers ------------------------------------------------------------------------------


def _wrappers() -> dict[str, type]:
    import torch

    def tensor(out: Any) -> Any:
        return out if isinstance(out, torch.Tensor) else out.pooler_output

    class ImageTower(torch.nn.Module):
        def __init__(self, model: Any) -> None:
            super().__init__()
            self.model = model

        def forward(self, pixel_values: Any) -> Any:
            return tensor(self.model.get_image_features(pixel_values=pixel_values))

    class TextTower(torch.nn.Module):
        def __init__(self, model: Any) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids: Any, attention_mask: Any) -> Any:
            return tensor(self.model.get_text_features(input_ids=input_ids, attention_mask=attention_mask))

    class TextTowerUnmasked(torch.nn.Module):  # SigLIP: fixed length, no mask, as it was trained
        def __init__(self, model: Any) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids: Any) -> Any:
            return tensor(self.model.get_text_features(input_ids=input_ids))

    class Classifier(torch.nn.Module):
        def __init__(self, model: Any) -> None:
            super().__init__()
            self.model = model

        def forward(self, pixel_values: Any) -> Any:
            return self.model(pixel_values=pixel_values).logits

    class Backbone(torch.nn.Module):
        def __init__(self, model: Any) -> None:
            super().__init__()
            self.model = model

        def forward(self, pixel_values: Any) -> Any:
            out = self.model(pixel_values=pixel_values)
            pooled = getattr(out, "pooler_output", None)
            if pooled is None:
                return (out.last_hidden_state,)
            return out.last_hidden_state, pooled

    return {
        "image": ImageTower,
        "text": TextTower,
        "text_unmasked": TextTowerUnmasked,
        "classifier": Classifier,
        "backbone": Backbone,
    }


def load_torch_model(ckpt: VisionCheckpoint, trust_remote_code: bool = False) -> Any:
    """The PyTorch model the export is made from (and checked against)."""
    import transformers

    cls = {
        "image-classification": transformers.AutoModelForImageClassification,
        "image-feature-extraction": transformers.AutoModel,
        "zero-shot-image-classification": transformers.AutoModel,
    }[ckpt.task]
    try:
        model = cls.from_pretrained(ckpt.model, trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise ExportError(f"could not load {ckpt.model} for {ckpt.task}: {type(exc).__name__}: {exc}") from exc
    return model.eval()


def _torch_export(
    module: Any,
    args: tuple[Any, ...],
    path: Path,
    inputs: list[str],
    outputs: list[str],
    axes: dict[str, dict[int, str]],
    opset: int,
) -> None:
    import torch

    try:
        with torch.inference_mode(), warnings.catch_warnings():
            # chosen on purpose (as optimum-onnx does): the dynamo exporter needs onnxscript
            warnings.filterwarnings("ignore", "You are using the legacy TorchScript", DeprecationWarning)
            torch.onnx.export(
                module,
                args,
                str(path),
                input_names=inputs,
                output_names=outputs,
                dynamic_axes=axes,
                opset_version=opset,
                do_constant_folding=True,
                dynamo=False,  # the TorchScript exporter, as optimum-onnx uses
            )
    except OrtBatchError:
        raise
    except Exception as exc:
        raise ExportError(f"torch.onnx could not export {path.name}: {type(exc).__name__}: {exc}") from exc


def _processor(ckpt: VisionCheckpoint) -> Any:
    from ..vision.processor import ImageProcessor

    try:
        proc = ImageProcessor.from_pretrained(ckpt.model)
    except UnsupportedError as exc:
        raise UnsupportedModelError(str(exc)) from None
    except OrtBatchError as exc:
        raise ExportError(f"{ckpt.model}: the image processor: {exc}") from None
    if proc.fixed_size is None:
        raise UnsupportedModelError(
            f"{ckpt.model}: the image processor ({proc.describe()}) gives images of different sizes; ortbatch "
            "batches images of one size (a processor that crops or resizes to a fixed size)"
        )
    return proc


def _refuse_random_head(ckpt: VisionCheckpoint, model: Any) -> None:
    """A classifier whose checkpoint lacks the head's weights would answer transformers' random
    initialisation (the checks would pass against that same random model): refused."""
    folder = Path(ckpt.model)
    single = folder / "model.safetensors"
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = set(json.loads(index.read_text(encoding="utf-8")).get("weight_map") or {})
    elif single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), framework="np") as f:
            names = set(f.keys())
    else:
        return
    prefix = getattr(model, "base_model_prefix", "")
    head = [k for k in model.state_dict() if prefix and not k.startswith(prefix + ".")]
    missing = [k for k in head if k not in names]
    if missing:
        raise ExportError(
            f"{ckpt.model} has no weights for the image-classification head ({', '.join(missing[:4])}): transformers "
            "would initialize it at random; export a checkpoint trained for image-classification"
        )


def _text_settings(ckpt: VisionCheckpoint, tokenizer: Any) -> dict[str, Any]:
    text_cfg = ckpt.config.text_config
    positions = int(getattr(text_cfg, "max_position_embeddings", 77))
    tok_max = getattr(tokenizer, "model_max_length", None)
    limit = min(positions, tok_max) if isinstance(tok_max, int) and 0 < tok_max < 1_000_000 else positions
    pad = tokenizer.pad_token_id
    if pad is None:
        pad = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    if ckpt.model_type == "siglip":
        # pooled at the last position and trained on max_length padding: every text padded there
        return {"max_length": positions, "pad_to": positions, "pad_id": int(pad), "mask": False}
    return {"max_length": limit, "pad_to": None, "pad_id": int(pad), "mask": True}


def build_vision(
    out: Path,
    ckpt: VisionCheckpoint,
    rcp: Any,
    say: Progress,
    *,
    trust_remote_code: bool = False,
) -> Any:
    """Export ``ckpt`` into the fresh directory ``out`` and write its manifest; returns the
    PyTorch model (the checks' reference)."""
    import torch

    from ..manifest import Manifest, model_hash
    from . import graph

    if rcp.optimize is not None:
        raise ExportError(
            f"--optimize {rcp.optimize} is not available for image exports yet (optimum's ORT optimizer fuses "
            "text transformers); export without it"
        )
    if rcp.trt:
        raise ExportError("--trt is not available for image exports yet; export without it")
    if rcp.quantize is not None and rcp.quantize.mode != "int8":
        raise ExportError(
            f"--quantize {rcp.quantize.mode}: image exports take dynamic int8 only (static calibration reads texts)"
        )
    proc = _processor(ckpt)
    say(f"image processor: {proc.describe()}")
    model = load_torch_model(ckpt, trust_remote_code)
    if ckpt.task == "image-classification":
        _refuse_random_head(ckpt, model)
    height, width = proc.fixed_size
    wrappers = _wrappers()
    pixels = torch.zeros((2, 3, height, width), dtype=torch.float32)
    pixel_axes = {"pixel_values": {0: "batch_size"}}
    files: dict[str, str] = {}
    vision: dict[str, Any] = {"kind": ckpt.task, "model_type": ckpt.model_type, "processor": proc.to_dict()}
    tokenizer = None
    if ckpt.two_towers:
        from transformers import AutoTokenizer

        say(f"exporting {ckpt.model_type}'s image tower (pixel_values -> image_embeds)")
        _torch_export(
            wrappers["image"](model),
            (pixels,),
            out / "image_model.onnx",
            ["pixel_values"],
            ["image_embeds"],
            {**pixel_axes, "image_embeds": {0: "batch_size"}},
            rcp.opset,
        )
        try:
            tokenizer = AutoTokenizer.from_pretrained(ckpt.model, trust_remote_code=trust_remote_code)
        except Exception as exc:
            raise ExportError(f"could not load {ckpt.model}'s tokenizer for the text tower: {exc}") from exc
        if not getattr(tokenizer, "is_fast", False):
            say(
                f"the tokenizer ({type(tokenizer).__name__}) has no fast version: the text tower is exported and "
                "checked, but ortbatch serves texts only with a tokenizer.json"
            )
        text = _text_settings(ckpt, tokenizer)
        say(f"exporting {ckpt.model_type}'s text tower (input_ids -> text_embeds)")
        if text["mask"]:
            ids = torch.full((2, 7), text["pad_id"], dtype=torch.int64)
            _torch_export(
                wrappers["text"](model),
                (ids, torch.ones_like(ids)),
                out / "text_model.onnx",
                ["input_ids", "attention_mask"],
                ["text_embeds"],
                {
                    "input_ids": {0: "batch_size", 1: "sequence_length"},
                    "attention_mask": {0: "batch_size", 1: "sequence_length"},
                    "text_embeds": {0: "batch_size"},
                },
                rcp.opset,
            )
        else:
            ids = torch.full((2, text["pad_to"]), text["pad_id"], dtype=torch.int64)
            _torch_export(
                wrappers["text_unmasked"](model),
                (ids,),
                out / "text_model.onnx",
                ["input_ids"],
                ["text_embeds"],
                {"input_ids": {0: "batch_size"}, "text_embeds": {0: "batch_size"}},
                rcp.opset,
            )
        files = {"image": "image_model.onnx", "text": "text_model.onnx"}
        with torch.inference_mode():
            dimension = int(wrappers["image"](model)(pixels[:1]).shape[-1])
        scale = float(model.logit_scale.detach().exp().item())
        bias = getattr(model, "logit_bias", None)
        vision.update(
            towers={
                "image": {"model": "image_model.onnx", "inputs": ["pixel_values"], "output": "image_embeds"},
                "text": {
                    "model": "text_model.onnx",
                    "inputs": ["input_ids", "attention_mask"] if text["mask"] else ["input_ids"],
                    "output": "text_embeds",
                    "vocab_size": int(ckpt.config.text_config.vocab_size),
                    **text,
                },
            },
            dimension=dimension,
            normalize=ckpt.normalize,
            # zero-shot classification: logits = scale * cosine (+ bias); CLIP softmax, SigLIP sigmoid
            logit_scale=scale,
            logit_bias=float(bias.detach().item()) if bias is not None else None,
            activation="sigmoid" if ckpt.model_type == "siglip" else "softmax",
        )
        tokenizer.save_pretrained(out)
    elif ckpt.task == "image-classification":
        say(f"exporting {ckpt.model_type} for image-classification (pixel_values -> logits)")
        _torch_export(
            wrappers["classifier"](model),
            (pixels,),
            out / "model.onnx",
            ["pixel_values"],
            ["logits"],
            {**pixel_axes, "logits": {0: "batch_size"}},
            rcp.opset,
        )
        files = {"model": "model.onnx"}
        id2label = getattr(ckpt.config, "id2label", None) or {}
        vision["labels"] = {str(k): str(v) for k, v in id2label.items()}
    else:
        say(f"exporting {ckpt.model_type} for image-feature-extraction (pixel_values -> hidden states)")
        with torch.inference_mode():
            has_pool = getattr(model(pixel_values=pixels[:1]), "pooler_output", None) is not None
        names = ["last_hidden_state", "pooler_output"] if has_pool else ["last_hidden_state"]
        _torch_export(
            wrappers["backbone"](model),
            (pixels,),
            out / "model.onnx",
            ["pixel_values"],
            names,
            {**pixel_axes, **{n: {0: "batch_size"} for n in names}},
            rcp.opset,
        )
        files = {"model": "model.onnx"}
        vision["embedding_output"] = "pooler_output" if has_pool else "last_hidden_state"
    for name in files.values():
        if rcp.dtype == "fp16":
            say(f"converting {name} to fp16")
            _to_fp16(out / name)
    quantized = None
    if rcp.quantize is not None:
        from .quantize import quantize_model

        say(f"quantizing ({rcp.quantize.label}) with onnxruntime.quantization")
        for name in files.values():
            quantized = quantize_model(out / name, rcp.quantize)
    ckpt.config.save_pretrained(out)
    shutil.copy2(Path(ckpt.model) / "preprocessor_config.json", out / "preprocessor_config.json")

    components: dict[str, Any] = {}
    for comp, name in files.items():
        io = graph.read_graph_io(out / name)
        inputs, outputs, shapes = graph.manifest_io(
            io, {"input_ids": vision.get("towers", {}).get("text", {}).get("pad_id", 0)}
        )
        components[comp] = {
            "model": name,
            "opset": io.opset,
            "inputs": {k: v.to_dict() for k, v in inputs.items()},
            "outputs": {k: v.to_dict() for k, v in outputs.items()},
            "shapes": shapes,
            "sha256": model_hash(out / name),
        }
    main = "image" if ckpt.two_towers else "model"
    from ..vision.embedder import section_digest

    # the preprocessing and towers checked with this graph: the faces refuse an edited section
    components[main]["vision"] = section_digest(vision)
    main_io = graph.manifest_io(graph.read_graph_io(out / files[main]), {})
    from .recipes import tolerances_for

    tol = (
        tolerances_for("int8", None, rcp.tolerances, "feature-extraction")
        if quantized is not None
        else tolerances_for(rcp.dtype, None, rcp.tolerances)
    )
    source: dict[str, Any] = {
        "model": ckpt.model,
        "model_ref": rcp.model,
        "task": ckpt.task,
        "family": "vision",
        "library": "sentence_transformers" if ckpt.st_root else "transformers",
        "model_type": ckpt.model_type,
        "dtype": rcp.dtype,
        "optimize": None,
        "opset": components[main]["opset"],
        "device": rcp.device,
        "versions": _versions(),
        "recipe": rcp.path,
    }
    if ckpt.st_root:
        source["embedding_checkpoint"] = ckpt.st_root
    if quantized is not None:
        source["quantization"] = quantized
    limits: dict[str, int] = {"max_batch_size": rcp.max_batch_size}
    if ckpt.two_towers:
        limits["max_sequence_length"] = int(vision["towers"]["text"]["max_length"])
    manifest = Manifest(
        model=files[main],
        inputs=main_io[0],
        outputs=main_io[1],
        padding_side="right",
        limits=limits,
        providers=[[CPU, {}]],
        source=source,
        validation={
            "passed": None,
            "report": "validation.json",
            "samples": list(rcp.samples),
            "tolerances": tol,
            "tolerances_fp16": tolerances_for("fp16", None, rcp.tolerances),
            "providers": list(rcp.providers) or [CPU],
        },
        extra={"components": components, VISION_KEY: vision},
    )
    manifest.save(out)
    return model


def _to_fp16(path: Path) -> None:
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    from .graph import save_onnx

    model = onnx.load(str(path))
    # inputs and outputs stay fp32/int64, as the text exports keep them: the casts sit at the edges
    save_onnx(convert_float_to_float16(model, keep_io_types=True), path)


def _versions() -> dict[str, str]:
    import importlib.metadata

    out = {}
    for dist in ("ortbatch", "torch", "transformers", "onnx", "onnxruntime", "pillow", "sentence-transformers"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


def is_vision_export(manifest: Any) -> bool:
    """Whether an export's manifest is an image export's."""
    return str(manifest.source.get("family", "")) == "vision" and VISION_KEY in manifest.extra
