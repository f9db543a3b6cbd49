"""The public face: __all__ matches the namespace, and the runtime imports without torch."""

from __future__ import annotations

import subprocess
import sys

import ortbatch


def test_all_names_resolve_and_are_sorted_by_topic_without_duplicates():
    assert len(ortbatch.__all__) == len(set(ortbatch.__all__))
    public = {n for n in dir(ortbatch) if not n.startswith("_")}
    for name in ortbatch.__all__:
        if name in ("export_model", "validate", "ValidationReport"):
            continue  # need the export extra; resolved in the export tests
        assert getattr(ortbatch, name) is not None
    # nothing public beyond __all__ except submodules
    import types

    extra = {n for n in public - set(ortbatch.__all__) if not isinstance(getattr(ortbatch, n, None), types.ModuleType)}
    assert not extra, extra


def test_runtime_imports_without_torch_or_transformers():
    code = (
        "import sys, ortbatch\n"
        "from ortbatch import BatchedSession, Collator, Stats, Manifest\n"
        "import ortbatch.cli\n"
        "ortbatch.cli.build_parser()\n"
        "heavy = [m for m in ('torch', 'transformers', 'optimum') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_errors_have_one_root():
    from ortbatch import errors

    for name in errors.__all__:
        obj = getattr(errors, name)
        if isinstance(obj, type):
            assert issubclass(obj, errors.OrtBatchError)


def test_ort_errors_map_to_typed_errors():
    from ortbatch.errors import InferenceError, InvalidInputError, map_ort_error

    InvalidArgument = type("InvalidArgument", (Exception,), {})
    Fail = type("Fail", (Exception,), {})
    assert isinstance(map_ort_error(InvalidArgument("x")), InvalidInputError)
    assert isinstance(map_ort_error(Fail("x")), InferenceError)
    assert isinstance(map_ort_error(RuntimeError("x")), InferenceError)
