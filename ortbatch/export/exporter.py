"""Hugging Face model -> ONNX export directory that BatchedSession can serve.

The conversion is optimum-onnx's (no per-architecture configs here). Around it,
:func:`export_model`:

1. resolves the task and refuses what ortbatch cannot check or serve;
2. exports with optimum-onnx, optionally optimises with its ORT optimizer
   (O1-O3 on CPU; O4 is O3 + fp16 and needs ``device="cuda"``) and converts to fp16
   with onnxruntime's float16 converter (inputs/outputs stay int64/fp32);
3. writes ``ortbatch.json``: inputs (dtype, axes, pad values from the tokenizer),
   outputs, padding side, limits, providers (TensorRT profile and caches with
   ``trt=True``), source and versions;
4. runs the built-in checks (:func:`ortbatch.validate`) against the PyTorch model
   and writes ``validation.json``.

Nothing is lost on the way: the export is built in a hidden directory beside the target
and moved into place only when it is complete and its checks passed. An interrupt
(Ctrl-C) or an error leaves an earlier export in the target byte for byte as it was. An
export that fails its checks goes to ``<target>.failed`` for inspection (the target is
left alone) unless ``keep_failed=True``; a target that holds anything but an earlier
export is replaced only with ``force=True``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import importlib.metadata
import json
import logging
import os
import shutil
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._extras import require
from .._ort import CPU, CUDA, probe_providers
from .._ort.trt import TRT_PROVIDER, TrtShapes, check_trt_graph, tensorrt_provider_options
from .._quiet import third_parties_quiet
from ..embed.ops import calibration_ranges
from ..embed.pipeline import EMBEDDING_KEY, EmbeddingPipeline
from ..errors import ExportError, OrtBatchError, UnsupportedModelError, ValidationError
from ..heads import ST_CONFIG
from ..manifest import Manifest, model_hash
from . import graph, hub, st_pipeline, tasks, vision, whisper
from .quantize import QuantizeConfig, quantize_model
from .recipes import Recipe, load_recipe, resolve_model_ref, tolerances_for

__all__ = ["ExportResult", "export_model"]

log = logging.getLogger("ortbatch.export")

Progress = Callable[[str], None]
_DEFAULT_MAX_SEQ = 512
_SEQ2SEQ_FILES = ("encoder_model.onnx", "decoder_model.onnx", "decoder_with_past_model.onnx")


@dataclass
class ExportResult:
    """What :func:`export_model` produced. ``directory`` is where the files are: the
    output directory when ``installed``, else ``<output>.failed`` (the checks failed and
    ``keep_failed`` was not given, so the output directory was left as it was)."""

    directory: Path
    manifest: Manifest
    report: Any  # ValidationReport, or None when validate=False
    installed: bool = True

    @property
    def passed(self) -> bool:
        return self.report is None or bool(self.report.passed)

    def not_installed_message(self) -> str:
        """Where the failed export went and what was left alone (for error messages)."""
        target = self.directory.with_name(self.directory.name.removesuffix(".failed"))
        if self.installed:
            return f"the export in {self.directory} failed its checks (installed anyway: keep_failed)"
        return (
            f"the export failed its checks, so {target} was left as it was; the failed export is in "
            f"{self.directory} for inspection (keep_failed=True / --keep-failed installs it anyway)"
        )


def export_model(
    model: str | os.PathLike[str] | None,
    output_dir: str | os.PathLike[str],
    *,
    task: str | None = None,
    opset: int | None = None,
    dtype: str | None = None,
    optimize: str | None = None,
    device: str | None = None,
    trt: bool | None = None,
    max_batch_size: int | None = None,
    max_sequence_length: int | None = None,
    recipe: Recipe | str | os.PathLike[str] | None = None,
    samples: list[str] | tuple[str, ...] | None = None,
    providers: list[str] | tuple[str, ...] | None = None,
    validate: bool = True,
    raise_on_failure: bool = True,
    keep_failed: bool = False,
    force: bool = False,
    trust_remote_code: bool = False,
    progress: Progress | None = None,
    quantize: str | QuantizeConfig | None = None,
    pooling: str | None = None,
    tolerances: dict[str, dict[str, float]] | None = None,
    quiet: bool = True,
) -> ExportResult:
    """Export a Hugging Face model to ``output_dir`` and check it.

    Args:
        model: hub id, local directory, or ``pkg:<module>`` (a package's MODEL_DIR);
            ``None`` to take it from ``recipe``.
        output_dir: created if needed. An earlier export there is replaced once the new
            one is complete and checked; anything else there only with ``force``.
        task: ``"auto"`` (from the checkpoint's architecture; decoders get
            ``-with-past``) or one of :data:`ortbatch.export.SUPPORTED_TASKS`.
        opset: ONNX opset (default :data:`~ortbatch.export.recipes.DEFAULT_OPSET`, as the CLI and recipes).
        dtype: ``"fp32"`` or ``"fp16"``.
        optimize: ``"O1"``..``"O4"`` (ORT graph optimizations via optimum-onnx).
        device: ``"cpu"`` or ``"cuda"`` (where the export and O4 run).
        trt: add TensorRT execution-provider options to the manifest.
        max_batch_size, max_sequence_length: the limits written to the manifest
            (and the TensorRT profile's max shapes).
        recipe: a :class:`Recipe` or a TOML file; the other arguments override it.
        samples: texts the checks run on (default: the recipe's).
        providers: execution providers to check on (default CPU, plus the GPU
            providers the export is for).
        validate: run the checks (default). ``raise_on_failure``: raise
            :class:`~ortbatch.ValidationError` when one fails (default), else only
            report it in the result.
        quantize: ``"int8"`` (dynamic), ``"int8-static"`` (calibrated on the samples) or
            a :class:`~ortbatch.export.quantize.QuantizeConfig`; the checks then use the
            task's int8 tolerances (:data:`~ortbatch.export.recipes.INT8_TOLERANCES`).
        pooling: for ``feature-extraction`` of a plain transformer (no ``modules.json``), how
            the graph's ``sentence_embedding`` pools the tokens (default ``"mean"``; one of
            :data:`ortbatch.embed.POOLING_MODES`). A sentence-transformers checkpoint gets its
            own pipeline (pooling, Dense, Normalize) from its modules.json instead.
        tolerances: per-dtype overrides (``{"int8": {"cosine": 0.995}}``), merged over the recipe's.
        keep_failed: install an export whose checks failed into ``output_dir`` (default:
            it goes to ``<output_dir>.failed`` and ``output_dir`` is left alone).
        force: replace ``output_dir`` even when it holds something other than an export.
        quiet: hide torch/transformers/optimum warnings and logs while exporting, as the
            CLI does (``False``: leave the process's settings alone).

    Raises:
        UnsupportedModelError: the architecture or task is not supported.
        ExportError: the conversion failed, the model cannot be found, or ``output_dir``
            holds something that is not an export (without ``force``).
        ValidationError: a check failed (``exc.report`` has the details).
    """
    say = progress or (lambda msg: log.info("%s", msg))
    given = {name: value for name, value in locals().items() if name in _RECIPE_ARGUMENTS}
    rcp = _recipe(recipe, tolerances, given)
    result = _export_checked(rcp, Path(output_dir), force, validate, keep_failed, trust_remote_code, quiet, say)
    if raise_on_failure and result.report is not None and not result.report.passed:
        raise ValidationError(f"{result.not_installed_message()}: {result.report.summary()}", report=result.report)
    return result


#: the arguments of :func:`export_model` that override a field of its recipe
_RECIPE_ARGUMENTS = frozenset(
    {
        "model",
        "task",
        "opset",
        "dtype",
        "optimize",
        "device",
        "trt",
        "max_batch_size",
        "max_sequence_length",
        "samples",
        "providers",
        "quantize",
        "pooling",
    }
)


def _recipe(
    recipe: Recipe | str | os.PathLike[str] | None,
    tolerances: dict[str, dict[str, float]] | None,
    given: dict[str, Any],
) -> Recipe:
    """The recipe with the arguments laid over it, refused before anything slow when it
    asks for what cannot be done, with the export's dependencies checked."""
    if isinstance(recipe, (str, os.PathLike)):
        recipe = load_recipe(recipe)
    base = recipe if recipe is not None else Recipe()
    model, samples, providers = given["model"], given["samples"], given["providers"]
    rcp = base.with_overrides(
        **{
            **given,
            "model": os.fspath(model) if model is not None else None,
            "samples": tuple(samples) if samples is not None else None,
            "providers": tuple(providers) if providers is not None else None,
            "quantize": QuantizeConfig.parse(given["quantize"]),
        },
        tolerances=_merge_tolerances(base.tolerances, tolerances),
    )
    if rcp.optimize == "O4" and rcp.dtype != "fp16":
        rcp = rcp.with_overrides(dtype="fp16")  # optimum's O4 converts to fp16 itself
    if rcp.model is None:
        raise ExportError("no model given (pass a hub id or directory, or a recipe that names one)")
    if rcp.optimize == "O4" and rcp.device != "cuda":
        raise ExportError(
            "optimize='O4' is O3 plus fp16 kernels fused for GPU and needs device='cuda'. "
            "On CPU use O1, O2 or O3 (optionally with dtype='fp16')."
        )
    if rcp.trt:
        try:
            check_trt_graph(rcp.optimize)
        except ValueError as exc:
            raise ExportError(str(exc)) from None
    for mod in ("torch", "transformers", "optimum.exporters.onnx", "onnx", "onnxruntime"):
        require(mod, "export")
    _check_opset(rcp.opset)
    return rcp


def _check_opset(opset: int) -> None:
    """Refuse an opset above what this torch can write (the tracer fails deep inside
    optimum after printing the whole graph) or this onnx knows, before any work."""
    import onnx
    import torch

    limits = {f"onnx {onnx.__version__}": int(onnx.defs.onnx_opset_version())}
    try:
        from torch.onnx._constants import ONNX_MAX_OPSET

        limits[f"torch {torch.__version__}"] = int(ONNX_MAX_OPSET)
    except (ImportError, AttributeError):  # pragma: no cover - a torch without the constant
        pass
    who, highest = min(limits.items(), key=lambda kv: kv[1])
    if opset > highest:
        raise ExportError(
            f"opset {opset} is above the highest {who} exports ({highest}); use --opset {highest} or lower"
        )


def _export_checked(
    rcp: Recipe,
    out: Path,
    force: bool,
    validate: bool,
    keep_failed: bool,
    trust_remote_code: bool,
    quiet: bool,
    say: Progress,
) -> ExportResult:
    """Resolve, build and check the export beside ``out``, then move it into place (or to
    ``<out>.failed``)."""
    assert rcp.model is not None  # _recipe refuses a recipe without one
    model_ref = resolve_model_ref(rcp.model)
    if os.path.isdir(model_ref) and out.resolve() == Path(model_ref).resolve():
        raise ExportError(f"the output directory {out} is the model's own directory; choose another (-o)")
    replaces = _replaced(out, force)
    t0 = time.perf_counter()
    with third_parties_quiet() if quiet else contextlib.nullcontext():
        say(f"resolving {rcp.model} (task {rcp.task})")
        model_ref = hub.local_or_reachable(model_ref)
        image = vision.detect(model_ref, rcp.task, trust_remote_code=trust_remote_code)
        if image is not None:  # CLIP/SigLIP towers, image classifiers and backbones: export/vision.py
            return _export_image(image, rcp, out, replaces, validate, keep_failed, trust_remote_code, say, t0)
        st_root, task = None, rcp.task
        sub = _transformer_subfolder(model_ref)
        if sub is not None:
            # an older sentence-transformers layout (0_Transformer/): the transformer is
            # exported from its folder, the pipeline read from the checkpoint's root
            st_root, model_ref = model_ref, sub
            task = st_pipeline.checkpoint_task(st_root) if task == "auto" else task
            say(f"the checkpoint's transformer is in {sub}")
        resolved = tasks.resolve_model(model_ref, task, trust_remote_code=trust_remote_code)
        tokenizer = _load_tokenizer(model_ref, trust_remote_code)
        embedding = _embedding_pipeline(resolved, rcp, say, st_root)
        if embedding is not None and embedding.pipeline.source == "sentence-transformers":
            _check_truncation_side(tokenizer, embedding)
            if embedding.lower_case:
                say("lowercasing texts in the tokenizer, as the checkpoint's do_lower_case says")
                st_pipeline.lowercase_tokenizer(tokenizer)
        max_seq = _max_sequence_length(resolved, tokenizer, rcp.max_sequence_length, embedding)
        # Everything is built in a directory beside the target and moved into place only
        # when complete (and checked): an interrupt or a failure leaves the target as it was.
        build = _staging_dir(out)
        try:
            torch_model, _ = _build(build, resolved, rcp, tokenizer, max_seq, embedding, trust_remote_code, say)
            if resolved.task == "text-classification":
                _record_cross_encoder_activation(build, st_root or resolved.model, say)
            report = None
            if validate and tasks.family(resolved.task) == "speech-seq2seq":
                report = whisper.validate_whisper(build, reference=torch_model, progress=say)
            elif validate:
                from .checks import validate as run_checks

                report = run_checks(build, providers=list(rcp.providers) or None, reference=torch_model, progress=say)
        except BaseException:
            shutil.rmtree(build, ignore_errors=True)
            raise
        return _install_checked(build, out, report, replaces, keep_failed, say, t0)


def _export_image(
    image: vision.VisionCheckpoint,
    rcp: Recipe,
    out: Path,
    replaces: str | None,
    validate: bool,
    keep_failed: bool,
    trust_remote_code: bool,
    say: Progress,
    t0: float,
) -> ExportResult:
    """:func:`_export_checked` for an image checkpoint: built by :func:`vision.build_vision`,
    checked by :func:`ortbatch.validate` (its image checks), installed the same way."""
    build = _staging_dir(out)
    try:
        torch_model = vision.build_vision(build, image, rcp, say, trust_remote_code=trust_remote_code)
        report = None
        if validate:
            from .checks import validate as run_checks

            report = run_checks(build, providers=list(rcp.providers) or None, reference=torch_model, progress=say)
    except BaseException:
        shutil.rmtree(build, ignore_errors=True)
        raise
    return _install_checked(build, out, report, replaces, keep_failed, say, t0)


def _install_checked(
    build: Path,
    out: Path,
    report: Any,
    replaces: str | None,
    keep_failed: bool,
    say: Progress,
    t0: float,
) -> ExportResult:
    """Install the checked ``build`` at ``out`` (at ``OUT.failed`` when its checks failed and
    ``keep_failed`` is off), its ``validation.json`` naming where the files went; ``report``: its
    ValidationReport, None when unchecked. The staging folder is removed when installing fails."""
    try:
        installed = report is None or bool(report.passed) or keep_failed
        dest = out if installed else out.with_name(out.name + ".failed")
        if report is not None:  # validation.json names where the files will be
            report.directory = os.fspath(dest)
            report.save(build / "validation.json")
        if installed and replaces:
            say(f"replacing {replaces}")
        _install(build, dest)
    except BaseException:
        shutil.rmtree(build, ignore_errors=True)
        raise
    manifest = Manifest.load(dest)
    say(f"wrote {dest} in {time.perf_counter() - t0:.1f}s")
    return ExportResult(directory=dest, manifest=manifest, report=report, installed=installed)


def _build(
    out: Path,
    resolved: tasks.ResolvedModel,
    rcp: Recipe,
    tokenizer: Any,
    max_seq: int,
    embedding: st_pipeline.ParsedPipeline | None,
    trust_remote_code: bool,
    say: Progress,
) -> tuple[Any, Manifest]:
    """Export, optimize, convert and describe the model in ``out`` (a fresh directory)."""
    fam = tasks.family(resolved.task)
    if fam == "speech-seq2seq":
        whisper.check_recipe(rcp, resolved)
    say(f"exporting {resolved.model_type} for {resolved.task} with optimum-onnx")
    torch_model = _export(resolved, out, rcp, tokenizer, trust_remote_code)
    if fam == "speech-seq2seq":  # Whisper: its own manifest sections and checks (export/whisper.py)
        return torch_model, whisper.describe(out, resolved, rcp, tokenizer, torch_model, say)
    if resolved.task in ("text-classification", "token-classification"):
        _refuse_random_head(resolved, torch_model)
    onnx_files = list(_SEQ2SEQ_FILES) if fam == "seq2seq" else ["model.onnx"]
    missing = [f for f in onnx_files if not (out / f).is_file()]
    if missing:
        raise ExportError(f"optimum-onnx did not write {missing} (found {sorted(os.listdir(out))})")
    if fam == "seq2seq":
        for extra in ("decoder_model_merged.onnx",):
            (out / extra).unlink(missing_ok=True)

    if rcp.optimize is not None:
        say(f"optimizing ({rcp.optimize}) with optimum-onnx's ORT optimizer")
        _optimize(out, onnx_files, rcp)
    if rcp.dtype == "fp16" and rcp.optimize != "O4":
        say("converting to fp16")
        for f in onnx_files:
            _to_fp16(out / f)

    quantized = None
    if rcp.quantize is not None:
        say(f"quantizing ({rcp.quantize.label}) with onnxruntime.quantization")
        for f in onnx_files:
            quantized = quantize_model(
                out / f, rcp.quantize, tokenizer=tokenizer, texts=rcp.samples, max_length=max_seq
            )
    if embedding is not None:
        st_pipeline.append_pipeline_file(out / "model.onnx", embedding)
    tokenizer.save_pretrained(out)
    manifest = _write_manifest(out, resolved, rcp, tokenizer, onnx_files, max_seq)
    if embedding is not None:  # the pipeline, and int8 calibration ranges from the samples
        pipe = embedding.pipeline
        if not pipe.is_sparse:
            default = pipe.prompts[pipe.default_prompt_name] if pipe.default_prompt_name is not None else None
            vectors = st_pipeline.graph_embeddings(out / "model.onnx", tokenizer, list(rcp.samples), max_seq, default)
            calibration = tuple(tuple(float(v) for v in row) for row in vectors)
            pipe = dataclasses.replace(pipe, calibration=calibration, quantization_ranges=calibration_ranges(vectors))
        manifest.extra[EMBEDDING_KEY] = pipe.to_dict()
        manifest.source["embedding_checkpoint"] = os.fspath(embedding.checkpoint)
        manifest.save(out)
    if quantized is not None:  # the variant and the int8 tolerances the checks will use
        manifest.source["quantization"] = quantized
        manifest.validation["tolerances"] = tolerances_for("int8", None, rcp.tolerances, resolved.task)
        manifest.save(out)
    unchecked = [p[0] for p in manifest.providers if p[0] not in manifest.validation["providers"]]
    if unchecked:
        say(
            f"not checking {', '.join(unchecked)}: it does not load here; run `ortbatch validate {out} "
            "--providers cuda,trt` where the model will be served"
        )
    return torch_model, manifest


def _embedding_pipeline(
    resolved: tasks.ResolvedModel, rcp: Recipe, say: Progress, st_root: str | None = None
) -> st_pipeline.ParsedPipeline | None:
    """The sentence-embedding pipeline a feature-extraction export gets: the checkpoint's
    own (modules.json, in ``st_root`` when the transformer is in a subfolder of it), else
    its tokens pooled as ``--pooling`` says; printed either way, so a served embedding is
    never pooled by an unstated guess. A fill-mask export gets one only when the checkpoint
    is a SPLADE ``SparseEncoder`` (``sparse_embedding``)."""
    if resolved.task not in ("feature-extraction", "fill-mask"):
        return None
    root = st_root or _checkpoint_files(resolved.model, sparse_only=resolved.task == "fill-mask")
    parsed = st_pipeline.read_pipeline(root) if root is not None else None
    if resolved.task == "fill-mask":
        if parsed is None or not parsed.pipeline.is_sparse:
            return None  # a plain masked LM: its logits, nothing pooled
        spec = parsed.pipeline.sparse
        assert spec is not None
        say(
            f"sparse_embedding: the checkpoint's SPLADE pooling ({spec.pooling} of log1p({spec.activation}) "
            f"of the logits, {parsed.pipeline.dimension} dims)"
        )
        return parsed
    if parsed is not None and parsed.pipeline.is_sparse:
        raise ExportError(f"{resolved.model} is a SPLADE SparseEncoder: export it for task fill-mask (the default)")
    if _encoder_decoder(resolved.config):
        # optimum's feature-extraction graph of T5 & co. is the whole seq2seq model (it takes
        # decoder_input_ids); a sentence embedding of it is the encoder's alone
        raise ExportError(
            f"{resolved.model} is an encoder-decoder ({resolved.model_type}): sentence-transformers embeds with "
            "its encoder alone (T5EncoderModel), which ortbatch does not export for feature-extraction"
        )
    if parsed is None:
        cfg = resolved.config
        sizes = (getattr(cfg, k, None) for k in ("hidden_size", "n_embd", "d_model"))
        dim = next((d for d in sizes if isinstance(d, int)), None)
        if dim is None:
            raise ExportError(f"cannot tell the hidden size of {resolved.model} to pool its tokens")
        pipe = EmbeddingPipeline(pooling=(rcp.pooling,), token_dimension=dim, source="pooling-flag")
        parsed = st_pipeline.ParsedPipeline(pipe, Path(root or resolved.model))
        say(f"sentence_embedding: {rcp.pooling} pooling of the token embeddings (--pooling; no modules.json)")
    else:
        p = parsed.pipeline
        dense = " -> ".join(f"Dense {d.in_features}->{d.out_features} {d.activation}" for d in p.dense)
        say(
            "sentence_embedding: the checkpoint's own pipeline: "
            + " -> ".join(x for x in ["+".join(p.pooling) + " pooling", dense, "Normalize" if p.normalize else ""] if x)
            + f" ({p.dimension} dims)"
        )
    return parsed


def _check_truncation_side(tokenizer: Any, embedding: st_pipeline.ParsedPipeline) -> None:
    """encode truncates a long text where its tokenizer says; ortbatch's Embedder, server
    and bulk jobs keep a text's first tokens, so a tokenizer that keeps the last ones
    (``truncation_side: left``) would embed long texts differently: refused by name."""
    side = getattr(tokenizer, "truncation_side", "right")
    if side != "right":
        raise ExportError(
            f"{embedding.transformer_path / 'tokenizer_config.json'}: truncation_side={side!r}: sentence-transformers "
            "cuts a long text there, ortbatch keeps a text's first tokens (truncation_side 'right') only"
        )


def _transformer_subfolder(model_ref: str) -> str | None:
    """The folder a local sentence-transformers checkpoint keeps its Transformer in when
    that is not the checkpoint's root (``0_Transformer/``, as older versions saved them);
    ``None`` otherwise."""
    modules_file = Path(model_ref) / "modules.json"
    if not modules_file.is_file():
        return None
    try:
        modules = json.loads(modules_file.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None  # read_pipeline reports it
    for entry in modules if isinstance(modules, list) else []:
        kind = str(entry.get("type", "")).rsplit(".", 1)[-1] if isinstance(entry, dict) else ""
        if kind in ("Transformer", "MLMTransformer") and entry.get("path"):
            return os.fspath(Path(model_ref) / str(entry["path"]))
    return None


def _encoder_decoder(config: Any) -> bool:
    """An encoder-decoder architecture, even saved from its encoder alone (T5EncoderModel
    writes ``is_encoder_decoder: false``, but its model type is still T5's)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES

    return bool(getattr(config, "is_encoder_decoder", False)) or (
        getattr(config, "model_type", None) in MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES
    )


def _checkpoint_files(model: str, sparse_only: bool) -> str | None:
    """A local folder holding ``model``'s files, to read modules.json from: the folder
    itself, or a hub id's snapshot. With ``sparse_only`` (a fill-mask export) a hub id is
    fetched only when it has a modules.json, and ``None`` says it has none."""
    if os.path.isdir(model):
        return model
    try:
        from huggingface_hub import hf_hub_download, snapshot_download

        if sparse_only:
            try:
                hf_hub_download(model, "modules.json")
            except Exception:
                return None
        return str(snapshot_download(model))
    except Exception as exc:
        raise ExportError(f"cannot fetch {model} to read its modules.json: {exc}") from exc


def _checkpoint_tensor_names(model: str) -> set[str] | None:
    """The tensor names in ``model``'s safetensors weights (a local folder, or a hub id's
    files already in the cache); ``None`` when they cannot be read without loading them."""
    from huggingface_hub import try_to_load_from_cache

    def find(name: str) -> Path | None:
        if os.path.isdir(model):
            path = Path(model) / name
            return path if path.is_file() else None
        try:
            cached = try_to_load_from_cache(model, name)
        except Exception:
            return None
        return Path(cached) if isinstance(cached, str) else None

    index = find("model.safetensors.index.json")
    if index is not None:
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
        return set(weight_map) if isinstance(weight_map, dict) else None
    single = find("model.safetensors")
    if single is None:
        return None
    from safetensors import safe_open

    with safe_open(str(single), framework="np") as f:
        return set(f.keys())


def _refuse_random_head(resolved: tasks.ResolvedModel, torch_model: Any) -> None:
    """A classification export of a checkpoint without the head's weights (a bare encoder,
    or a sentence-transformers model whose scores come from other modules) gets a head that
    transformers initializes at random: the export would pass its checks against that same
    random model and answer noise. Refused, naming the missing weights."""
    prefix = getattr(torch_model, "base_model_prefix", "")
    names = _checkpoint_tensor_names(resolved.model)
    if not prefix or names is None:
        return
    head = [k for k in torch_model.state_dict() if not k.startswith(prefix + ".")]
    missing = [k for k in head if k not in names]
    if missing:
        raise ExportError(
            f"{resolved.model} has no weights for the {resolved.task} head ({', '.join(missing[:4])}): "
            "transformers would initialize it at random, so the export would answer noise; export a checkpoint "
            f"trained for {resolved.task}"
        )


def _record_cross_encoder_activation(out: Path, model: str, say: Progress) -> None:
    """Write the checkpoint's sentence-transformers CrossEncoder ``activation_fn``, ``prompts``
    and ``default_prompt_name`` (from its ``config_sentence_transformers.json``, where
    sentence-transformers 5 saves them) into the export's, so that a served score is
    ``CrossEncoder.predict``'s: a checkpoint saved with Identity scores by its logit, not by its
    sigmoid, and a default prompt goes before each query (:mod:`ortbatch.heads`). ``config.json``,
    which holds the older places, is in the export already."""
    if os.path.isdir(model):
        source: Path | None = Path(model) / ST_CONFIG
    else:
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import EntryNotFoundError

        try:
            source = Path(hf_hub_download(model, ST_CONFIG))
        except EntryNotFoundError:
            source = None
        except Exception as exc:
            raise ExportError(f"cannot fetch {model}'s {ST_CONFIG} to read its activation_fn: {exc}") from exc
    if source is None or not source.is_file():
        return
    try:
        doc = json.loads(source.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise ExportError(f"{source} is not JSON: {exc}") from exc
    if not isinstance(doc, dict):
        return
    kept = {k: doc[k] for k in ("activation_fn", "prompts", "default_prompt_name") if doc.get(k) is not None}
    if kept:
        (out / ST_CONFIG).write_text(json.dumps(kept, indent=2) + "\n", encoding="utf-8")
        say(f"cross-encoder settings from {source.name}: {kept}")


# -- the target directory ------------------------------------------------------------


def _replaced(out: Path, force: bool) -> str | None:
    """What exporting into ``out`` replaces (``None``: nothing); refuses, unless
    ``force``, to replace anything that is not an earlier export."""
    if not out.exists():
        return None
    if not out.is_dir():
        raise ExportError(f"{out} exists and is not a directory; choose another output directory (-o)")
    entries = sorted(p.name for p in out.iterdir())
    if not entries:
        return None
    try:
        old = Manifest.load(out)
    except OrtBatchError:
        old = None
    if old is not None:
        src, task = old.source.get("model_ref") or old.source.get("model"), old.source.get("task")
        passed = {True: "checks passed", False: "checks FAILED", None: "not checked"}.get(
            old.validation.get("passed"), "not checked"
        )
        return f"the earlier export in {out} ({src}, {task}, {passed})"
    shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
    if not force:
        raise ExportError(
            f"{out} is not empty and is not an ortbatch export ({len(entries)} entries: {shown}); exporting there "
            "would replace all of it. Choose another output directory (-o), or pass --force (force=True) to replace it"
        )
    return f"{out} ({len(entries)} entries: {shown}; --force)"


_STAGING = ".partial-"


def _staging_dir(out: Path) -> Path:
    """A fresh directory beside ``out`` (same file system, so the final move is a
    rename); partial builds of exports that were killed (their process is gone) are
    removed first."""
    out.parent.mkdir(parents=True, exist_ok=True)
    prefix = f".{out.name}{_STAGING}"
    for stale in out.parent.glob(glob.escape(prefix) + "*"):
        pid = stale.name[len(prefix) :].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    build = out.parent / f"{prefix}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    build.mkdir()  # not mkdtemp: its 0700 would become the export's permissions
    return build


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    return True


def _install(build: Path, dest: Path) -> None:
    """Move the finished ``build`` to ``dest``, replacing what is there: two renames
    with Ctrl-C held off between them, then the old directory is removed."""
    old = dest.with_name(f".{dest.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    with _sigint_deferred():
        had = dest.exists()
        if had:
            os.replace(dest, old)
        try:
            os.replace(build, dest)
        except BaseException:
            if had:
                os.replace(old, dest)
            raise
    if had:
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def _sigint_deferred() -> Iterator[None]:
    """Ignore SIGINT inside the block, a few milliseconds of renames (main thread only;
    elsewhere signals do not land)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda sig, frame: got.append(sig))
    try:
        yield
    finally:
        # None: a handler installed outside Python; Python's own is the safe one to put back
        signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)
    if got:  # the export is in place now: finishing it is what leaves nothing half done
        log.warning("Ctrl-C during the final move was held until the export was in place")


# -- steps ---------------------------------------------------------------------------


def _merge_tolerances(
    base: dict[str, dict[str, float]], extra: dict[str, dict[str, float]] | None
) -> dict[str, dict[str, float]] | None:
    if not extra:
        return None
    merged = {k: dict(v) for k, v in base.items()}
    for dtype, values in extra.items():
        merged.setdefault(dtype, {}).update(values)
    return merged


def _load_tokenizer(model_ref: str, trust_remote_code: bool) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_ref, trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise ExportError(
            f"could not load a tokenizer for {model_ref}: ortbatch exports text models and needs one "
            f"to set pad values and run the checks ({type(exc).__name__}: {exc})"
        ) from exc


def _max_sequence_length(
    resolved: tasks.ResolvedModel,
    tokenizer: Any,
    requested: int | None,
    embedding: st_pipeline.ParsedPipeline | None = None,
) -> int:
    """The longest input the export takes (texts are truncated to it): ``requested``, else
    what the model and its tokenizer allow. A sentence-transformers checkpoint whose
    ``sentence_bert_config.json`` sets ``max_seq_length`` truncates there, below the
    tokenizer's own ``model_max_length`` (all-MiniLM-L6-v2: 256, not 512), so that is the
    default, and a longer ``requested`` would embed long texts unlike ``encode``: refused."""
    cfg = resolved.config
    limits = [
        getattr(cfg, k)
        for k in ("max_position_embeddings", "n_positions", "max_seq_len")
        if isinstance(getattr(cfg, k, None), int)
    ]
    if getattr(cfg, "model_type", "") in ("roberta", "xlm-roberta", "camembert") and limits:
        limits = [limits[0] - 2]  # positions start after the padding index
    tok_max = getattr(tokenizer, "model_max_length", None)
    if isinstance(tok_max, int) and 0 < tok_max < 1_000_000:
        limits.append(tok_max)
    model_max = min(limits) if limits else None
    st_max = embedding.max_seq_length if embedding is not None else None
    if isinstance(st_max, int) and st_max > 0:
        assert embedding is not None
        where = embedding.transformer_path / "sentence_bert_config.json"
        if requested is not None and requested > st_max:
            raise ExportError(
                f"max_sequence_length={requested} exceeds the checkpoint's max_seq_length={st_max} ({where}): "
                "sentence-transformers truncates texts there, so longer texts would embed differently"
            )
        model_max = st_max if model_max is None else min(st_max, model_max)
    if requested is not None:
        if model_max is not None and requested > model_max:
            raise ExportError(
                f"max_sequence_length={requested} exceeds what {resolved.model} supports ({model_max} positions)"
            )
        return requested
    return model_max or _DEFAULT_MAX_SEQ


def _export(resolved: tasks.ResolvedModel, out: Path, rcp: Recipe, tokenizer: Any, trust_remote_code: bool) -> Any:
    from optimum.exporters.onnx import onnx_export_from_model
    from optimum.exporters.tasks import TasksManager
    from optimum.utils.save_utils import maybe_load_preprocessors

    fam = tasks.family(resolved.task)
    try:
        model = TasksManager.get_model_from_task(
            resolved.task,
            resolved.model,
            framework="pt",
            library_name=resolved.library,
            device=rcp.device,
            trust_remote_code=trust_remote_code,
        )
    except OrtBatchError:
        raise
    except Exception as exc:
        raise ExportError(f"could not load {resolved.model} for {resolved.task}: {type(exc).__name__}: {exc}") from exc
    config = getattr(model, "config", None)
    if resolved.task == "text-classification" and config is not None and config.pad_token_id is None:
        config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    try:
        onnx_export_from_model(
            model=model,
            output=out,
            opset=rcp.opset,
            task=resolved.task,
            device=rcp.device,
            do_validation=False,  # ours is stricter and never downgrades a failure to a warning
            # seq2seq: keep the plain decoder and decoder-with-past instead of the merged If-graph.
            no_post_process=fam in ("seq2seq", "speech-seq2seq"),
            preprocessors=maybe_load_preprocessors(resolved.model, trust_remote_code=trust_remote_code),
            custom_onnx_configs=_with_position_ids(model, resolved),
        )
    except (ValueError, KeyError) as exc:
        if "not supported" in str(exc) or "unsupported" in str(exc).lower():
            raise UnsupportedModelError(str(exc)) from exc
        raise ExportError(f"optimum-onnx failed to export {resolved.model}: {exc}") from exc
    except Exception as exc:
        raise ExportError(f"optimum-onnx failed to export {resolved.model}: {type(exc).__name__}: {exc}") from exc
    if hasattr(model, "to"):
        model.to("cpu")
    if hasattr(model, "eval"):
        model.eval()
    return model


def _with_position_ids(model: Any, resolved: tasks.ResolvedModel) -> dict[str, Any] | None:
    """An export config that gives a decoder-with-past a ``position_ids`` input where
    optimum's has none (the Gemma family in optimum-onnx 0.1.0); ``None`` otherwise.

    Without that input the graph counts positions from the cache length. That is harmless
    while a row keeps its place in the cache (rotary embeddings only see relative
    positions), but continuous batching moves rows (a row joining a longer cache gets more
    left padding; compaction trims padding), and every move would shift the positions of
    that row's new tokens against its cached ones. With ``position_ids`` as an input, the
    runtime gives each row its own positions from its mask.
    """
    if resolved.task != "text-generation-with-past":
        return None
    import inspect

    from optimum.exporters.tasks import TasksManager

    try:
        constructor = TasksManager.get_exporter_config_constructor(
            model=model, exporter="onnx", task=resolved.task, library_name=resolved.library
        )
        config = constructor(model.config, int_dtype="int64", float_dtype="fp32")
    except Exception:  # optimum raises its own error for this in the export itself
        return None
    forward = getattr(model, "forward", None)
    takes_positions = forward is not None and "position_ids" in inspect.signature(forward).parameters
    if "position_ids" in config.inputs or not takes_positions:
        return None
    base = type(config)

    def inputs(self: Any) -> dict[str, dict[int, str]]:
        common = base.inputs.fget(self)
        common["position_ids"] = {0: "batch_size", 1: "sequence_length"}
        return common

    with_positions = type(f"{base.__name__}WithPositionIds", (base,), {"inputs": property(inputs)})
    # as optimum's get_decoder_models_for_export builds it: the task without "-with-past"
    export_config = with_positions(
        model.config,
        task=config.task,
        int_dtype="int64",
        float_dtype="fp32",
        use_past=config.use_past,
        use_past_in_inputs=config.use_past,
    )
    return {"model": export_config}


def _optimize(out: Path, onnx_files: list[str], rcp: Recipe) -> None:
    from optimum.onnxruntime import AutoOptimizationConfig, ORTOptimizer

    for_gpu = rcp.device == "cuda"
    try:
        cfg = AutoOptimizationConfig.with_optimization_level(rcp.optimize, for_gpu=for_gpu)
        cfg.disable_shape_inference = True
        optimizer = ORTOptimizer.from_pretrained(out, file_names=onnx_files)
        optimizer.optimize(save_dir=out, optimization_config=cfg, file_suffix="")
    except Exception as exc:
        raise ExportError(f"ORT optimization {rcp.optimize} failed: {type(exc).__name__}: {exc}") from exc
    (out / "ort_config.json").unlink(missing_ok=True)


def _to_fp16(path: Path) -> None:
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    model = onnx.load(str(path))
    # Inputs and outputs stay fp32/int64 so callers and the batcher see the same
    # interface as the fp32 export; the casts sit at the graph's edges.
    model16 = convert_float_to_float16(model, keep_io_types=True, disable_shape_infer=model.ByteSize() > 2**31)
    graph.save_onnx(model16, path)


def _pads(tokenizer: Any, resolved: tasks.ResolvedModel) -> dict[str, float | int]:
    pad = tokenizer.pad_token_id
    if pad is None:
        pad = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    return {
        "input_ids": int(pad),
        "decoder_input_ids": int(pad),
        "attention_mask": 0,
        "encoder_attention_mask": 0,
        "decoder_attention_mask": 0,
        "token_type_ids": int(getattr(tokenizer, "pad_token_type_id", 0) or 0),
        "position_ids": 0,
    }


def _versions() -> dict[str, str]:
    versions = {}
    for dist in (
        "ortbatch",
        "torch",
        "transformers",
        "optimum-onnx",
        "optimum",
        "onnx",
        "onnxruntime",
        "onnxruntime-gpu",
        "sentence-transformers",
    ):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def _ort_version() -> str:
    import onnxruntime

    return str(onnxruntime.__version__)


def _write_manifest(
    out: Path, resolved: tasks.ResolvedModel, rcp: Recipe, tokenizer: Any, onnx_files: list[str], max_seq: int
) -> Manifest:
    fam = tasks.family(resolved.task)
    pads = _pads(tokenizer, resolved)
    components: dict[str, Any] = {}
    main_io = None
    for f in onnx_files:
        io = graph.read_graph_io(out / f)
        inputs, outputs, shapes = graph.manifest_io(io, pads)
        name = f.removesuffix(".onnx").removesuffix("_model") if fam == "seq2seq" else "model"
        components[name] = {
            "model": f,
            "opset": io.opset,
            "inputs": {k: v.to_dict() for k, v in inputs.items()},
            "outputs": {k: v.to_dict() for k, v in outputs.items()},
            "shapes": shapes,
            "sha256": model_hash(out / f),
        }
        if main_io is None:
            main_io = (f, inputs, outputs, shapes, io.opset)
    assert main_io is not None
    main_file, inputs, outputs, shapes, opset = main_io
    limits = {"max_batch_size": rcp.max_batch_size, "max_sequence_length": max_seq}

    providers: list[Any] = []
    if rcp.trt:
        trt_shapes = TrtShapes(rcp.max_batch_size, max_seq, rcp.trt_opt_batch_size, rcp.trt_opt_sequence_length)
        fp16 = rcp.trt_fp16 if rcp.trt_fp16 is not None else rcp.dtype == "fp16"
        # One set of profiles per component: an encoder-decoder's encoder and decoder take
        # different inputs, and each engine is cached under its own model's hash.
        for comp in components.values():
            comp["tensorrt"] = tensorrt_provider_options(
                comp["shapes"], trt_shapes, fp16=fp16, model_digest=comp["sha256"], ort_version=_ort_version()
            )
        providers.append([TRT_PROVIDER, dict(components[next(iter(components))]["tensorrt"])])
    if rcp.trt or rcp.device == "cuda":
        providers.append([CUDA, {}])
    providers.append([CPU, {}])

    tol = tolerances_for(rcp.dtype, rcp.optimize, rcp.tolerances)
    tol_fp16 = tolerances_for("fp16", rcp.optimize, rcp.tolerances)
    check_providers = list(rcp.providers) or _default_check_providers(providers)
    manifest = Manifest(
        model=main_file,
        inputs=inputs,
        outputs=outputs,
        padding_side=tasks.padding_side(resolved.task),
        limits=limits,
        providers=providers,
        source={
            "model": resolved.model,
            "model_ref": rcp.model,
            "task": resolved.task,
            "family": fam,
            "library": resolved.library,
            "model_type": resolved.model_type,
            "dtype": rcp.dtype,
            "optimize": rcp.optimize,
            "opset": opset,
            "device": rcp.device,
            "versions": _versions(),
            "recipe": rcp.path,
        },
        validation={
            "passed": None,
            "report": "validation.json",
            "samples": list(rcp.samples),
            "tolerances": tol,
            "tolerances_fp16": tol_fp16,
            "providers": check_providers,
        },
        extra={"components": components},
    )
    if resolved.task == "text-generation-with-past":  # what BatchedGenerator serves
        manifest.generation = _generation_section(out)
    elif resolved.task == "text2text-generation-with-past":  # what Seq2SeqGenerator serves
        manifest.generation = _generation_section(out, seq2seq=True)
    manifest.save(out)
    return manifest


def _default_check_providers(providers: list[Any]) -> list[str]:
    """CPU, plus the export's GPU providers that really load here (a probe session, not
    the build's list). One that does not (exporting for TensorRT on a build machine) is
    not checked here and the log says so: run ``ortbatch validate DIR --providers trt``
    where it will be served."""
    names = [p[0] for p in providers if p[0] != CPU]
    return [CPU] + [n for n in names if n in probe_providers((n, CPU))[0]]


def _generation_section(out: Path, seq2seq: bool = False) -> dict[str, Any]:
    try:
        from ortbatch.generation.layout import generation_section
        from ortbatch.generation.seq2seq_layout import seq2seq_section
    except ImportError:
        log.info("ortbatch.generation is not available; the manifest has no generation section")
        return {}
    try:
        return dict(seq2seq_section(out) if seq2seq else generation_section(out))
    except OrtBatchError:
        raise
    except Exception as exc:
        raise ExportError(f"could not describe the generation cache layout: {type(exc).__name__}: {exc}") from exc
