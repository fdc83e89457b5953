"""MLX forwards (engine thread): grid chunks of one or several sequences (runner.py),
the output head on a prompt's last position (head.py),
quantized KV (kv_quant.py), and --deterministic's batch-invariant layers (rowwise.py;
measured and checked at startup by engine/calibration.py and engine/probe.py).
"""

from __future__ import annotations

from mlx_prefix.lazy import exports

_NAMES = {
    "ChunkWork": "runner",
    "PrefillCursor": "runner",
    "compute_chunks": "runner",
    "prefill": "runner",
    "always_trimmable": "runner",
    "last_position_head": "head",
    "KvQuant": "kv_quant",
    "batched": "rowwise",
    "install": "rowwise",
}
__all__ = list(_NAMES)
__getattr__ = exports(__name__, _NAMES)
