"""``validate``: the checks on every requested provider, the report, and the manifest."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..._ort import CPU, arithmetic, parity_tolerances, parse_provider_names
from ...errors import ManifestError, ModelIntegrityError
from ...manifest import Manifest
from ..recipes import DEFAULT_SAMPLES, tolerances_for
from ..reference import Reference, load_reference
from .onnx_model import OnnxModel, not_here, open_sessions, vocab_size
from .results import NOT_RUN, CheckResult, ValidationReport
from .suite import (
    CHECKS,
    GREEDY_TOKENS,
    CheckContext,
    batching_invariance,
    finite_weights,
    provider_parity,
    reference_parity,
    shape_generalisation,
    status_of,
)

__all__ = ["validate"]


def _normalise_providers(providers: Sequence[str] | str | None, manifest: Manifest) -> list[str]:
    if providers is None:
        providers = manifest.validation.get("providers") or [CPU]
    names = parse_provider_names(providers)  # the one spelling table; unknown names refused
    out = [CPU] + [p for p in names if p != CPU]  # CPU is always the baseline
    return list(dict.fromkeys(out))


def validate(
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
    """Run the built-in checks on an export directory.

    Args:
        directory: an ``ortbatch export`` directory (with ``ortbatch.json``).
        providers: execution providers to check (names or ``cpu``/``cuda``/``trt``);
            CPU is always checked as the baseline. Default: the manifest's.
        samples: texts to tokenize (default: the manifest's, from the recipe).
        reference: an already loaded PyTorch model (default: load ``source.model``).
        use_reference: ``False`` runs the ONNX-only checks.
        tolerances: overrides for this run (keys atol, rtol, cosine, argmax, greedy).
        save: write ``validation.json`` and record the result in ``ortbatch.json``.

    Returns:
        The :class:`ValidationReport`; it does not raise when a check fails (see
        :meth:`ValidationReport.raise_for_failures`). When the PyTorch model cannot be
        loaded, reference parity is reported as skipped and says why.
    """
    from .vision import is_image_export, validate_vision

    if is_image_export(directory):  # images: the same checks on pictures (checks/vision.py)
        return validate_vision(
            directory,
            providers,
            samples=samples,
            reference=reference,
            use_reference=use_reference,
            tolerances=tolerances,
            save=save,
            seed=seed,
            progress=progress,
        )
    say = progress or (lambda msg: None)
    if Manifest.load(directory).source.get("family") == "speech-seq2seq":
        # Whisper: audio in, not texts; its own checks (export/whisper.py), on CPU
        from ..whisper import validate_whisper

        return validate_whisper(
            directory, reference=reference, use_reference=use_reference, save=save, progress=progress
        )
    t0 = time.perf_counter()
    plan = _plan(directory, providers, samples, tolerances)
    ref: Reference | None = None
    reason = "not requested (--no-reference / use_reference=False)"
    embedding_ref: tuple[Any, str, str] | None = None
    if use_reference:
        say("loading the PyTorch reference")
        ref, reason = load_reference(plan.manifest.source, reference)
        if ref is not None:
            embedding_ref, why = _embedding_reference(plan)
            if why:  # the transformer is there but not the model the user embeds with
                ref, reason = None, why
    report = ValidationReport(
        directory=os.fspath(plan.directory),
        task=str(plan.manifest.source.get("task", "")),
        dtype=plan.dtype,
        providers=plan.providers,
        reference={"available": ref is not None, "reason": reason},
        tolerances=dict(plan.base_tol),
        variant=plan.variant,
    )
    cpu_model: OnnxModel | None = None
    for provider in plan.providers:
        checks, model = _check_provider(plan, provider, ref, reason, seed, cpu_model, say, embedding_ref)
        report.checks.extend(checks)
        if provider == CPU:
            cpu_model = model
    say("finite weights")
    report.checks.append(finite_weights(plan.manifest))
    report.seconds = time.perf_counter() - t0
    if save:
        _record(report, plan.manifest, ref is not None)
    return report


@dataclass
class _Plan:
    """What every provider's checks share: the export, its samples and its tolerances."""

    manifest: Manifest
    directory: Path
    providers: list[str]
    tokenizer: Any
    dtype: str
    variant: str | None  # the quantization mode, None when not quantized
    base_tol: dict[str, float]
    fp16_tol: dict[str, float]
    rows: list[list[int]]
    max_seq: int
    texts: list[str]


def _plan(
    directory: str | os.PathLike[str],
    providers: Sequence[str] | str | None,
    samples: Sequence[str] | None,
    tolerances: Mapping[str, float] | None,
) -> _Plan:
    manifest = Manifest.load(directory).verify(warn=False)
    if manifest.directory is None:  # pragma: no cover - load always sets it
        raise ManifestError("manifest has no directory")
    provider_list = _normalise_providers(providers, manifest)  # before anything slow: a typo fails fast
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(os.fspath(manifest.directory))
    except Exception as exc:  # transformers raises anything from OSError to TypeError here
        present = sorted(p.name for p in manifest.directory.glob("*token*")) + sorted(
            p.name for p in manifest.directory.glob("vocab*")
        )
        raise ModelIntegrityError(
            f"{manifest.directory}: the export's tokenizer does not load (tokenizer files present: "
            f"{present or 'none'}; {type(exc).__name__}: {exc}); the checks tokenize their samples with it, as "
            f"serve does. Re-export it, or copy the checkpoint's tokenizer files (tokenizer.json, "
            f"tokenizer_config.json) back into {manifest.directory}",
            path=manifest.directory,
        ) from exc
    dtype = str(manifest.source.get("dtype", "fp32"))
    quantization = manifest.source.get("quantization")
    variant = str(quantization.get("mode", "int8")) if isinstance(quantization, dict) else None
    stored_tol = manifest.validation.get("tolerances") or (
        tolerances_for("int8", None, None, str(manifest.source.get("task", "")))
        if variant is not None
        else tolerances_for(dtype, manifest.source.get("optimize"))
    )
    base_tol = {**stored_tol, **(tolerances or {})}
    fp16_tol = {**(manifest.validation.get("tolerances_fp16") or tolerances_for("fp16")), **(tolerances or {})}
    texts = list(samples or manifest.validation.get("samples") or DEFAULT_SAMPLES)
    max_seq = int(manifest.max_sequence_length or 512)
    family = str(manifest.source.get("family", "encoder"))
    # truncated as the tokenizer truncates (a trailing SEP/EOS kept), as Embedder and encode see a long text
    enc = tokenizer(texts, add_special_tokens=True, truncation=True, max_length=max_seq)
    rows = [list(ids) for ids in enc["input_ids"]]
    if family == "decoder":
        rows = [r[: max_seq - GREEDY_TOKENS] or [tokenizer.eos_token_id or 0] for r in rows]
    return _Plan(
        manifest, manifest.directory, provider_list, tokenizer, dtype, variant, base_tol, fp16_tol, rows, max_seq, texts
    )


def _embedding_reference(plan: _Plan) -> tuple[tuple[Any, str, str] | None, str]:
    """The user's model's sentence embeddings of the samples: sentence-transformers'
    ``encode`` of the checkpoint when importable, else ortbatch's torch implementation of
    the pipeline parsed from it (never the exported graph). ``(None, "")`` for an export
    without a pipeline; ``(None, why)`` when the checkpoint cannot be read."""
    from ...embed.pipeline import EmbeddingPipeline

    pipe = EmbeddingPipeline.from_manifest(plan.manifest)
    if pipe is None:
        return None, ""
    checkpoint = str(plan.manifest.source.get("embedding_checkpoint") or plan.manifest.source.get("model") or "")
    if not checkpoint:
        return None, "the manifest does not name the checkpoint to embed the samples with"
    try:
        from .. import st_pipeline

        if pipe.source == "sentence-transformers":
            parsed = st_pipeline.read_pipeline(checkpoint)
            if parsed is None:
                return None, f"{checkpoint} has no modules.json any more"
        else:
            parsed = st_pipeline.ParsedPipeline(pipe, Path(checkpoint))
        # prompt "": the samples as they are, as the graph runs them (not the default prompt)
        vectors, by = st_pipeline.reference_embeddings(checkpoint, plan.texts, prompt="", parsed=parsed)
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return None, f"could not embed the samples with {checkpoint} ({type(exc).__name__}: {first[:300]})"
    return (vectors, by, pipe.output), ""


def _check_provider(
    plan: _Plan,
    provider: str,
    ref: Reference | None,
    reason: str,
    seed: int,
    cpu_model: OnnxModel | None,
    say: Callable[[str], None],
    embedding_ref: tuple[Any, str, str] | None = None,
) -> tuple[list[CheckResult], OnnxModel | None]:
    """The checks on one provider, and the model they ran (None when it did not start)."""
    absent = not_here(provider)
    if absent is not None:  # nothing about the export: this machine cannot run the provider
        note = f"not run: {absent}"
        return [CheckResult(name, provider, NOT_RUN, note=note) for name in CHECKS[:4]], None
    sessions, why, opts = open_sessions(plan.manifest, provider, plan.dtype)
    if sessions is None:
        out = [CheckResult("provider_parity", provider, "failed", note=why)]
        out += [CheckResult(name, provider, "skipped", note=f"{provider} is not active") for name in CHECKS[:3]]
        return out, None
    model = OnnxModel(plan.manifest, sessions, plan.tokenizer)
    # from the arithmetic really used: TF32 (TensorRT fp32), fp16 inside an fp16 engine
    tol = parity_tolerances(arithmetic(provider, opts, plan.dtype), plan.base_tol, plan.fp16_tol)
    vocab = vocab_size(plan.manifest, plan.tokenizer)
    ctx = CheckContext(
        model,
        ref,
        tol,
        plan.rows,
        plan.max_seq,
        vocab,
        seed,
        quantized=plan.variant is not None,
        embedding_ref=embedding_ref,
    )
    short = provider.replace("ExecutionProvider", "")
    out = []
    if ref is not None:
        say(f"[{short}] reference parity")
        cases = reference_parity(ctx)
        out.append(CheckResult("reference_parity", provider, status_of(cases), cases))
    else:
        out.append(CheckResult("reference_parity", provider, "skipped", note=f"no PyTorch reference: {reason}"))
    say(f"[{short}] shape generalisation")
    cases = shape_generalisation(ctx)
    note = "" if ref is not None else "ONNX-only: rows vs the same rows alone"
    out.append(CheckResult("shape_generalisation", provider, status_of(cases), cases, note=note))
    say(f"[{short}] batching invariance")
    cases = batching_invariance(ctx)
    out.append(CheckResult("batching_invariance", provider, status_of(cases), cases))
    if provider != CPU and cpu_model is not None:
        say(f"[{short}] provider parity")
        cases = provider_parity(ctx, cpu_model)
        out.append(CheckResult("provider_parity", provider, status_of(cases), cases))
    return out, model


def _record(report: ValidationReport, manifest: Manifest, ran_reference: bool) -> None:
    """Write ``validation.json`` and the result into ``ortbatch.json``."""
    assert manifest.directory is not None
    report.save(manifest.directory / "validation.json")
    manifest.validation = {
        **manifest.validation,
        "passed": report.passed,
        "report": "validation.json",
        "not_run": report.not_run(),
        "reference_parity": "ran" if ran_reference else "skipped",
    }
    manifest.save()
