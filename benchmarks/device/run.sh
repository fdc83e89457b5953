#!/usr/bin/env bash
# Issue 47's device benchmark (benchmarks/device/bench.py) on the lent GPU machine, from the
# wheels benchmarks/device/prepare.sh readied here. One call carries 64 MiB, so the wheels
# travel in three back-to-back calls on a warm machine (it keeps ignored files between calls):
#   1. carry .whl/p1, command `true`;  2. carry .whl/p2, command `true`;
#   3. carry .whl/p3, command `bash benchmarks/device/run.sh` (timeout_s 600).
# It installs the wheels into /tmp/site (once), says what it runs on, then runs the benchmark
# under a 9-minute deadline; the JSON, the table, the log and the servers' logs land in $OUT.
# Arguments go to `python -m benchmarks.device` (e.g. `--models dense` for one model per call).
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/device-out}
mkdir -p "$out"
if [ ! -d /tmp/site/mlx ]; then
  cat .whl/p1/cuda.part.* .whl/p2/cuda.part.* > ".whl/p3/$(cat .whl/p3/cuda-wheel-name)"
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/p3/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c 'import mlx.core as mx; print("mlx", mx.__version__, mx.default_device(), "cuda:", mx.cuda.is_available())'
set -o pipefail
timeout 540 python3 -m benchmarks.device --out "$out" --work /tmp/device-models "$@" \
  2>&1 | tee "$out/log.txt"
