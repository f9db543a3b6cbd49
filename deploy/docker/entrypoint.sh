#!/bin/sh
# The image's entry point: `ortbatch serve` on what is mounted at $ORTBATCH_MODELS (/models).
#   - one export (ortbatch.json, or a bare model.onnx there): served as $ORTBATCH_MODEL_NAME (default "model");
#   - else a model repository: every subfolder holding an ortbatch.json is a model named after its folder.
# HTTP on $ORTBATCH_HTTP_PORT (8000), KServe v2 gRPC on $ORTBATCH_GRPC_PORT (8001; empty: no gRPC), all
# interfaces. Arguments are passed on to `ortbatch serve` after these (a later flag wins: --name X,
# --max-batch-size 64, --graceful-timeout-s 25, --api-key-file /run/secrets/key, ...).
set -eu
models="${ORTBATCH_MODELS:-/models}"
if [ ! -d "$models" ]; then
  echo "ortbatch-entrypoint: error: nothing at $models: mount an export or a model repository there" >&2
  exit 2
fi
if [ -f "$models/ortbatch.json" ] || [ -f "$models/model.onnx" ]; then
  set -- "$models" --name "${ORTBATCH_MODEL_NAME:-model}" "$@"
else
  set -- --repository "$models" "$@"
fi
if [ -n "${ORTBATCH_GRPC_PORT:-}" ]; then
  set -- --grpc-port "$ORTBATCH_GRPC_PORT" "$@"
fi
exec ortbatch serve --host "${ORTBATCH_HOST:-0.0.0.0}" --port "${ORTBATCH_HTTP_PORT:-8000}" "$@"
