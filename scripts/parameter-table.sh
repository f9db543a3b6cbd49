#!/usr/bin/env bash
# Rewrite docs/serving.md's parameter table from ortbatch.serve.served.parameters (the policy);
# tests/generation/test_serve_policy.py fails while the two differ.
set -euo pipefail
cd "$(dirname "$0")/.."
python - <<'PY'
from pathlib import Path

from ortbatch.serve.served.parameters import parameter_table

docs = Path("docs/serving.md")
text = docs.read_text()
begin = text.index("\n", text.index("<!-- parameters:begin")) + 1
end = text.index("<!-- parameters:end -->")
docs.write_text(text[:begin] + parameter_table() + text[end:])
PY
