"""What a cache entry's key is made of: everything that decides whether a stored state
reproduces a cold run of this engine, and whose entry it is.

An entry's key is `<cache_key>/<namespace id>` or `<cache_key>/<namespace id>/<salt id>`
(issue 19, invariant 10). The store and the disk tier keep one trie per whole key, so a
lookup never crosses namespaces; listings and flushes select with a key prefix
(`cache.types.covers`): the bare cache key covers every namespace of the model, a
namespace's key every salt in it. Files written before namespaces (keyed by the bare
cache key) are never matched by a request: they only age out or get flushed.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import mlx.core as mx

from mlx_prefix.models.identity import ModelIdentity
from mlx_prefix.platform import device_name, loaded_blas
from mlx_prefix.prompt.request.grid import ChunkGrid
from mlx_prefix.records import CachePreference

if TYPE_CHECKING:
    from mlx_prefix.engine.forward.kv_quant import KvQuant

SEPARATOR = "/"


def cache_key(identity: ModelIdentity, grid: ChunkGrid, kv: KvQuant | None = None) -> str:
    """The model part of every cache entry's key. An entry reproduces a cold run
    only for the same weights (identity), the same chunk grid, the same kernels
    (device, BLAS, MLX version) and the same KV quantization (`kv`; None: float), so
    all of them are in it (invariants 4 and 7); a server restarted with another
    --prefill-chunk, BLAS or --kv-bits never reads the old files."""
    mlx_version: str = mx.__version__  # type: ignore[attr-defined]  # not in mlx's stubs
    parts = [identity.key(), grid.signature(), device_name(), loaded_blas(), mlx_version]
    if kv is not None:  # float keys stay as they were: their files remain valid
        parts.append(kv.signature())
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def namespace_id(namespace: str) -> str:
    """The namespace's part of a key: a digest, so a key (in listings, file headers)
    never shows the Origin or anything else the namespace was made from."""
    return _digest("namespace", namespace)


def namespace_key(model_key: str, namespace: str) -> str:
    """The key prefix of every entry of `namespace` (any salt): what its owner lists
    and flushes."""
    return f"{model_key}{SEPARATOR}{namespace_id(namespace)}"


def entry_key(model_key: str, pref: CachePreference) -> str:
    """The key a request's entries are stored and matched under: its namespace and,
    with a `cache_salt`, that salt too."""
    key = namespace_key(model_key, pref.namespace)
    return key if pref.salt is None else f"{key}{SEPARATOR}{_digest('salt', pref.salt)}"


def namespace_of(key: str) -> str | None:
    """The namespace id in an entry key; None for a key without one (an old file)."""
    parts = key.split(SEPARATOR)
    return parts[1] if len(parts) > 1 else None


def _digest(kind: str, value: str) -> str:
    return hashlib.sha256(f"{kind}\0{value}".encode()).hexdigest()[:16]
