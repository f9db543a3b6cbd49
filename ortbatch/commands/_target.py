"""The export a command is pointed at: one check, one message, one exit code for every
command (``validate``, ``serve``, ``generate``, ``bench``)."""

from __future__ import annotations

from pathlib import Path

from ..errors import OrtBatchError
from ..manifest import MANIFEST_NAME

__all__ = ["TargetError", "export_target"]


class TargetError(OrtBatchError):
    """The path given on the command line is not an export: a bad argument (exit 2)."""

    exit_code = 2


def export_target(path: str, *, onnx_file: bool = False, need_manifest: bool = False) -> Path:
    """``path`` as an export directory (``ortbatch.json``, or a bare ``model.onnx`` unless
    ``need_manifest``) or, with ``onnx_file``, a ``.onnx`` file; :class:`TargetError`
    saying what is there instead."""
    p = Path(path)
    what = "an export directory" + (" or a .onnx file" if onnx_file else "")
    hint = f"expected {what}, e.g. one written by `ortbatch export MODEL -o {path}`"
    if not p.exists():
        raise TargetError(f"{path} does not exist; {hint}")
    if p.is_file():
        if onnx_file and p.suffix == ".onnx":
            return p
        raise TargetError(f"{path} is a file, not an export; {hint}")
    if not p.is_dir():
        raise TargetError(f"{path} is not a directory; {hint}")
    if (p / MANIFEST_NAME).is_file() or (not need_manifest and (p / "model.onnx").is_file()):
        return p
    if (p / "config.json").is_file():  # a model checkpoint: exporting *into* it is not the fix
        out = Path("exports") / (p.resolve().name or "model")
        raise TargetError(
            f"{path} is a model checkpoint (config.json), not an export; export it first: "
            f"`ortbatch export {path} -o {out}`, then point this command at {out}"
        )
    missing = MANIFEST_NAME if need_manifest else f"{MANIFEST_NAME} nor model.onnx"
    raise TargetError(f"{path} is not an export: it has no {missing}; {hint}")
