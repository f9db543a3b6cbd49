#!/usr/bin/env bash
# The GPU check for issue 6, run on the device machine (Python 3.12, CUDA 13 libraries,
# CPU-only onnxruntime preinstalled, no network):
#   1. join .ortwheel/part-* (scripts/fetch-ort-gpu-wheel.sh), verify its sha256, and
#      pip-install onnxruntime-gpu --no-deps into /tmp/ortgpu, first on PYTHONPATH;
#   2. install ortbatch itself without dependencies;
#   3. pytest -m gpu;
#   4. build a BERT-base-sized model from its config (random weights, no hub);
#   5. ortbatch bench with CUDA, then with TensorRT fp16 where that provider is available,
#      at short (8-16) and long (8-128) lengths. Target: batched >= 5x direct at 8-16.
# Everything (log, JSON, plots, summary) goes to $OUT (default out/gpu). Each step's exit
# status is recorded; the script goes on after a failed step and exits non-zero at the end.
#
#   OUT=/some/dir scripts/gpu-check.sh [--quick | --dry]
set -uo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"
OUT="${OUT:-$REPO/out/gpu}"
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu-check.log") 2>&1
PY="${PYTHON:-python3}"
WHEELS="${ORT_WHEEL_DIR:-$REPO/.ortwheel}"
SITE=/tmp/ortgpu
SELF_SITE=/tmp/ortbatch-site
MODEL=/tmp/ortbatch-bert-base
REQUESTS=2000
CONC=1,16,64,256
MODEL_ARGS=()
[ "${1:-}" = "--quick" ] && { REQUESTS=300; CONC=1,64; }
# --dry: a CPU-only rehearsal of this script (tiny model, CPU provider) to catch mistakes before
# spending device time
DRY=0
[ "${1:-}" = "--dry" ] && { DRY=1; REQUESTS=100; CONC=1,16; MODEL_ARGS=(--tiny); }
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
FAILED=()
step() { echo; echo "=== $(date -u +%H:%M:%S) $*"; }
record() { local rc=$1; shift; echo "--- rc=$rc: $*"; [ "$rc" -eq 0 ] || FAILED+=("$* (rc $rc)"); }

step "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || true
"$PY" -c 'import sys; print(sys.version)'

step "1. onnxruntime-gpu from $WHEELS"
if [ -f "$WHEELS/WHEEL_NAME" ]; then
    name="$(cat "$WHEELS/WHEEL_NAME")"
    cat "$WHEELS"/part-* > "/tmp/$name"
    (cd /tmp && sha256sum -c "$WHEELS/SHA256SUMS"); rc=$?
    record $rc "wheel parts join to the downloaded wheel"
    if [ $rc -eq 0 ]; then
        rm -rf "$SITE"
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "/tmp/$name"
        record $? "pip install --no-deps --target $SITE $name"
    fi
elif [ -d "$SITE/onnxruntime" ]; then
    echo "no parts in $WHEELS; using what an earlier run installed in $SITE"
else
    record 1 "no onnxruntime-gpu wheel parts in $WHEELS (run scripts/fetch-ort-gpu-wheel.sh and carry them)"
fi
# CUDA/cuDNN (and TensorRT, if present) libraries from the nvidia-* pip packages
NVLIBS="$("$PY" - <<'EOF'
import glob, os, site
dirs = []
for base in site.getsitepackages():
    dirs += sorted(glob.glob(os.path.join(base, "nvidia", "*", "lib")))
    dirs += sorted(glob.glob(os.path.join(base, "nvidia", "cu*", "lib")))
    dirs += sorted(glob.glob(os.path.join(base, "tensorrt_libs")))
print(":".join(dict.fromkeys(dirs)))
EOF
)"
export LD_LIBRARY_PATH="${NVLIBS}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

step "2. ortbatch (no dependencies)"
rm -rf "$SELF_SITE"
if "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target "$SELF_SITE" "$REPO"; then
    export PYTHONPATH="$SITE:$SELF_SITE"
else
    echo "pip could not build ortbatch here; importing it from the checkout instead"
    export PYTHONPATH="$SITE:$REPO"
fi
"$PY" - <<'EOF' | tee "$OUT/providers.txt"
import onnxruntime as ort, ortbatch
print("onnxruntime", ort.__version__, "from", ort.__file__)
print("ortbatch", ortbatch.__version__, "from", ortbatch.__file__)
if hasattr(ort, "preload_dlls"):
    try:
        ort.preload_dlls()
    except Exception as exc:
        print("preload_dlls:", exc)
print("available providers:", ort.get_available_providers())
EOF
record ${PIPESTATUS[0]} "import onnxruntime-gpu and ortbatch"
HAVE_CUDA=0; HAVE_TRT=0
grep -q CUDAExecutionProvider "$OUT/providers.txt" && HAVE_CUDA=1
grep -q TensorrtExecutionProvider "$OUT/providers.txt" && HAVE_TRT=1

step "3. pytest -m gpu"
# the checkout's tests against the installed package; pytest-timeout may be missing there
opts=(-o "addopts=-ra --strict-markers" -p no:cacheprovider)
"$PY" -c 'import pytest_timeout' 2>/dev/null && opts+=(--timeout 600)
(cd "$REPO" && "$PY" -m pytest -m gpu "${opts[@]}" tests 2>&1 | tee "$OUT/pytest-gpu.log"); rc=${PIPESTATUS[0]}
[ $rc -eq 5 ] && { echo "no gpu-marked tests collected"; rc=0; }
record $rc "pytest -m gpu"

step "4. BERT-base from config"
"$PY" "$REPO/benchmarks/make_bert_base.py" --out "$MODEL" --trt-cache /tmp/ortbatch-trt-cache "${MODEL_ARGS[@]}"
record $? "export BERT-base (random weights) to $MODEL"

bench() {  # provider lengths
    local prov=$1 len=$2 tag="$1-$2"
    step "5. ortbatch bench --providers $prov --lengths $len"
    "$PY" -m ortbatch.cli bench "$MODEL" --providers "$prov" --lengths "$len" --concurrency "$CONC" \
        --requests "$REQUESTS" --duration 120 --max-batch-size 32 --no-progress \
        --json "$OUT/bench-$tag.json" --plot "$OUT/bench-$tag.png" --markdown "$OUT/bench-$tag.md"
    record $? "bench $tag"
}
if [ $DRY -eq 1 ]; then
    bench cpu 8-16
elif [ $HAVE_CUDA -eq 1 ]; then
    bench cuda 8-16
    bench cuda 8-128
else
    record 1 "CUDAExecutionProvider not available: no CUDA bench"
fi
if [ $HAVE_TRT -eq 1 ]; then
    bench tensorrt 8-16
else
    echo "TensorrtExecutionProvider not available in this onnxruntime build / no TensorRT libraries: skipped"
fi

step "summary"
"$PY" - "$OUT" <<'EOF' | tee "$OUT/summary.txt"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for f in sorted(out.glob("bench-*.json")):
    d = json.loads(f.read_text())
    for r in d["ratios"]:
        print(f"{f.stem:>22} c={r['concurrency']:<4} batched/direct {r.get('batched_over_direct', float('nan')):.2f}x"
              f"  batched/oracle {r.get('batched_over_oracle', float('nan')):.2f}x")
    best = max((r.get("batched_over_direct", 0) for r in d["ratios"]), default=0)
    if "8-16" in f.stem:
        print(f"{f.stem}: target batched >= 5x direct at 8-16 tokens: best {best:.2f}x ->",
              "met" if best >= 5 else "MISSED")
EOF
if [ ${#FAILED[@]} -gt 0 ]; then
    printf 'FAILED: %s\n' "${FAILED[@]}"
    exit 1
fi
echo "gpu-check: all steps passed"
