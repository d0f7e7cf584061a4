#!/usr/bin/env bash
# One call on the lent GPU host (no network, torch 2.11 preinstalled): install the wheels that
# `bash ../shared/gpu/fetch-wheels.sh open-clip-torch==3.3.0` put in .whl/, then run the matrix.
#   device tool:  bash bench_gpu.sh            (carry: [".whl"]; logs and table land in $OUT)
set -euo pipefail
cd "$(dirname "$0")"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 WANDB_MODE=disabled
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 bench_gpu.py --out "${OUT:-/tmp/bench-gpu}" "$@"
