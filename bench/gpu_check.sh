#!/usr/bin/env bash
# The one-shot device check (issue 15): a ~0.5B Qwen2-shaped model built here, GRPO steps on
# the GPU through the node's own engine and trainer code, an engine killed and healed,
# weight-sync both ways, the same-seed bitwise check. Results -> one JSON file.
#
#   bench/gpu_check.sh [--wheels DIR] [--out FILE] [python -m bench.gpu_check flags...]
#   bench/gpu_check.sh --cpu --tiny          # the CPU rehearsal (tests/integration/test_gpu_check.py)
#
# Nothing is downloaded. Python packages the machine lacks (a GPU image with torch and
# transformers but no pydantic/httpx/boto3/megatron-core) come from --wheels DIR (made by
# bench/gpu_check_wheels.sh), installed --no-deps into ./.gpu_check_site, never over torch.
# The repo runs from PYTHONPATH (no pip install of it). What still cannot be imported is
# reported in the results' "environment" section and the check stops there cleanly.
# Budget: under 8 minutes on one H200 (the whole run is capped at GPU_CHECK_TIMEOUT_S, 470 s).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=""
OUT="gpu_check_results.json"
ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --wheels) WHEELS="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    *) ARGS+=("$1"); shift ;;
  esac
done
SITE="$PWD/.gpu_check_site"
if [ -n "$WHEELS" ]; then
  if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    echo "[gpu_check.sh] installing $(ls "$WHEELS"/*.whl | wc -l) carried wheels into $SITE (--no-deps, no index)"
    # only the wheels built for this interpreter install; the others are skipped one by one
    for w in "$WHEELS"/*.whl; do
      "$PY" -m pip install --quiet --no-index --no-deps --disable-pip-version-check --target "$SITE" "$w" \
        2>/dev/null || echo "[gpu_check.sh] skipped $(basename "$w") (not for this Python/platform)"
    done
  else
    echo "[gpu_check.sh] --wheels $WHEELS holds no wheels" >&2
  fi
fi
export PYTHONPATH="$PWD${SITE:+:$SITE}${PYTHONPATH:+:$PYTHONPATH}"
export CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8}
for m in torch transformers tokenizers safetensors pydantic httpx boto3; do
  "$PY" -c "import $m" 2>/dev/null || echo "[gpu_check.sh] missing python module: $m"
done
timeout "${GPU_CHECK_TIMEOUT_S:-470}" "$PY" -m bench.gpu_check --out "$OUT" "${ARGS[@]}"
rc=$?
[ $rc -eq 124 ] && echo "[gpu_check.sh] timed out after ${GPU_CHECK_TIMEOUT_S:-470} s; partial results in $OUT"
[ -f "$OUT" ] && echo "[gpu_check.sh] results: $OUT"
exit $rc
