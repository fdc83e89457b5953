"""MLX forwards (engine thread): grid chunks of one or several sequences (runner.py),
the output head on a prompt's last position (head.py), quantized KV (kv_quant.py), and
--deterministic's batch-invariant layers (rowwise.py; measured and checked at startup by
engine/calibration.py and engine/probe.py). Import each name from its module.
"""
