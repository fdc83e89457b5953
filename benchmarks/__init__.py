"""Benchmarks: mlx-prefix against mlx_lm.server and vllm-mlx, side by side in one run.

    python -m mlx_prefix.blas_exec .venv/bin/python -m benchmarks --profile quick|full

See benchmarks/run.py for the options, RESULTS.md for today's figures and HISTORY.md
for earlier ones.
"""
