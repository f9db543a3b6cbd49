"""What really loads here: ``python -m ortbatch._ort.probe [--json FILE]``.

``onnxruntime.get_available_providers()`` lists what the wheel was built with: the
onnxruntime-gpu 1.31.1 wheel lists TensorRT and CUDA on a machine without CUDA. A tiny
session per provider shows what loads. scripts/gpu-check.sh and the gpu tests decide
from this, so a missing TensorRT library is a skip, not a failure.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from .._extras import require
from .providers import CPU, CUDA, TRT, probe_providers

__all__ = ["loads", "main", "probe"]


def loads(name: str) -> bool:
    """Whether execution provider ``name`` really starts here (False without onnxruntime)."""
    try:
        return bool(probe()["loads"].get(name, False))
    except ImportError:
        return False


def probe() -> dict[str, Any]:
    """``{"onnxruntime": version, "built_with": [...], "loads": {name: bool}, "errors": {...}}``."""
    ort = require("onnxruntime")
    built = list(ort.get_available_providers())
    loads: dict[str, bool] = {CPU: True}
    errors: dict[str, str] = {}
    for name, chain in ((CUDA, (CUDA, CPU)), (TRT, (TRT, CUDA, CPU))):
        if name not in built:
            loads[name] = False
            errors[name] = "not in this onnxruntime build"
            continue
        active, error = probe_providers(chain)
        loads[name] = name in active
        if not loads[name]:
            errors[name] = error or f"a session asked for {name} got {list(active)}"
    return {"onnxruntime": ort.__version__, "built_with": built, "loads": loads, "errors": errors}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ortbatch._ort.probe", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=None, help="also write the result to this file")
    args = p.parse_args(argv)
    result = probe()
    text = json.dumps(result, indent=2)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    print(text)
    for name, ok in result["loads"].items():
        print(f"{name}: {'loads' if ok else 'does not load: ' + result['errors'].get(name, '')}", file=sys.stderr)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
