"""The checks themselves, each a list of :class:`Case` for one provider."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np

from ...manifest import Manifest
from ..reference import Reference
from .agreement import compare, compare_tokens
from .onnx_model import OnnxModel, component_files, positions
from .results import Case, CheckResult, Comparison, shorten

__all__ = [
    "CHECKS",
    "GREEDY_TOKENS",
    "CheckContext",
    "batching_invariance",
    "finite_weights",
    "provider_parity",
    "reference_parity",
    "shape_generalisation",
    "status_of",
]

CHECKS = ("reference_parity", "shape_generalisation", "batching_invariance", "provider_parity", "finite_weights")
GREEDY_TOKENS = 8


class CheckContext:
    def __init__(
        self,
        model: OnnxModel,
        ref: Reference | None,
        tol: Mapping[str, float],
        samples: list[list[int]],
        max_seq: int,
        vocab: int,
        seed: int,
        quantized: bool = False,
        embedding_ref: tuple[np.ndarray, str, str] | None = None,
    ) -> None:
        self.quantized = quantized
        # the user's model's sentence embeddings of the samples, what computed them, and the
        # graph output they are compared with (sentence_embedding, or sparse_embedding)
        self.embedding_ref = embedding_ref
        self.model = model
        self.ref = ref
        self.tol = tol
        self.samples = samples
        self.max_seq = max_seq
        self.vocab = vocab
        self.rng = np.random.default_rng(seed)

    def random_ids(self, batch: int, length: int) -> np.ndarray:
        low = min(5, self.vocab - 1)  # skip the first ids, where most tokenizers keep specials
        return self.rng.integers(low, self.vocab, size=(batch, length), dtype=np.int64)


def _seq_axis(
    axes: Sequence[str | None], role_prefixes: tuple[str, ...] = ("sequence", "total_sequence", "encoder_sequence")
) -> int | None:
    for i, a in enumerate(axes):
        if i > 0 and a is not None and a in role_prefixes:
            return i
    return None


def _case(label: str, fn: Callable[[Case], None]) -> Case:
    case = Case(label)
    try:
        fn(case)
    except Exception as exc:  # a failing run is the finding, recorded per case
        text = str(exc).strip()
        case.error = f"{type(exc).__name__}: {shorten(text.splitlines()[0] if text else '', 300)}"
    return case


def reference_parity(ctx: CheckContext) -> list[Case]:
    m, ref, tol = ctx.model, ctx.ref, ctx.tol
    assert ref is not None
    rows = ctx.samples
    cases = []
    if m.family == "encoder":

        def run(case: Case) -> None:
            ids, mask = m.pad_rows(rows)
            feed = m.feed("model", ids, mask)
            got = m.run("model", feed)
            want = ref.encoder(feed, list(got))
            axes = m.output_axes("model")
            for name, value in got.items():
                if ctx.embedding_ref is not None and name == ctx.embedding_ref[2]:
                    continue  # compared with the user's model's encode in its own case below
                if name not in want:
                    case.comparisons.append(
                        Comparison(
                            name, list(value.shape), True, message="not compared: the PyTorch model has no such output"
                        )
                    )
                    continue
                case.comparisons.append(
                    compare(name, value, want[name], tol, seq_axis=_seq_axis(axes.get(name, [])), mask=mask)
                )

        cases.append(_case(f"{len(rows)} samples, {m.side}-padded", run))
        if ctx.embedding_ref is not None:
            want_emb, by, output = ctx.embedding_ref

            def run_embedding(case: Case) -> None:
                ids, mask = m.pad_rows(rows)
                got = m.run("model", m.feed("model", ids, mask))[output]
                case.comparisons.append(compare(output, got, want_emb, tol, metric="cosine"))

            cases.append(_case(f"{output} vs {by}, {len(rows)} samples, {m.side}-padded", run_embedding))
    elif m.family == "decoder":

        def run_logits(case: Case) -> None:
            ids, mask = m.pad_rows(rows, "left")
            feed = m.feed("model", ids, mask)
            got = m.run("model", feed)["logits"]
            want = ref.decoder_logits(feed)
            case.comparisons.append(compare("logits", got, want, tol, seq_axis=1, mask=mask))

        cases.append(_case(f"{len(rows)} samples, left-padded", run_logits))
    else:

        def run_seq2seq(case: Case) -> None:
            ids, mask = m.pad_rows(rows, "right")
            enc = m.run("encoder", m.feed("encoder", ids, mask))["last_hidden_state"]
            case.comparisons.append(
                compare("encoder.last_hidden_state", enc, ref.encoder_hidden(ids, mask), tol, seq_axis=1, mask=mask)
            )
            dec = np.full((len(rows), 1), m.start_id, dtype=np.int64)
            got = m.run("decoder", m.feed("decoder", dec, mask, encoder_hidden_states=enc))["logits"]
            case.comparisons.append(compare("decoder.logits", got, ref.seq2seq_logits(ids, mask, dec), tol))

        cases.append(_case(f"{len(rows)} samples, right-padded", run_seq2seq))
    if m.family in ("decoder", "seq2seq"):

        def run_greedy(case: Case) -> None:
            got, _ = m.greedy(rows, GREEDY_TOKENS)
            want, top2 = ref.greedy([list(r) for r in rows], GREEDY_TOKENS, m.pad_id, m.start_id)
            case.comparisons.append(compare_tokens("greedy_tokens", got, want, tol, top2))

        cases.append(_case(f"greedy {GREEDY_TOKENS} tokens, {len(rows)} prompts", run_greedy))
    return cases


def _shape_cases(ctx: CheckContext) -> list[tuple[int, int]]:
    top = ctx.max_seq
    shapes = [(1, 7), (3, 13), (8, 5), (2, max(1, top - 1)), (1, top)]
    return [(b, min(length, top)) for b, length in shapes]


def shape_generalisation(ctx: CheckContext) -> list[Case]:
    m, ref, tol = ctx.model, ctx.ref, ctx.tol
    if ctx.quantized:  # random token ids are far from real text: int8 has its own floors there
        tol = {
            **tol,
            "cosine": tol.get("random_cosine", tol["cosine"]),
            "token_cosine": tol.get("random_cosine", tol["cosine"]),
            "argmax": tol.get("random_argmax", tol["argmax"]),
        }
    comp_name = "encoder" if m.family == "seq2seq" else "model"
    axes = m.output_axes(comp_name)
    cases = []
    for batch, length in _shape_cases(ctx):
        ids = ctx.random_ids(batch, length)
        mask = np.ones_like(ids)

        def run(
            case: Case, ids: np.ndarray = ids, mask: np.ndarray = mask, batch: int = batch, length: int = length
        ) -> None:
            feed = m.feed(comp_name, ids, mask)
            got = m.run(comp_name, feed)
            if ref is not None:
                if m.family == "encoder":
                    want = ref.encoder(feed, list(got))
                elif m.family == "decoder":
                    want = {"logits": ref.decoder_logits(feed)}
                else:
                    want = {"last_hidden_state": ref.encoder_hidden(ids, mask)}
            else:  # ONNX-only: each row must equal the same row run alone
                want = {}
                singles = [
                    m.run(comp_name, m.feed(comp_name, ids[i : i + 1], mask[i : i + 1])) for i in range(len(ids))
                ]
                for name in got:
                    want[name] = np.concatenate([s[name] for s in singles], axis=0)
            for name, value in got.items():
                _check_dims(case, name, value, axes.get(name, []), batch, length)
                if name in want:
                    case.comparisons.append(compare(name, value, want[name], tol))

        cases.append(_case(f"batch={batch} len={length}", run))
    if m.family == "decoder" and any(i.name.startswith("past_key_values") for i in m.inputs("model")):
        cases.append(_case("decode step batch=3 past=13", lambda case: _decode_step(ctx, case, 3, 13)))
    return cases


def _decode_step(ctx: CheckContext, case: Case, batch: int, past: int) -> None:
    m, ref, tol = ctx.model, ctx.ref, ctx.tol
    ids = ctx.random_ids(batch, past + 1)
    mask = np.ones_like(ids)
    pre = m.run("model", m.feed("model", ids[:, :past], mask[:, :past]))
    kv = {k.replace("present", "past_key_values"): v for k, v in pre.items() if k.startswith("present")}
    step = m.run("model", m.feed("model", ids[:, past:], mask, position_ids=positions(mask)[:, past:], **kv))
    if ref is not None:
        want = ref.decoder_logits({"input_ids": ids, "attention_mask": mask, "position_ids": positions(mask)})
    else:
        want = m.run("model", m.feed("model", ids, mask))["logits"]
    case.comparisons.append(compare("logits", step["logits"], want[:, -1:], tol))


def _check_dims(case: Case, name: str, value: np.ndarray, axes: Sequence[str | None], batch: int, length: int) -> None:
    problems = []
    if value.ndim == 0 or value.shape[0] != batch:
        problems.append(f"batch dim {value.shape[:1]} != {batch}")
    for i, a in enumerate(axes):
        if (
            i > 0
            and i < value.ndim
            and a in ("sequence", "total_sequence", "encoder_sequence")
            and value.shape[i] != length
        ):
            problems.append(f"axis {i} ({a}) is {value.shape[i]}, expected {length}")
    if problems:
        case.comparisons.append(Comparison(name, list(value.shape), False, message="; ".join(problems)))


def batching_invariance(ctx: CheckContext) -> list[Case]:
    m, tol = ctx.model, ctx.tol
    rows = ctx.samples
    comp_name = "encoder" if m.family == "seq2seq" else "model"
    side = "right" if m.family == "seq2seq" else m.side
    cases = []

    def run(case: Case) -> None:
        ids, mask = m.pad_rows(rows, side)
        batched = m.run(comp_name, m.feed(comp_name, ids, mask))
        alone = [m.run(comp_name, m.feed(comp_name, *m.pad_rows([r], side))) for r in rows]
        for name, value in batched.items():
            want: list[np.ndarray] = []
            got: list[np.ndarray] = []
            for i, single in enumerate(alone):
                ref = single[name]
                row = value[i : i + 1]
                if row.shape != ref.shape:
                    slices = []
                    for ax, (n_b, n_a) in enumerate(zip(row.shape, ref.shape, strict=False)):
                        if n_b == n_a:
                            slices.append(slice(None))
                        elif side == "left":
                            slices.append(slice(n_b - n_a, None))
                        else:
                            slices.append(slice(0, n_a))
                        if n_a > n_b:
                            raise ValueError(f"output {name!r} axis {ax} is {n_a} alone but {n_b} batched")
                    row = row[tuple(slices)]
                if ctx.quantized and row.ndim > 1:
                    got.append(row.reshape(-1, row.shape[-1]))
                    want.append(ref.reshape(-1, ref.shape[-1]))
                else:
                    got.append(row.reshape(-1))
                    want.append(ref.reshape(-1))
            # dynamic int8 scales activations over the whole batch, so rows move a little
            # with their batch mates: judged by the task metric per row, not elementwise alone
            if ctx.quantized and value.ndim > 1:
                row_tol = {**tol, "cosine": tol.get("token_cosine", tol["cosine"])} if value.ndim >= 3 else tol
                comp = compare(name, np.concatenate(got), np.concatenate(want), row_tol)
            else:
                comp = compare(name, np.concatenate(got), np.concatenate(want), tol, metric=None)
            comp.shape = list(value.shape)
            if not comp.passed:
                comp.message = f"changes when padded into a batch of {len(rows)} ({side} padding): {comp.message}"
            case.comparisons.append(comp)

    cases.append(_case(f"{len(rows)} samples alone vs batched", run))
    if m.family in ("decoder", "seq2seq"):

        def run_greedy(case: Case) -> None:
            batched, _ = m.greedy(rows, GREEDY_TOKENS)
            singles = [m.greedy([r], GREEDY_TOKENS) for r in rows]
            alone = np.concatenate([t for t, _ in singles], axis=0)
            top2 = np.concatenate([t2 for _, t2 in singles], axis=0)
            case.comparisons.append(compare_tokens("greedy_tokens", batched, alone, {**tol, "greedy": 1.0}, top2))

        cases.append(_case(f"greedy {GREEDY_TOKENS} tokens alone vs batched", run_greedy))
    return cases


def provider_parity(ctx: CheckContext, cpu: OnnxModel) -> list[Case]:
    m, tol = ctx.model, ctx.tol
    rows = ctx.samples
    comp_name = "encoder" if m.family == "seq2seq" else "model"
    side = "right" if m.family == "seq2seq" else m.side

    def run(case: Case) -> None:
        ids, mask = m.pad_rows(rows, side)
        got = m.run(comp_name, m.feed(comp_name, ids, mask))
        want = cpu.run(comp_name, cpu.feed(comp_name, ids, mask))
        axes = m.output_axes(comp_name)
        for name, value in got.items():
            case.comparisons.append(
                compare(name, value, want[name], tol, seq_axis=_seq_axis(axes.get(name, [])), mask=mask)
            )

    return [_case(f"{len(rows)} samples vs CPU", run)]


def finite_weights(manifest: Manifest) -> CheckResult:
    """NaN/Inf in any stored weight fails, whatever the samples exercise (see weights.py)."""
    from ..weights import nonfinite_weights

    base = manifest.directory or Path(".")
    cases = []
    for name in component_files(manifest).values():
        case = Case(name)
        try:
            read, bad = nonfinite_weights(base / name)
        except Exception as exc:  # a file onnx cannot parse: a finding, not a crash
            case.error = f"cannot read the weights: {type(exc).__name__}: {exc}"
        else:
            nonfinite = len(bad)
            message = "; ".join(bad[:3]) + (f" (+{nonfinite - 3} more)" if nonfinite > 3 else "")
            case.comparisons.append(Comparison("weights", [read], passed=not bad, nonfinite=nonfinite, message=message))
        cases.append(case)
    return CheckResult("finite_weights", "any", status_of(cases), cases)


def status_of(cases: list[Case]) -> str:
    return "passed" if all(c.passed for c in cases) else "failed"
