"""Write the vendored CRD schemas in this folder from the operators' published CRD files.

    python tests/deploy/crds/vendor.py serving.kserve.io_servingruntimes.yaml \
        serving.kserve.io_inferenceservices.yaml ray.io_rayservices.yaml

For each CRD file, ``KIND-VERSION.json.gz`` for its storage version (the one the API server
keeps, which manifests should use): that version's
``openAPIV3Schema`` as published, with every ``description`` removed (they are most of the
bytes and validate nothing), as JSON with sorted keys, gzipped without a time stamp so the
same input gives the same bytes. The sources, their versions and checksums: README.md here.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent


def strip_descriptions(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: strip_descriptions(v) for k, v in node.items() if k != "description"}
    if isinstance(node, list):
        return [strip_descriptions(v) for v in node]
    return node


def vendor(crd_file: Path) -> list[Path]:
    crd = yaml.safe_load(crd_file.read_text())
    kind = crd["spec"]["names"]["kind"].lower()
    written = []
    for version in (v for v in crd["spec"]["versions"] if v.get("storage")):
        schema = strip_descriptions(version["schema"]["openAPIV3Schema"])
        text = json.dumps(schema, sort_keys=True, separators=(",", ":")).encode()
        out = HERE / f"{kind}-{version['name']}.json.gz"
        out.write_bytes(gzip.compress(text, mtime=0))
        written.append(out)
    print(f"{crd_file.name} sha256 {hashlib.sha256(crd_file.read_bytes()).hexdigest()}")
    return written


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        for path in vendor(Path(arg)):
            print(f"  -> {path.relative_to(HERE)} ({path.stat().st_size} bytes)")
