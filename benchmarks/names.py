"""The names a run's results are keyed on: the servers it compares and the references
beside them. A leaf module: every other benchmark module may import it."""

from __future__ import annotations

OURS = "mlx-prefix"
PEER = "mlx_lm.server"
VLLM = "vllm-mlx"
SERVERS = (OURS, PEER, VLLM)  # the shared servers, in report order
PEERS = (PEER, VLLM)  # what issue 33's goals call "the faster peer" is the faster of these
# Issue 33's throughput workload only: mlx-prefix in batch-invariant mode, and mlx-lm's
# own single-stream decode (no server).
OURS_DETERMINISTIC = "mlx-prefix --deterministic"
GENERATE = "mlx_lm.generate"
# Issue 42's image benchmark only (studies/vision.py): mlx-vlm's own server, the peer that
# serves images where mlx_lm.server cannot.
MLX_VLM = "mlx-vlm"
