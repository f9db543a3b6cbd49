"""The built-in accuracy checks and their report.

Four checks, run per execution provider on real tokenized sample texts:

1. ``reference_parity``: the ONNX model vs the PyTorch model, per output, with
   tolerances by dtype (elementwise ``|onnx - ref| <= atol + rtol * |ref|``) and a
   task metric: cosine similarity for embeddings and hidden states, argmax agreement
   for logits (rows whose top two reference logits are within tolerance of each other
   are ties and not counted), greedy-token agreement for generation. NaN/Inf are
   counted and always fail.
2. ``shape_generalisation``: batch sizes 1, 3 and 8, odd lengths, the maximum length
   and one below it, not the shape the export was traced at. Against the reference
   when there is one, else each row against the same row run alone.
3. ``batching_invariance``: each sample alone vs padded into a batch with the others
   (padding side and pad values from the manifest), trimmed back: what
   BatchedSession does must not change any answer. Decoders also generate greedily
   batched and alone.
4. ``provider_parity``: each requested GPU provider must really be active and agree
   with CPU; the checks above also run on it. A provider this machine cannot run at all
   (not in the onnxruntime build, or a probe session falls back to CPU) is ``not_run``
   for that provider, said so in the report, and fails nothing; one that starts here but
   not on this export is a failure.

The checks collect every comparison before deciding; nothing is downgraded to a
warning. :class:`ValidationReport` renders as a table and is saved as
``validation.json``.

The package: :mod:`.report` (the report types), :mod:`.metrics` (comparing one output),
:mod:`.runner` (the export's sessions on one provider, built by ``ortbatch._ort``),
:mod:`.suite` (the checks) and :mod:`.validation` (:func:`validate`).
"""

from .metrics import compare, compare_tokens
from .report import Case, CheckResult, Comparison, ValidationReport
from .suite import CHECKS
from .validation import validate

__all__ = [
    "CHECKS",
    "Case",
    "CheckResult",
    "Comparison",
    "ValidationReport",
    "compare",
    "compare_tokens",
    "validate",
]
