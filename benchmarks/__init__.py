"""Benchmarks: mlx-prefix against mlx_lm.server and vllm-mlx, side by side in one run.

    python -m mlx_prefix.blas_exec .venv/bin/python -m benchmarks --profile quick|full

README.md is the map (the harness, workloads, peers, the report, studies/); RESULTS.md
holds today's figures and HISTORY.md earlier ones.
"""
