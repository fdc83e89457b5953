"""Benchmarks: mlx-prefix against mlx_lm.server, side by side in one run.

    python -m mlx_prefix.blas_exec .venv/bin/python -m benchmarks --profile quick|full

See benchmarks/run.py for the options and RESULTS.md for the latest figures.
"""
