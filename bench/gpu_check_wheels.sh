#!/usr/bin/env bash
# Wheels bench/gpu_check.sh needs on a GPU image that has torch and transformers only,
# for each Python in PYVERS (binary ones: one per version). Run here, where PyPI is
# reachable; carry DIR to the GPU machine (well under 64 MiB) and pass --wheels DIR.
#   bench/gpu_check_wheels.sh [DIR=.gpu_wheels]   (PYVERS="3.10 3.11 3.12 3.13")
set -euo pipefail
DIR=${1:-.gpu_wheels}
PY=${PYTHON:-python3}
mkdir -p "$DIR"
# pydantic pins its pydantic-core exactly: take the pair this machine runs
PYD=$("$PY" -c 'import pydantic, pydantic_core; print(pydantic.VERSION, pydantic_core.__version__)')
PURE="pydantic==${PYD% *} annotated-types typing-inspection typing-extensions httpx httpcore h11 anyio idna certifi sniffio
      boto3 botocore s3transfer jmespath python-dateutil six urllib3"
"$PY" -m pip download --quiet --no-deps --only-binary=:all: -d "$DIR" $PURE
for v in ${PYVERS:-3.10 3.11 3.12 3.13}; do
  "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$v" \
    --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d "$DIR" "pydantic-core==${PYD#* }" psutil megatron-core \
    || echo "some wheel for Python $v is missing" >&2
done
du -sh "$DIR"
