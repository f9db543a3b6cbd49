#!/usr/bin/env bash
# Download the onnxruntime-gpu wheel for the GPU machine (Python 3.12, no network there) and
# split it into parts small enough to travel with the working tree, into .ortwheel/ (ignored).
#
#   scripts/fetch-ort-gpu-wheel.sh [VERSION]        # default 1.31.1
#
# Leaves .ortwheel/part-aa, part-ab, ... (60 MiB each), WHEEL_NAME and SHA256SUMS (of the
# whole wheel). scripts/gpu-check.sh joins, verifies and installs them. One device call
# carries at most 64 MiB, so carry one part per call while the machine is warm (files a
# previous call left in ignored paths stay there), then run gpu-check.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION="${1:-1.31.1}"
DEST=.ortwheel
PY="${PYTHON:-python3}"
mkdir -p "$DEST"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    -d "$tmp" "onnxruntime-gpu==${VERSION}"
wheel="$(ls "$tmp"/onnxruntime_gpu-*.whl)"
name="$(basename "$wheel")"
rm -f "$DEST"/part-* "$DEST"/WHEEL_NAME "$DEST"/SHA256SUMS
(cd "$tmp" && sha256sum "$name") > "$DEST/SHA256SUMS"
echo "$name" > "$DEST/WHEEL_NAME"
split -b 60M "$wheel" "$DEST/part-"
ls -l "$DEST"
echo "$name: $(du -h "$wheel" | cut -f1) in $(ls "$DEST"/part-* | wc -l) parts under $DEST/"
