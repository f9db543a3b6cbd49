"""Whisper (``automatic-speech-recognition``) exports: what the manifest records, and their checks.

The graphs are optimum-onnx's, as for the text encoder-decoders: ``encoder_model.onnx``
(``input_features`` → ``last_hidden_state``), ``decoder_model.onnx`` (the first tokens, with
the cross-attention cache) and ``decoder_with_past_model.onnx`` (one token a step). Around
them this module writes what decoding needs into ``ortbatch.json``:

* ``whisper``: :class:`~ortbatch.audio.whisper.WhisperSpec` from the checkpoint's
  ``generation_config.json`` and ``config.json`` (decoder start, end of text, the language and
  task tokens, ``<|notimestamps|>`` and where timestamps begin, ``<|startofprev|>``,
  ``suppress_tokens``, ``begin_suppress_tokens``, ``forced_decoder_ids``, alignment heads,
  ``max_initial_timestamp_index``, ``max_target_positions``, language names);
* ``features``: the feature extractor's settings (:class:`~ortbatch.audio.FeatureSettings`),
  with ``preprocessor_config.json`` beside the graphs.

and checks the export against the checkpoint in transformers, on audio (synthetic by
default; the tests add espeak-ng speech): the encoder's states, the decoder's logits (first
tokens and cached steps), and greedy tokens equal to ``generate``'s, each clip alone and in
one batch, with the language detected, given, and translating with timestamps.
"""

from __future__ import annotations

import importlib.metadata
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .._ort import CPU
from ..audio.features import FeatureSettings, log_mel_spectrogram
from ..audio.transcriber import FEATURES_KEY, WHISPER_KEY, WhisperGraphs
from ..audio.whisper import LogitRules, WhisperSpec, initial_tokens, needs_language
from ..errors import ExportError, UnsupportedModelError
from ..manifest import Manifest, model_hash
from . import graph
from .checks.results import Case, CheckResult, Comparison, ValidationReport

__all__ = [
    "SPEECH_FILES",
    "check_recipe",
    "default_clips",
    "describe",
    "validate_whisper",
]

SPEECH_FILES = ("encoder_model.onnx", "decoder_model.onnx", "decoder_with_past_model.onnx")
#: encoder states and logits of an fp32 export against PyTorch: max |onnx - torch| <= atol + rtol * |torch|
TOLERANCES = {"atol": 1e-4, "rtol": 1e-3}
#: tokens generated per clip by the greedy check (random weights do not stop by themselves)
GREEDY_TOKENS = 12
Progress = Callable[[str], None]


def check_recipe(rcp: Any, resolved: Any) -> None:
    """Refuse, before anything slow, what a speech export cannot do yet: another speech
    architecture than Whisper, the task without the decoder-with-past graph, and the
    variants (fp16, optimized, int8, TensorRT) not checked yet."""
    if resolved.model_type != "whisper":
        raise UnsupportedModelError(
            f"{resolved.model} is {resolved.model_type!r}: ortbatch exports and checks Whisper checkpoints for "
            "automatic-speech-recognition, no other speech architecture yet"
        )
    if not resolved.task.endswith("-with-past"):
        raise ExportError(
            "export Whisper with --task automatic-speech-recognition-with-past (or auto): decoding runs the "
            "decoder-with-past graph, which the task without -with-past does not write"
        )
    unsupported = [
        ("optimize", rcp.optimize is not None),
        ("dtype fp16", rcp.dtype != "fp32"),
        ("quantize", rcp.quantize is not None),
        ("trt", bool(rcp.trt)),
    ]
    asked = [name for name, on in unsupported if on]
    if asked:
        raise ExportError(
            f"automatic-speech-recognition exports are fp32, unoptimized, CPU/CUDA only for now: "
            f"{', '.join(asked)} is not supported for them yet"
        )


def describe(out: Path, resolved: Any, rcp: Any, tokenizer: Any, torch_model: Any, say: Progress) -> Manifest:
    """Write ``ortbatch.json`` (and the tokenizer and feature extractor files) for the
    Whisper graphs optimum-onnx wrote into ``out``."""
    from transformers import AutoFeatureExtractor
    from transformers.models.whisper.tokenization_whisper import TO_LANGUAGE_CODE

    missing = [f for f in SPEECH_FILES if not (out / f).is_file()]
    if missing:
        raise ExportError(f"optimum-onnx did not write {missing} (found {sorted(os.listdir(out))})")
    (out / "decoder_model_merged.onnx").unlink(missing_ok=True)
    try:
        extractor = AutoFeatureExtractor.from_pretrained(resolved.model)
    except Exception as exc:
        raise ExportError(
            f"could not load the feature extractor of {resolved.model} (preprocessor_config.json): {exc}"
        ) from exc
    settings = FeatureSettings.from_dict(extractor.to_dict(), f"{resolved.model}: preprocessor_config.json")
    n_mels = int(getattr(torch_model.config, "num_mel_bins", settings.feature_size))
    if n_mels != settings.feature_size:
        raise ExportError(
            f"{resolved.model}: the feature extractor makes {settings.feature_size} mel bins, the model takes {n_mels}"
        )
    spec = WhisperSpec.from_configs(
        torch_model.generation_config.to_dict(), torch_model.config.to_dict(), language_names=TO_LANGUAGE_CODE
    )
    if spec.vocab_size != len(tokenizer):
        say(f"note: the tokenizer has {len(tokenizer)} tokens, the model's vocabulary {spec.vocab_size}")
    extractor.save_pretrained(out)
    tokenizer.save_pretrained(out)
    torch_model.generation_config.save_pretrained(out)

    pads: dict[str, float | int] = {"input_ids": spec.pad_token_id, "input_features": 0.0}
    components: dict[str, Any] = {}
    for f in SPEECH_FILES:
        io = graph.read_graph_io(out / f)
        inputs, outputs, shapes = graph.manifest_io(io, pads)
        components[f.removesuffix(".onnx").removesuffix("_model")] = {
            "model": f,
            "opset": io.opset,
            "inputs": {k: v.to_dict() for k, v in inputs.items()},
            "outputs": {k: v.to_dict() for k, v in outputs.items()},
            "shapes": shapes,
            "sha256": model_hash(out / f),
        }
    enc_io = graph.read_graph_io(out / SPEECH_FILES[0])
    enc_inputs, enc_outputs, _ = graph.manifest_io(enc_io, pads)
    manifest = Manifest(
        model=SPEECH_FILES[0],
        inputs=enc_inputs,
        outputs=enc_outputs,
        padding_side="right",
        limits={"max_batch_size": rcp.max_batch_size, "max_sequence_length": spec.max_target_positions},
        providers=[[CPU, {}]],
        source={
            "model": resolved.model,
            "model_ref": rcp.model,
            "task": resolved.task,
            "family": "speech-seq2seq",
            "library": resolved.library,
            "model_type": resolved.model_type,
            "dtype": rcp.dtype,
            "optimize": None,
            "opset": enc_io.opset,
            "device": rcp.device,
            "recipe": rcp.path,
            "versions": _versions(),
        },
        validation={"passed": None, "report": "validation.json", "tolerances": dict(TOLERANCES), "providers": [CPU]},
        extra={"components": components, WHISPER_KEY: spec.to_dict(), FEATURES_KEY: settings.to_dict()},
    )
    manifest.save(out)
    say(
        f"whisper: {settings.feature_size} mel bins, {len(spec.lang_to_id)} languages, "
        f"tasks {sorted(spec.task_to_id)}, {len(spec.suppress_tokens)} suppressed tokens"
    )
    return manifest


def _versions() -> dict[str, str]:
    out = {}
    for dist in ("ortbatch", "torch", "transformers", "optimum-onnx", "onnx", "onnxruntime", "av"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


# -- the checks -----------------------------------------------------------------------------------


def default_clips() -> list[np.ndarray]:
    """Synthetic 16-kHz clips of 1 to 30 s (a gliding harmonic "voice" in syllables, over a
    little noise) and 2 s of silence: deterministic audio for checks where no recording is
    given."""
    rng = np.random.default_rng(0)
    clips = []
    for seconds in (1.0, 12.5, 30.0):
        t = np.arange(int(seconds * 16000)) / 16000
        pitch = 120 + 40 * np.sin(2 * np.pi * 0.5 * t)
        phase = 2 * np.pi * np.cumsum(pitch) / 16000
        voiced = sum(np.sin(k * phase) / k for k in range(1, 6)) * (0.5 + 0.5 * np.sin(2 * np.pi * 3 * t))
        clips.append(0.2 * voiced + 0.01 * rng.standard_normal(t.shape[0]))
    clips.append(np.zeros(32000))
    return [np.asarray(c, dtype=np.float32) for c in clips]


#: the decoding options the greedy check runs: (label, language, task, timestamps)
GREEDY_OPTIONS: tuple[tuple[str, str | None, str | None, bool], ...] = (
    ("language detected", None, None, False),
    ("en transcribe", "en", "transcribe", False),
    ("fr translate, timestamps", "fr", "translate", True),
)


def validate_whisper(
    directory: str | os.PathLike[str],
    *,
    reference: Any = None,
    use_reference: bool = True,
    clips: Sequence[np.ndarray] | None = None,
    greedy_tokens: int = GREEDY_TOKENS,
    save: bool = True,
    progress: Progress | None = None,
) -> Any:
    """Check a Whisper export against the checkpoint in transformers (``reference``: an
    already loaded ``WhisperForConditionalGeneration``, default: load ``source.model``) on
    ``clips`` (16-kHz mono samples of at most 30 s; default :func:`default_clips`).

    Checks: the encoder's states and the decoder's logits (first tokens, then cached steps)
    within :data:`TOLERANCES`; greedy tokens equal to ``generate``'s for each of
    :data:`GREEDY_OPTIONS`, each clip alone and all in one batch; and (without the reference
    too) each clip's tokens alone equal to its tokens in the batch. Returns the
    :class:`~ortbatch.ValidationReport`; with ``save``, ``validation.json`` and the result in
    ``ortbatch.json``. ``use_reference=False`` runs the ONNX-only check."""
    say = progress or (lambda msg: None)
    t0 = time.perf_counter()
    graphs = WhisperGraphs(directory)
    manifest = graphs.manifest
    reason = "given"
    if not use_reference:
        reference, reason = None, "not requested (--no-reference / use_reference=False)"
    elif reference is None:
        reference, reason = _load_reference(manifest.source)
    report = ValidationReport(
        directory=os.fspath(graphs.directory),
        task=str(manifest.source.get("task", "")),
        dtype="fp32",
        providers=[CPU],
        reference={"available": reference is not None, "reason": reason},
        tolerances=dict(TOLERANCES),
    )
    audio = list(clips) if clips is not None else default_clips()
    too_long = [i for i, c in enumerate(audio) if c.shape[0] > graphs.features.n_samples]
    if too_long:
        raise ValueError(f"clip {too_long[0]} is longer than one {graphs.features.chunk_length}-s window")
    features = np.stack([log_mel_spectrogram(c, graphs.features) for c in audio])
    lengths = ", ".join(f"{c.shape[0] / 16000:g}" for c in audio)
    if reference is None:
        report.checks.append(CheckResult("reference parity", CPU, "skipped", note=reason))
    else:
        say(f"whisper: encoder states on {len(audio)} clips ({lengths} s)")
        report.checks.append(_encoder_parity(graphs, reference, features))
        say("whisper: decoder logits, first tokens and cached steps")
        report.checks.append(_decoder_parity(graphs, reference, features))
        say("whisper: greedy tokens against transformers' generate")
        report.checks.append(_greedy_parity(graphs, reference, features, greedy_tokens))
    say("whisper: each clip alone against the batch")
    report.checks.append(_batching_invariance(graphs, features, greedy_tokens))
    report.seconds = time.perf_counter() - t0
    if save:
        report.save(graphs.directory / "validation.json")
        manifest.validation = {
            **manifest.validation,
            "passed": report.passed,
            "report": "validation.json",
            "not_run": [],
            "reference_parity": "ran" if reference is not None else "skipped",
        }
        manifest.save()
    return report


def _load_reference(source: dict[str, Any]) -> tuple[Any, str]:
    model = source.get("model")
    if not model:
        return None, "the manifest names no source model"
    try:
        from transformers import WhisperForConditionalGeneration

        loaded = WhisperForConditionalGeneration.from_pretrained(str(model)).eval()
    except Exception as exc:
        return None, f"could not load {model} in transformers ({type(exc).__name__}: {str(exc)[:300]})"
    return loaded, f"loaded {model}"


def _close(label: str, ours: np.ndarray, theirs: np.ndarray) -> Comparison:
    diff = np.abs(ours.astype(np.float64) - theirs)
    bound = TOLERANCES["atol"] + TOLERANCES["rtol"] * np.abs(theirs)
    nonfinite = int((~np.isfinite(ours)).sum())
    passed = nonfinite == 0 and bool((diff <= bound).all())
    worst = float(diff.max()) if diff.size else 0.0
    return Comparison(
        output=label,
        shape=list(ours.shape),
        passed=passed,
        max_abs_err=worst,
        tolerance=dict(TOLERANCES),
        nonfinite=nonfinite,
        message=""
        if passed
        else f"max abs diff {worst:.3g} over atol {TOLERANCES['atol']} + rtol {TOLERANCES['rtol']}",
    )


def _status(cases: list[Case]) -> str:
    return "passed" if all(c.passed for c in cases) else "failed"


def _encoder_parity(graphs: WhisperGraphs, ref: Any, features: np.ndarray) -> CheckResult:
    import torch

    cases = []
    groups = [(f"clip {i} alone", features[i : i + 1]) for i in range(features.shape[0])]
    groups.append((f"batch of {features.shape[0]}", features))
    for label, feats in groups:
        case = Case(label)
        try:
            with torch.inference_mode():
                want = ref.model.encoder(torch.from_numpy(feats)).last_hidden_state.float().numpy()
            case.comparisons.append(_close("last_hidden_state", graphs.encode(feats), want))
        except Exception as exc:
            case.error = f"{type(exc).__name__}: {exc}"
        cases.append(case)
    return CheckResult("encoder parity", CPU, _status(cases), cases)


def _decoder_parity(graphs: WhisperGraphs, ref: Any, features: np.ndarray) -> CheckResult:
    import torch

    spec = graphs.spec
    prefix = initial_tokens(spec, language="en" if spec.lang_to_id else None, task=None)
    # a few text tokens after the prefix: the cached steps see real history
    text = [t % spec.eos_token_id for t in (300, 301, 302, 17, 250)]
    tokens = np.array([prefix + text] * features.shape[0], dtype=np.int64)
    case = Case(f"batch of {features.shape[0]}, {len(prefix)} first tokens + {len(text)} cached steps")
    try:
        with torch.inference_mode():
            want = (
                ref(input_features=torch.from_numpy(features), decoder_input_ids=torch.from_numpy(tokens))
                .logits.float()
                .numpy()
            )
        hidden = graphs.encode(features)
        logits, cache = graphs.start(hidden, tokens[:, : len(prefix)])
        case.comparisons.append(_close("logits (decoder)", logits, want[:, : len(prefix)]))
        for j in range(len(prefix), tokens.shape[1]):
            step_logits, cache = graphs.step(tokens[:, j : j + 1], cache)
            case.comparisons.append(
                _close(f"logits (step {j - len(prefix) + 1}, with past)", step_logits, want[:, j : j + 1])
            )
    except Exception as exc:
        case.error = f"{type(exc).__name__}: {exc}"
    return CheckResult("decoder parity", CPU, _status([case]), [case])


def _onnx_tokens(
    graphs: WhisperGraphs, features: np.ndarray, language: str | None, task: str | None, timestamps: bool, n: int
) -> list[list[int]]:
    spec = graphs.spec
    hidden = graphs.encode(features)
    detected = graphs.detect_languages(hidden) if needs_language(spec, task=task, language=language) else None
    prefixes = [
        initial_tokens(
            spec,
            task=task,
            language=language,
            timestamps=timestamps,
            detected_language_id=None if detected is None else int(detected[i]),
        )
        for i in range(features.shape[0])
    ]
    generated = graphs.greedy(hidden, prefixes, LogitRules(spec, timestamps=timestamps), n)
    return [_until_eos(row, spec.eos_token_id) for row in generated]


def _until_eos(row: Sequence[int], eos: int) -> list[int]:
    """The tokens before the first end of text (generate pads finished rows with it, and its
    Whisper path drops the end of text itself from what it returns)."""
    row = list(row)
    return row[: row.index(eos)] if eos in row else row


def _torch_tokens(
    ref: Any, spec: WhisperSpec, features: np.ndarray, language: str | None, task: str | None, timestamps: bool, n: int
) -> list[list[int]]:
    import torch

    with torch.inference_mode():
        out = ref.generate(
            torch.from_numpy(features),
            language=language,
            task=task,
            return_timestamps=timestamps,
            max_new_tokens=n,
            do_sample=False,
            num_beams=1,
            # with timestamps, generate decodes a clip again from its last segment until the clip is
            # used up (the long-form loop, which transcribe() reproduces); one pass checks the graphs
            # and the logit rules, and random weights could need a thousand passes
            force_unique_generate_call=True,
        )
    sequences = out["sequences"] if isinstance(out, dict) else out
    # generate returns the initial tokens first (one length whichever language): then what it generated
    begin = len(initial_tokens(spec, task=task, language=language, timestamps=timestamps, detected_language_id=0))
    return [_until_eos(row[begin:], spec.eos_token_id) for row in sequences.tolist()]


def _tokens_case(label: str, ours: list[list[int]], theirs: list[list[int]]) -> Case:
    case = Case(label)
    diffs = []
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        if a != b:
            at = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            diffs.append(f"row {i} differs at token {at}: onnx {a[at : at + 3]} vs torch {b[at : at + 3]}")
    same = sum(a == b for a, b in zip(ours, theirs, strict=True))
    case.comparisons.append(
        Comparison(
            output="tokens",
            shape=[len(ours), max((len(r) for r in ours), default=0)],
            passed=not diffs,
            metric="rows equal",
            metric_value=same / max(len(ours), 1),
            message="; ".join(diffs[:3]),
        )
    )
    return case


def _greedy_parity(graphs: WhisperGraphs, ref: Any, features: np.ndarray, n: int) -> CheckResult:
    cases = []
    for label, language, task, timestamps in GREEDY_OPTIONS:
        if language is not None and not graphs.spec.lang_to_id:
            continue
        try:
            theirs = _torch_tokens(ref, graphs.spec, features, language, task, timestamps, n)
            batched = _onnx_tokens(graphs, features, language, task, timestamps, n)
            cases.append(_tokens_case(f"{label}: batch of {features.shape[0]}", batched, theirs))
            alone = [
                _onnx_tokens(graphs, features[i : i + 1], language, task, timestamps, n)[0] for i in range(len(theirs))
            ]
            cases.append(_tokens_case(f"{label}: each clip alone", alone, theirs))
        except Exception as exc:
            cases.append(Case(label, error=f"{type(exc).__name__}: {exc}"))
    return CheckResult("greedy tokens", CPU, _status(cases), cases)


def _batching_invariance(graphs: WhisperGraphs, features: np.ndarray, n: int) -> CheckResult:
    label, language, task, timestamps = GREEDY_OPTIONS[0]
    try:
        batched = _onnx_tokens(graphs, features, language, task, timestamps, n)
        alone = [
            _onnx_tokens(graphs, features[i : i + 1], language, task, timestamps, n)[0] for i in range(len(batched))
        ]
        case = _tokens_case(f"{label}: alone vs batch of {features.shape[0]}", alone, batched)
    except Exception as exc:
        case = Case(label, error=f"{type(exc).__name__}: {exc}")
    return CheckResult("batching invariance", CPU, _status([case]), [case])
