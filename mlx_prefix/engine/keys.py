"""What a cache entry's key is made of: everything that decides whether a stored state
reproduces a cold run of this engine."""

from __future__ import annotations

import hashlib

import mlx.core as mx

from mlx_prefix.models.identity import ModelIdentity
from mlx_prefix.platform import device_name, loaded_blas
from mlx_prefix.prompt.grid import ChunkGrid


def cache_key(identity: ModelIdentity, grid: ChunkGrid) -> str:
    """The key of every cache entry this engine makes. An entry reproduces a cold run
    only for the same weights (identity), the same chunk grid and the same kernels
    (device, BLAS, MLX version), so all of them are in it (DESIGN 4 and 7); a server
    restarted with another --prefill-chunk or BLAS never reads the old files."""
    parts = [identity.key(), grid.signature(), device_name(), loaded_blas(), mx.__version__]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
