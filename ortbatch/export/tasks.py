"""Which tasks ortbatch exports and checks, and how each is served.

The conversion itself is optimum-onnx's; this module decides the task when asked
for ``auto``, refuses what ortbatch cannot check or serve (with a list of what it
can), and says how each task family is batched (padding side, components).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ExportError, UnsupportedModelError

__all__ = [
    "DECODER_TASKS",
    "ENCODER_TASKS",
    "SEQ2SEQ_TASKS",
    "SPEECH_TASKS",
    "SUPPORTED_TASKS",
    "ResolvedModel",
    "family",
    "padding_side",
    "resolve_model",
]

ENCODER_TASKS = (
    "feature-extraction",
    "fill-mask",
    "text-classification",
    "token-classification",
    "question-answering",
)
DECODER_TASKS = ("text-generation", "text-generation-with-past")
SEQ2SEQ_TASKS = ("text2text-generation", "text2text-generation-with-past")
# Whisper: encoder, decoder and decoder-with-past graphs, described and checked by export/whisper.py
SPEECH_TASKS = ("automatic-speech-recognition", "automatic-speech-recognition-with-past")
SUPPORTED_TASKS = ENCODER_TASKS + DECODER_TASKS + SEQ2SEQ_TASKS + SPEECH_TASKS


def family(task: str) -> str:
    """``"encoder"``, ``"decoder"``, ``"seq2seq"`` or ``"speech-seq2seq"``."""
    if task in DECODER_TASKS:
        return "decoder"
    if task in SEQ2SEQ_TASKS:
        return "seq2seq"
    if task in SPEECH_TASKS:
        return "speech-seq2seq"
    if task in ENCODER_TASKS:
        return "encoder"
    raise UnsupportedModelError(f"task {task!r} is not supported; ortbatch supports {list(SUPPORTED_TASKS)}")


def padding_side(task: str) -> str:
    """Decoders are left-padded so every row's next token sits in the last column."""
    return "left" if family(task) == "decoder" else "right"


@dataclass(frozen=True)
class ResolvedModel:
    model: str  # hub id or local directory
    task: str
    library: str  # "transformers" or "sentence_transformers"
    model_type: str
    config: Any


def _tasks_manager() -> Any:
    # The ONNX configs register themselves with the TasksManager when this module is
    # imported; optimum's lazy package would otherwise leave the registry empty.
    import optimum.exporters.onnx.model_configs  # noqa: F401
    from optimum.exporters.tasks import TasksManager

    return TasksManager


def _supported_model_types() -> list[str]:
    TasksManager = _tasks_manager()

    types: set[str] = set()
    for task in SUPPORTED_TASKS:
        try:
            types.update(TasksManager.get_supported_model_type_for_task(task, exporter="onnx"))
        except KeyError:
            continue
    return sorted(t.replace("_", "-") for t in types)


def _library(model: str) -> str:
    from optimum.exporters.tasks import TasksManager

    if os.path.isdir(model) and not (Path(model) / "modules.json").is_file():
        return "transformers"
    try:
        library = TasksManager.infer_library_from_model(model)
    except Exception:
        return "transformers"
    if library == "sentence_transformers":
        # ortbatch reads the pipeline (modules.json) itself and appends it to the plain
        # transformer's graph, with or without sentence-transformers importable
        return "transformers"
    return library if library in ("transformers", "sentence_transformers") else "transformers"


def resolve_model(model: str, task: str = "auto", *, trust_remote_code: bool = False) -> ResolvedModel:
    """Find the library, task and model type; :class:`UnsupportedModelError` if ortbatch
    cannot export and check this combination (the message lists what it can)."""
    from transformers import AutoConfig

    TasksManager = _tasks_manager()

    try:
        config = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        offline = (
            " (HF_HUB_OFFLINE is set: hub ids must already be in the local cache)"
            if os.environ.get("HF_HUB_OFFLINE") in ("1", "true", "True")
            else ""
        )
        raise ExportError(f"cannot load the configuration of {model!r}{offline}: {exc}") from exc
    model_type = config.model_type.replace("_", "-")
    library = _library(model)
    if task != "auto":
        task = TasksManager.map_from_synonym(task)
        if task not in SUPPORTED_TASKS:
            raise UnsupportedModelError(
                f"task {task!r} is not supported by ortbatch export; supported tasks: {', '.join(SUPPORTED_TASKS)}"
            )
    try:
        # sentence-transformers checkpoints are exported through one generic config.
        lookup = "transformer" if library == "sentence_transformers" else model_type
        try:
            model_tasks = TasksManager.get_supported_tasks_for_model_type(lookup, "onnx", library_name=library)
        except KeyError:  # optimum registers some under the config's own spelling (m2m_100)
            if lookup == config.model_type:
                raise
            model_tasks = TasksManager.get_supported_tasks_for_model_type(
                config.model_type, "onnx", library_name=library
            )
    except KeyError:
        raise UnsupportedModelError(
            f"architecture {model_type!r} is not supported by the ONNX exporter (optimum-onnx). "
            f"Supported text architectures: {', '.join(_supported_model_types())}"
        ) from None
    ours = [t for t in model_tasks if t in SUPPORTED_TASKS]
    if not ours:
        raise UnsupportedModelError(
            f"{model_type!r} can be exported only for {sorted(model_tasks)}, none of which ortbatch checks and "
            f"serves; supported tasks: {', '.join(SUPPORTED_TASKS)}"
        )
    if task == "auto" and os.path.isdir(model) and (Path(model) / "modules.json").is_file():
        from .st_pipeline import checkpoint_task

        # a sentence-transformers checkpoint: its embeddings (a SPLADE one: its masked-LM
        # logits, pooled in the graph), never a generator
        task = checkpoint_task(model)
    elif task == "auto":
        task = _infer_task(config, library)
        if task + "-with-past" in model_tasks:
            task += "-with-past"
    if task not in model_tasks:
        raise UnsupportedModelError(
            f"{model_type!r} cannot be exported for task {task!r}; for this architecture ortbatch supports: "
            f"{', '.join(ours)}"
        )
    family(task)  # raises for tasks outside ortbatch's list
    return ResolvedModel(model=model, task=task, library=library, model_type=model_type, config=config)


def _infer_task(config: Any, library: str) -> str:
    from optimum.exporters.tasks import TasksManager

    if library == "sentence_transformers":
        return "feature-extraction"
    import transformers

    heads = []
    if getattr(config, "model_type", None) == "whisper":
        return "automatic-speech-recognition"  # its ForConditionalGeneration head is speech-to-text
    for arch in config.architectures or []:
        # BART-like heads are registered for fill-mask too; generation is what they are for.
        if getattr(config, "is_encoder_decoder", False) and arch.endswith("ForConditionalGeneration"):
            return "text2text-generation"
        cls = getattr(transformers, arch, None)
        if cls is None:
            continue
        try:
            return str(TasksManager.infer_task_from_model(cls))
        except (ValueError, KeyError):
            if "For" in arch:  # a head (BertForPreTraining), not a bare encoder (T5EncoderModel)
                heads.append(arch)
            continue
    if heads:
        # feature-extraction would export the encoder alone and silently drop the head the
        # checkpoint was saved with: its outputs would not be the model's
        raise UnsupportedModelError(
            f"cannot tell which task to export the checkpoint's {', '.join(heads)} for: no task ortbatch "
            f"supports has that head. Pass --task (e.g. --task feature-extraction exports the encoder "
            f"without the head); supported tasks: {', '.join(SUPPORTED_TASKS)}"
        )
    # A checkpoint without a head (e.g. BertModel saved from a base config).
    return "feature-extraction"
